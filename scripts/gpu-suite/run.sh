#!/usr/bin/env bash
# The GPU suite runner: on any CUDA machine, from the bundle made by bundle.sh, runs the GPU tests,
# `ferrite check all` and `ferrite bench all` (and PyTorch peers where torch is installed), and
# writes into $OUT: suite.log, check.txt, bench.txt, capi.log and results.tgz (check.json, bench.{json,svg},
# data-bench.json, torch_peers.json, attention_peers.json) — few files, as the device tool returns ≤ 8.
#   bash .gpu-bundle/run.sh [quick|full] [extra ferrite bench args...]
# FERRITE_SANITIZE=1 adds a compute-sanitizer memcheck pass; FERRITE_SKIP_DATA=1 and
# FERRITE_SKIP_PEERS=1 leave out the data bench and the PyTorch peers.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mode=${1:-full}; shift || true
OUT=${OUT:-$PWD/gpu-suite-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export FERRITE_CACHE_DIR=${FERRITE_CACHE_DIR:-/tmp/ferrite-cache}
quick=(); [ "$mode" = quick ] && quick=(--quick)
log="$OUT/suite.log"
status=0
step() { echo "== $*" | tee -a "$log"; }

step "machine"
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv; } 2>&1 | tee -a "$log"
"$here/bin/ferrite" info 2>&1 | tee -a "$log"

step "kernels (ptxas report)"
ptxas=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)
"$here/bin/ferrite" kernels --ptxas "$ptxas" --arch sm_90a 2>&1 | tee -a "$log" || status=1

step "tests"
# Tests that need two GPUs (named *on_two_gpus) are left out, and said to be, where fewer are visible.
two=(); if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then two=(--skip on_two_gpus); echo "skipped: the *on_two_gpus tests (fewer than 2 GPUs)" | tee -a "$log"; fi
for t in "$here"/tests/*; do
  echo "-- $(basename "$t")" | tee -a "$log"
  # header_is_current compares the C header with the source tree, which the bundle does not hold
  "$t" --test-threads=1 --skip header_is_current 2>&1 | tee -a "$log" | grep -E "^test result|FAILED|panicked" ; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # tests marked #[ignore = "needs a CUDA GPU"] (named gpu_*): skipped, not passed, elsewhere
  "$t" --ignored gpu_ "${two[@]}" --test-threads=1 2>&1 | tee -a "$log" | grep -E "^test result|FAILED|panicked" ; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

step "C API on device pointers (capi.sh)"
if [ -d "$here/capi" ]; then
  OUT="$OUT" bash "$here/capi/capi.sh" run > /dev/null 2>&1 || status=1
  tail -n 2 "$OUT/capi.log" | tee -a "$log"
fi

step "check all"
"$here/bin/ferrite" check all "${quick[@]}" --device cuda --json "$OUT/check.json" > "$OUT/check.txt" 2>&1 || status=1
tail -n 3 "$OUT/check.txt" | tee -a "$log"
grep FAIL "$OUT/check.txt" | head -20 | tee -a "$log"

if [ "${FERRITE_SANITIZE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  step "compute-sanitizer memcheck (check --quick)"
  compute-sanitizer --tool memcheck --error-exitcode 9 "$here/bin/ferrite" check all --quick --device cuda > /tmp/memcheck.txt 2>&1 || status=1
  grep -E "ERROR SUMMARY|Invalid|cases" /tmp/memcheck.txt | head -20 | tee -a "$log"
fi

step "bench all"
"$here/bin/ferrite" bench all "${quick[@]}" $([ "$mode" = quick ] || echo --full) --device cuda --json "$OUT/bench.json" --plot "$OUT/bench.svg" "$@" > "$OUT/bench.txt" 2>&1 || status=1
cat "$OUT/bench.txt"

if [ "${FERRITE_SKIP_DATA:-0}" != 1 ]; then
step "data: raw read ceiling, loader to host and GPU, simulated training loop"
data_dir=${FERRITE_DATA_DIR:-/tmp/ferrite-data}
"$here/bin/ferrite" data bench "$data_dir" --synthetic "$([ "$mode" = quick ] && echo 2 || echo 8)" --device cuda:0 --json "$OUT/data-bench.json" 2>&1 | tee -a "$log" || status=1
fi

if [ "$mode" = full ] && [ "${FERRITE_SKIP_PEERS:-0}" != 1 ] && python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  step "PyTorch peers (norm, softmax) vs ferrite's best, same machine, same run"
  python3 "$here/torch_peers.py" "$OUT/bench.json" "$OUT/torch_peers.json" 2>&1 | tee -a "$log" || status=1
  step "PyTorch SDPA peers (attention: cuDNN and flash backends; decode from a contiguous cache)"
  python3 "$here/attention_peers.py" "$OUT/bench.json" "$OUT/attention_peers.json" 2>&1 | tee -a "$log" || status=1
fi
(cd "$OUT" && tar czf results.tgz $(ls *.json *.svg 2>/dev/null) && rm -f *.json *.svg)
echo "suite status: $status" | tee -a "$log"
exit $status
