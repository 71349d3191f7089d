#!/usr/bin/env bash
# The PyTorch front on the GPU machine (Python 3.12, torch 2.11, no registry): unpack the wheels
# carried in a folder (the ferrite wheel built here by scripts/python-ci.sh, plus pytest and its
# dependencies, e.g. from `pip download --only-binary=:all: --python-version 3.12 -d .whl pytest`)
# into a scratch site dir, run pytest (the CUDA tests included) and the demo (inference and
# training), and leave the logs and JSON in $OUT.
#
#   scripts/python-gpu.sh [WHEEL_DIR (default .whl)]
set -uo pipefail
cd "$(dirname "$0")/.."
whl=${1:-.whl}
out=${OUT:-$PWD/target/python-gpu-out}
mkdir -p "$out"
site=$(mktemp -d)
# A wheel is a zip laid out as site-packages: unpacking needs no pip and no network.
for w in "$whl"/*.whl; do python3 -m zipfile -e "$w" "$site" || exit 1; done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'PY' | tee "$out/env.txt"
import sys, torch, ferrite
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
print("ferrite", ferrite.__version__, "from", ferrite.__file__, "| cuda_status", ferrite.cuda_status())
PY
rc=0
(cd python/tests && python3 -m pytest -q -p no:cacheprovider -rs .) 2>&1 | tee "$out/pytest-gpu.log"
prc=${PIPESTATUS[0]}
[ "$prc" -eq 5 ] && { echo "pytest ran no tests" >&2; prc=1; }
[ "$prc" -ne 0 ] && rc=$prc
python3 -m ferrite.demo --json "$out/ferrite-demo-cuda.json" 2>&1 | tee "$out/demo-cuda.txt"
[ "${PIPESTATUS[0]}" -ne 0 ] && rc=1
python3 -m ferrite.demo --mode training --json "$out/ferrite-demo-cuda-training.json" 2>&1 | tee "$out/demo-cuda-training.txt"
[ "${PIPESTATUS[0]}" -ne 0 ] && rc=1
echo "python-gpu: exit $rc (results in $out)"
exit $rc
