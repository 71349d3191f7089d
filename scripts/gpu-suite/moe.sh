#!/usr/bin/env bash
# The moe family on the GPU machine, from the bundle (bundle.sh, with the wheel copied in):
#   bash .gpu-bundle/moe.sh check   correctness: `check moe` (every CUDA variant), the kernel
#                                   families it shares code with, the PyTorch tests, and `check moe`
#                                   once under compute-sanitizer memcheck
#   bash .gpu-bundle/moe.sh bench   speed: moe_peers.py (ferrite.moe against the PyTorch layers in
#                                   one process), then `ferrite bench moe`
# Writes into $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/moe-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export FERRITE_CACHE_DIR=${FERRITE_CACHE_DIR:-/tmp/ferrite-cache}
fe=$here/bin/ferrite
site=$(mktemp -d)
python3 -m zipfile -e "$(ls "$here"/ferrite-*.whl | head -1)" "$site"
cp python/ferrite/*.py "$site/ferrite/" 2>/dev/null || true
export PYTHONPATH=$site
status=0
case ${1:-check} in
  check)
    nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee "$OUT/device.txt"
    "$fe" check moe --device cuda --quick --json "$OUT/check-moe.json" > "$OUT/check-moe.txt" 2>&1 || status=1
    tail -n 4 "$OUT/check-moe.txt"
    for op in activation linear; do
      "$fe" check $op --device cuda --quick --dtype bf16 > "$OUT/check-$op.txt" 2>&1 || status=1
      tail -n 2 "$OUT/check-$op.txt"
    done
    (cd python/tests && python3 -m pytest -q -p no:cacheprovider -rs test_moe.py) > "$OUT/pytest-moe.log" 2>&1 || status=1
    tail -n 3 "$OUT/pytest-moe.log"
    san=/usr/local/cuda/bin/compute-sanitizer
    if [ -x "$san" ]; then
      timeout 240 "$san" --tool memcheck --print-limit 20 "$fe" check moe --device cuda --quick --dtype bf16 \
        > "$OUT/memcheck-moe.txt" 2>&1 || status=1
      tail -n 4 "$OUT/memcheck-moe.txt"
    fi
    ;;
  bench)
    python3 "$here/moe_peers.py" --out "$OUT/moe-peers.json" > "$OUT/moe-peers.txt" 2>&1 || status=1
    tail -n 30 "$OUT/moe-peers.txt"
    "$fe" bench moe --json "$OUT/bench-moe.json" > "$OUT/bench-moe.txt" 2>&1 || status=1
    grep -E "^moe " "$OUT/bench-moe.txt" | awk '{print $2, $5, $6, $7, $8, $9, $10, $11}' | head -40
    ;;
esac
echo "moe.sh status: $status"
exit $status
