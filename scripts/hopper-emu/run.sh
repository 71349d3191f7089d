#!/bin/bash
# Host emulation of the attention `hopper` kernels (kernels/hopper.cu): every thread of a block is
# an OS thread; mbarriers, TMA tile loads into 128-byte-swizzled shared memory, wgmma (operands
# through their matrix descriptors) and named barriers are modelled in emu.h here, on
# ../emu-common/emu.h. bf16 only. For each head dim the forward runs first: it is the kernel the
# H100 has checked, so its passing validates the emulator's swizzle/descriptor/fragment rules;
# then the backward (attn_hopper_bwd) runs the same cases against the f64 reference.
# Not covered: timing, the asynchrony of wgmma and TMA (both complete at issue here).
#
#   scripts/hopper-emu/run.sh            head dims 64 and 128, forward and backward, cases 0–4
#   scripts/hopper-emu/run.sh 128 1      one head dim, backward only (0: forward only)
# Takes a few minutes on 2 cores (g++ with C++20).
set -e
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src="$here/../../crates/ferrite/src"
python3 "$here/../emu-common/extract.py" "$work/hopper_host.cpp" "$here/emu.h" "$src/core/cuda/kernels/ferrite.cuh" \
  --remove smem_u32,mbar_init,mbar_expect_tx,mbar_arrive,mbar_wait,tma_load4,fence_barrier_init,fence_async_smem,named_sync,named_arrive,regs_dec,regs_inc,wgmma_fence,wgmma_commit,wgmma_wait,acc_fence,fence_mbarrier_init,ex2_approx,rcp_approx,tanh_approx,tf32_rna,wgmma_ss_n128,wgmma_rs_n128,wgmma_rs_n64,wgmma_ss_n64,wgmma_ss_tt_n64,wgmma_ss_tt_n32,red_add2,lds_f2,sts_u32 \
  "$src/ops/attention/kernels/hopper.cu"
cp "$here/driver.cpp" "$work/"
dims=(64 128); bwds=(0 1)
[ $# -ge 1 ] && dims=("$1")
[ $# -ge 2 ] && bwds=("$2")
fail=0
# Forward builds: the default configuration (3 stages, pipelined) and the plain one (2 stages,
# one tile at a time), soft-capping compiled out and in.
for d in "${dims[@]}"; do
  for bwd in "${bwds[@]}"; do
    if [ "$bwd" = 1 ]; then cfgs=("3 1 0"); else cfgs=("3 1 0" "2 0 0" "3 1 1"); fi
    for cfg in "${cfgs[@]}"; do
      set -- $cfg
      exe="$work/drv_${d}_${bwd}_$1_$2_$3"
      g++ -std=c++20 -O1 -fno-strict-aliasing -pthread -I"$here" -DFE_HEAD_DIM=$d -DFE_BWD=$bwd \
        -DFE_STAGES=$1 -DFE_PIPE=$2 -DFE_SOFTCAP=$3 -DFE_ELEM=__nv_bfloat16 -DFE_WGMMA_BF16=1 "$work/driver.cpp" -o "$exe"
      for p in 0 1 2 3 4 5; do
        out=$("$exe" $p 2>&1) || fail=1
        last=$(echo "$out" | tail -1)
        case "$last" in skip*) continue ;; esac
        echo "D$d $([ $bwd = 1 ] && echo backward || echo "forward stages=$1 pipe=$2 softcap=$3") case $p: $last"
        case "$last" in PASS*) ;; *) echo "$out" ;; esac
      done
    done
  done
done
exit $fail
