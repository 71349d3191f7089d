#!/usr/bin/env bash
# The decode family on the GPU machine, from the bundle (bundle.sh, with the wheel copied in), in
# one call: `check decode` (every CUDA variant, every mode: scheduled, uniform partitions,
# plan/run, stale plan), the scheduled kernels' quick check under compute-sanitizer memcheck, the
# GPU-only Rust tests of the family, the PyTorch plan/run tests, `bench decode` (equal and ragged
# batches, the scheduled kernels against their uniform partitions) and the serving-shaped bench
# against SDPA on a padded contiguous cache (serving_decode.py). With two GPUs it also runs the
# NCCL and data-parallel trainer tests. Writes into $OUT.
#   usage: OUT=results bash .gpu-bundle/decode.sh [quick]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/decode-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export FERRITE_CACHE_DIR=${FERRITE_CACHE_DIR:-/tmp/ferrite-cache}
export PYTHONUNBUFFERED=1
fe=$here/bin/ferrite
mode=${1:-full}
q=$([ "$mode" = quick ] && echo --quick)
site=$(mktemp -d)
python3 -m zipfile -e "$(ls "$here"/ferrite-*.whl | head -1)" "$site"
cp python/ferrite/*.py "$site/ferrite/" 2>/dev/null || true
export PYTHONPATH=$site
status=0
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,power.limit --format=csv | tee "$OUT/device.txt"
echo "== check decode"
"$fe" check decode --device cuda $q --json "$OUT/check-decode.json" > "$OUT/check-decode.txt" 2>&1 || status=1
tail -n 4 "$OUT/check-decode.txt"
echo "== Rust GPU tests (decode)"
"$here/tests/ferrite-ferrite" --include-ignored gpu_plan decode:: 2>&1 | tail -6 | tee "$OUT/gpu-tests-decode.txt"
grep -q "test result: ok" "$OUT/gpu-tests-decode.txt" || status=1
echo "== PyTorch: plan/run and paged decode"
(cd python/tests && python3 -m pytest -q -p no:cacheprovider -rs test_decode_plan.py test_attention.py -k "decode or plan") \
  > "$OUT/pytest-decode.log" 2>&1 || status=1
tail -n 3 "$OUT/pytest-decode.log"
echo "== bench decode"
"$fe" bench decode --device cuda $q --json "$OUT/bench-decode.json" > "$OUT/bench-decode.txt" 2>&1 || status=1
cat "$OUT/bench-decode.txt" | tail -n 40
echo "== serving-shaped bench (ragged batches; SDPA on a padded contiguous cache; copy rate)"
python3 "$here/serving_decode.py" "$OUT/serving-decode.json" $([ "$mode" = quick ] && echo --quick) \
  > "$OUT/serving-decode.txt" 2>&1 || status=1
cat "$OUT/serving-decode.txt" | tail -n 40
san=/usr/local/cuda/bin/compute-sanitizer
if [ -x "$san" ]; then
  echo "== memcheck: check decode --quick, scheduled kernels"
  timeout 200 "$san" --tool memcheck --print-limit 20 "$fe" check decode --device cuda --quick --dtype bf16 \
    --variant pipelined --variant pipelined_mma > "$OUT/memcheck-decode.txt" 2>&1 || status=1
  tail -n 4 "$OUT/memcheck-decode.txt"
fi
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  echo "== two GPUs: NCCL collectives and the data-parallel trainer tests"
  export LD_LIBRARY_PATH="/tmp/ferrite-nccl:$LD_LIBRARY_PATH"
  lib=$(python3 -c '
import glob, os, site
for d in site.getsitepackages():
    for f in sorted(glob.glob(os.path.join(d, "nvidia", "**", "libnccl.so*"), recursive=True)):
        print(f); raise SystemExit' 2>/dev/null)
  mkdir -p /tmp/ferrite-nccl && [ -n "$lib" ] && ln -sf "$lib" /tmp/ferrite-nccl/libnccl.so
  "$here/tests/ferrite-ferrite" --include-ignored gpu_nccl gpu_data_parallel gpu_batches_match 2>&1 | tail -8 | tee "$OUT/gpu-tests-dist.txt"
  grep -q "test result: ok" "$OUT/gpu-tests-dist.txt" || status=1
fi
echo "decode suite status: $status"
exit $status
