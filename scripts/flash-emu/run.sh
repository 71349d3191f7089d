#!/bin/bash
# Host emulation of the attention `flash` backward kernels (kernels/flash.cu), for checking their
# index math without a GPU: every thread of a block is an OS thread, __syncthreads a barrier,
# ldmatrix / mma.m16n8k16 / shfl exchange lane data through a warp barrier (../emu-common/emu.h,
# shared with scripts/mma-emu; emu.h here holds flash.cu's PTX wrappers); bf16 only.
# Each case runs the deterministic kernels (known good on the GPU: they validate the emulation)
# and flash_bwd_fused + flash_bwd_dq_convert against an f64 reference. Not covered: timing,
# cp.async ordering (copies are synchronous), the memory model.
#
#   scripts/flash-emu/run.sh              every geometry candidate × head dim, soft-cap on and off
#   scripts/flash-emu/run.sh 128 4 32 2   one geometry (head dim, warps, query step, dQ m-tiles)
# Takes ~15 s per geometry and soft-cap setting on 2 cores (g++ with C++20).
set -e
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src="$here/../../crates/ferrite/src"
python3 "$here/../emu-common/extract.py" "$work/flash_host.cpp" "$here/emu.h" "$src/core/cuda/kernels/ferrite.cuh" \
  --remove smem_u32,dynamic_smem_bytes,cp_async16,cp_async_commit,cp_async_wait,ldsm_x4,ldsm_x4_t,mma,ex2_approx,rcp_approx,tanh_approx,tf32_rna,red_add2,ldsm_x4_s,ldsm_x4_ts,sts_u32,cp_async16_s \
  "$src/ops/attention/kernels/flash.cu"
cp "$here/driver.cpp" "$work/"
if [ $# -eq 4 ]; then
  cfgs=("$1 $2 $3 $4")
else
  cfgs=("32 4 64 2" "32 4 32 1" "64 4 64 2" "64 4 32 1" "64 8 64 2" "96 4 32 1"
        "128 4 32 2" "128 4 64 2" "128 8 64 2" "128 8 32 1" "128 4 32 1")
fi
fail=0
for cfg in "${cfgs[@]}"; do
  set -- $cfg
  for sc in 0 1; do
    exe="$work/drv_$1_$2_$3_$4_$sc"
    g++ -std=c++20 -O1 -fno-strict-aliasing -pthread -I"$here" -DFE_HEAD_DIM=$1 -DFE_BWD_WARPS=$2 -DFE_BWD_BM=$3 -DFE_BWD_QM=$4 \
      -DFE_SOFTCAP=$sc "$work/driver.cpp" -o "$exe"
    for p in 0 1 2 3 4 5; do
      out=$("$exe" $p 2>&1) || fail=1
      last=$(echo "$out" | tail -1)
      case "$last" in skip*) continue ;; esac
      echo "D$1 W$2 BM$3 QM$4 softcap=$sc case $p: $last"
      case "$last" in FAIL*) echo "$out" ;; esac
    done
  done
done
exit $fail
