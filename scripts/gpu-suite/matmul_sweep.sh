#!/usr/bin/env bash
# matmul at every shape (issue 25) on the GPU machine, in one call: `check` of the rungs the
# default path takes (wgmma with re-pitched rows among them), `threshold` (wgmma + re-pitch
# against mma_pipelined on small problems with unaligned rows: where the default switches,
# REPITCH_MIN_MACS), and `sweep` (the default against cuBLAS/cuBLASLt over M × (N, K), JSON, table
# and heat map). Results land in $OUT/matmul-sweep/.
#   bash .gpu-bundle/matmul_sweep.sh [check] [threshold] [sweep]      (all three by default)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
fe=$here/bin/ferrite
out=${OUT:-/tmp/out}/matmul-sweep
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv >"$out/device.txt"
parts=${*:-check threshold sweep}
for part in $parts; do
  case $part in
    check)
      timeout 240 "$fe" check matmul --device cuda --variant wgmma --variant mma_pipelined \
        --variant skinny >"$out/check-matmul.txt" 2>&1
      echo "check matmul: rc $?; $(tail -1 "$out/check-matmul.txt")"
      timeout 300 "$fe" check linear --device cuda --quick >"$out/check-linear.txt" 2>&1
      echo "check linear: rc $?; $(tail -1 "$out/check-linear.txt")"
      ;;
    threshold)
      for s in "127 255 33" "256 264 257" "512 520 511" "1024 1000 1001" "2048 2047 2049"; do
        set -- $s
        "$fe" bench matmul --device cuda --dtype bf16 --variant wgmma --variant mma_pipelined \
          --m "$1" --n "$2" --k "$3" --json "$out/threshold-$1x$2x$3.json"
      done >"$out/threshold.txt" 2>&1
      echo "threshold: rc $?"
      ;;
    sweep)
      timeout 540 "$fe" bench matmul --device cuda --sweep --json "$out/sweep.json" \
        --plot "$out/sweep.svg" >"$out/sweep.txt" 2>&1
      echo "sweep: rc $?"
      tail -4 "$out/sweep.txt"
      ;;
    *) echo "unknown part $part (check, threshold, sweep)" >&2; exit 2 ;;
  esac
done
