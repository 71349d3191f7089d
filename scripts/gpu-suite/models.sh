#!/usr/bin/env bash
# Whole models and the PyTorch front's glue-free ops on the GPU machine, from the bundle
# (bundle.sh) plus the wheel and the pinned transformers wheels (python -m pip download
# transformers==5.24.0 --only-binary :all: --python-version 3.12 into .gpu-bundle/pyw):
#   bash .gpu-bundle/models.sh ops          rotary/cross-entropy checks, bench rotary, pytest
#   bash .gpu-bundle/models.sh MODEL MODES [VARIANTS]
#                                           python -m ferrite.bench_model (e.g. gpt2-124m train,prefill,decode)
# Writes into $OUT: models-<model>.json/.txt, or ops.txt and bench-rotary.json.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/models-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export FERRITE_CACHE_DIR=${FERRITE_CACHE_DIR:-/tmp/ferrite-cache}
site=$(mktemp -d)
python3 -m zipfile -e "$here"/ferrite-*.whl "$site"
cp "$here"/../python/ferrite/*.py "$site/ferrite/"
if [ -d "$here/pyw" ]; then
  python3 -m pip install -q --no-index --no-deps --target "$site" "$here"/pyw/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=$site
status=0
if [ "${1:-ops}" = ops ]; then
  {
    nvidia-smi --query-gpu=name,driver_version --format=csv
    "$here/bin/ferrite" check rotary --device cuda || status=1
    "$here/bin/ferrite" check cross_entropy --quick --device cuda || status=1
    "$here/tests/ferrite-ferrite" scale_grad --include-ignored || status=1
    "$here/bin/ferrite" bench rotary --device cuda --json "$OUT/bench-rotary.json" || status=1
    (cd "$here/../python/tests" && python3 -m pytest -q -p no:cacheprovider -rs test_rotary_packed.py test_hf.py test_fused_ops.py) || status=1
  } > "$OUT/ops.txt" 2>&1
else
  tag=$(echo "$1-${2:-all}" | tr , _)
  python3 -m ferrite.bench_model --models "$1" --modes "${2:-train,prefill,decode}" \
    ${3:+--variants "$3"} --json "$OUT/models-$tag.json" > "$OUT/models-$tag.txt" 2>&1 || status=1
fi
tail -40 "$OUT"/*.txt
exit $status
