#!/bin/bash
# Host emulation of the matmul tensor-core kernel (kernels/mma.cu + common.cuh) on
# scripts/emu-common/emu.h: every CUDA thread an OS thread, __syncthreads a block barrier,
# ldmatrix / mma.sync / cp.async (lazy: a copy lands only at the wait_group that retires it)
# emulated per warp; checked against an f64 reference (driver.cpp). The launch (argument order,
# grid, block, shared memory, stage counts) is read from ops/matmul/cuda/ by launch.py. Built with ASan
# and UBSan's alignment check: an access past a buffer or a misaligned vector access aborts.
# Not covered: timing, the memory model, the SFU approximations (exact functions, tolerance).
#
#   scripts/mma-emu/run.sh            everything below (31 builds, 1120 checks: ~20 min on 2 cores)
#   scripts/mma-emu/run.sh plain      the plain mma_pipelined GEMM: bf16 and f16 in the run-time
#                                     dispatch build (all four layouts) and each FE_A_TRANS/FE_B_TRANS
#                                     build; tf32 in the dispatch build
#   scripts/mma-emu/run.sh pairs      the pair epilogue (FE_EPI_PAIRS=1, A row-major, B transposed,
#                                     MMA_STAGES): bf16, f16, tf32 × every activation (about half)
#   scripts/mma-emu/run.sh elem       the element-wise epilogue (MMA_EPI_STAGES, dispatch build), bf16
# EMU_JOBS (default 2) builds in parallel; EMU_SAN=0 builds without sanitizers (faster).
set -e
here=$(cd "$(dirname "$0")" && pwd)
src="$here/../../crates/ferrite/src"
mm="$src/ops/matmul"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$here/../emu-common/extract.py" "$work/mma_host.cpp" "$here/emu.h" "$src/core/cuda/kernels/ferrite.cuh" \
  --remove smem_u32,cp_async16,cp_async_commit,cp_async_wait,ldsm_x4,ldsm_x4_t,tf32_rna,mma,ex2_approx,rcp_approx,tanh_approx \
  --count mma_epilogue "$mm/kernels/common.cuh" "$mm/kernels/mma.cu"
cat "$mm"/cuda/*.rs > "$work/cuda_all.rs"   # matmul's CUDA host code, read as one text
eval "$(python3 "$here/launch.py" "$work/cuda_all.rs" "$src/core/act.rs" "$mm/kernels/common.cuh" "$work/launch_args.h")"
cp "$here/driver.cpp" "$work/"
san="-fsanitize=address,alignment -fno-sanitize-recover=alignment"
[ "${EMU_SAN:-1}" = 0 ] && san=""
what=${1:-all}

# name | defines | driver mode
builds=()
elem_of() { case $1 in bf16) echo "__nv_bfloat16 -DFE_MMA_KIND=1" ;; f16) echo "__half -DFE_MMA_KIND=0" ;; tf32) echo "float -DFE_MMA_KIND=2" ;; esac; }
if [ "$what" = all ] || [ "$what" = plain ]; then
  for d in bf16 f16 tf32; do
    builds+=("plain-$d-dispatch|-DFE_ELEM=$(elem_of $d) -DFE_STAGES=$MMA_STAGES|plain")
    [ $d = tf32 ] && continue
    for l in "0 0" "0 1" "1 0" "1 1"; do
      set -- $l
      builds+=("plain-$d-A$1B$2|-DFE_ELEM=$(elem_of $d) -DFE_STAGES=$MMA_STAGES -DFE_A_TRANS=$1 -DFE_B_TRANS=$2|plain")
    done
  done
fi
code=0
for act in $ACTS; do
  epi=$((1 + code)); code=$((code + 1))
  if [ "$what" = all ] || [ "$what" = pairs ]; then
    for d in bf16 f16 tf32; do
      builds+=("pairs-$d-$act|-DFE_ELEM=$(elem_of $d) -DFE_STAGES=$MMA_STAGES -DFE_A_TRANS=0 -DFE_B_TRANS=1 -DFE_EPI=$epi -DFE_EPI_PAIRS=1|epi")
    done
  fi
  if [ "$what" = all ] || [ "$what" = elem ]; then
    builds+=("elem-bf16-$act|-DFE_ELEM=$(elem_of bf16) -DFE_STAGES=$MMA_EPI_STAGES -DFE_EPI=$epi|epi")
  fi
done

build() {
  IFS='|' read -r name defs mode <<<"$1"
  g++ -std=c++20 -O1 -g -fno-strict-aliasing -pthread -Wno-unknown-pragmas $san -DEMU_CP_ASYNC_LAZY=1 \
    -I"$here" $defs "$work/driver.cpp" -o "$work/$name" 2>"$work/$name.log" || { echo "BUILD FAILED $name"; cat "$work/$name.log"; return 1; }
}
export -f build; export work here san
printf '%s\n' "${builds[@]}" | xargs -P "${EMU_JOBS:-2}" -d '\n' -I{} bash -c 'build "$@"' _ {}
fail=0
for b in "${builds[@]}"; do
  IFS='|' read -r name defs mode <<<"$b"
  echo "== $name ($defs)"
  ASAN_OPTIONS=detect_leaks=0 "$work/$name" "$mode" || fail=1
done
[ $fail = 0 ] && echo "ALL PASS" || echo "SOME FAILED"
exit $fail
