#!/usr/bin/env bash
# The PyTorch front in CI (CPU): a venv with maturin, torch==2.11.0 (the GPU machine's version)
# pytest, transformers (the Hugging Face parity tests) and hypothesis (the property test) from PyPI; the abi3 wheel built by `maturin build --release` into its own target
# dir; the wheel installed; pytest on python/tests. Exits non-zero on any failure, including
# pytest's exit code 5 (no tests collected / run).
#
#   scripts/python-ci.sh [extra pytest args]
#
# Environment: FERRITE_PY_VENV (default ~/.cache/ferrite-py-venv, reused between runs),
# FERRITE_PY_TARGET_DIR (default target/python), PYTHON (default python3).
# The wheel is left in $FERRITE_PY_TARGET_DIR/wheels (carry it to the GPU machine: see docs/python.md).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${FERRITE_PY_VENV:-$HOME/.cache/ferrite-py-venv}
target=${FERRITE_PY_TARGET_DIR:-$root/target/python}
py=${PYTHON:-python3}

echo "== python venv ($venv)"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
  "maturin>=1.9.4,<2" "torch==2.11.0" "pytest>=7" "transformers==5.24.0" "hypothesis==6.170.17"
"$venv/bin/python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'

echo "== maturin build --release (CARGO_TARGET_DIR=$target)"
rm -rf "$target/wheels"
# python/pyproject.toml: maturin config (manifest-path ../crates/ferrite-py/Cargo.toml, python-source .)
(cd python && CARGO_TARGET_DIR="$target" "$venv/bin/maturin" build --release \
  -o "$target/wheels" -i "$venv/bin/python")
wheel=$(ls "$target"/wheels/ferrite-*.whl)
echo "built $wheel ($(du -h "$wheel" | cut -f1))"

echo "== install the wheel"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel"
# Import from a neutral folder so the installed wheel (not python/ferrite) is what is tested.
(cd "$(mktemp -d)" && "$venv/bin/python" -c 'import ferrite; print("ferrite", ferrite.__version__, "from", ferrite.__file__)')

echo "== pytest python/tests"
set +e
(cd python/tests && "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs "$@" .)
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "python-ci: pytest collected or ran no tests (exit 5): failing" >&2
  exit 1
fi
if [ "$rc" -ne 0 ]; then
  echo "python-ci: pytest failed (exit $rc)" >&2
  exit "$rc"
fi
echo "python-ci: ok"
