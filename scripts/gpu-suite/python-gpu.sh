#!/usr/bin/env bash
# The PyTorch front on the GPU machine: installs the carried wheel into a temp dir (no registry
# needed), runs pytest (CUDA tests included), the demo (inference and training) and the binding
# overhead comparison against `ferrite bench` records of the same run. Writes into $OUT.
#   bash scripts/gpu-suite/python-gpu.sh WHEEL_DIR [BENCH_JSON,...]
set -uo pipefail
wheels=$1; bench=${2:-}
OUT=${OUT:-$PWD/python-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export FERRITE_CACHE_DIR=${FERRITE_CACHE_DIR:-/tmp/ferrite-cache}
site=$(mktemp -d)
python3 -m zipfile -e "$(ls "$wheels"/ferrite-*.whl | head -1)" "$site"
# The package's Python files from this tree over the wheel's (the native module is the wheel's):
# Python-only edits need no wheel rebuild. OVERLAY_PY=0 tests the wheel exactly as built.
if [ "${OVERLAY_PY:-1}" = 1 ]; then cp python/ferrite/*.py "$site/ferrite/"; fi
export PYTHONPATH=$site
status=0
python3 -c 'import sys, torch, ferrite; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else ""); print("ferrite", ferrite.__version__, "from", ferrite.__file__, "| cuda_status", ferrite.cuda_status())' 2>&1 | tee "$OUT/env.txt"
if [ "${SKIP_PYTEST:-0}" != 1 ]; then
  echo "== pytest (CUDA)"
  (cd python/tests && python3 -m pytest -q -p no:cacheprovider -rs ${PYTEST_ARGS:-} . ) > "$OUT/pytest-gpu.log" 2>&1 || status=1
  tail -n 15 "$OUT/pytest-gpu.log"
fi
if [ "${SKIP_DEMO:-0}" != 1 ]; then
  echo "== demo"
  python3 -m ferrite.demo --json "$OUT/demo-cuda.json" > "$OUT/demo-cuda.txt" 2>&1 || status=1
  cat "$OUT/demo-cuda.txt"
  python3 -m ferrite.demo --mode training --json "$OUT/demo-cuda-training.json" > "$OUT/demo-cuda-training.txt" 2>&1 || status=1
  cat "$OUT/demo-cuda-training.txt"
fi
if [ "${HOST_OVERHEAD:-0}" = 1 ]; then
  echo "== host time per call: dispatcher vs eager fast path"
  python3 scripts/host_overhead.py --device cuda --json "$OUT/host-overhead.json" 2>&1 | tee "$OUT/host-overhead.txt" || status=1
fi
if [ -n "$bench" ]; then
  echo "== binding overhead (python op vs the same kernel from ferrite bench)"
  python3 scripts/gpu-suite/binding_overhead.py "$bench" "$OUT/binding-overhead.json" 2>&1 | tee "$OUT/binding-overhead.txt" || status=1
fi
echo "python-gpu status: $status"
exit $status
