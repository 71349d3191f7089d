#!/usr/bin/env bash
# ferrite's C API on a GPU: crates/ferrite-capi/examples/c/test_capi.c built with
# -DFERRITE_TEST_CUDA (device memory from cudaMalloc, work on a cudaStream_t of its own: matmul
# f32/bf16, attention f32/bf16, RMSNorm and LayerNorm f32/bf16 against naive C references, and bad
# input: host pointers and undersized allocations on the CUDA path, device indices past the
# last), linked against libferrite_capi.so and the CUDA runtime, and run; then the same program on
# host memory (the CPU path, as `cargo test` runs it in CI).
#
#   bash scripts/gpu-suite/capi.sh bundle   here: release libferrite_capi.so, ferrite.h, the C source
#                                           and this script into .gpu-bundle-capi/ (git-ignored)
#   bash .gpu-bundle-capi/capi.sh [run]     on the GPU machine (no Rust needed): build with cc (or
#                                           nvcc) against $CUDA_HOME (/usr/local/cuda), run both
#                                           builds; the log goes to $OUT/capi.log
# `capi.sh run` also works from a source tree after `cargo build --release -p ferrite-capi`
# (FERRITE_CAPI_LIB=DIR names another folder holding libferrite_capi.so). Exit status 0 when both
# programs pass.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)

case ${1:-run} in
  bundle)
    set -e
    root=$(cd "$here/../.." && pwd)
    cd "$root"
    cargo build --release -p ferrite-capi
    out=.gpu-bundle-capi
    rm -rf "$out"
    mkdir -p "$out/lib" "$out/include"
    cp "${CARGO_TARGET_DIR:-target}/release/libferrite_capi.so" "$out/lib/"
    strip "$out/lib/libferrite_capi.so" 2>/dev/null || true
    cp crates/ferrite-capi/include/ferrite.h "$out/include/"
    cp crates/ferrite-capi/examples/c/test_capi.c scripts/gpu-suite/capi.sh "$out/"
    echo "bundle: $out ($(du -sm "$out" | cut -f1) MiB): $(cd "$out" && find . -type f | sort | tr '\n' ' ')"
    exit 0
    ;;
  run) ;;
  *)
    echo "usage: capi.sh [bundle|run]" >&2
    exit 2
    ;;
esac

# Where the pieces are: beside this script (a bundle), or in the source tree it belongs to.
if [ -f "$here/test_capi.c" ]; then
  src=$here/test_capi.c
  inc=$here/include
  lib=${FERRITE_CAPI_LIB:-$here/lib}
else
  root=$(cd "$here/../.." && pwd)
  src=$root/crates/ferrite-capi/examples/c/test_capi.c
  inc=$root/crates/ferrite-capi/include
  lib=${FERRITE_CAPI_LIB:-$root/target/release}
fi
cuda=${CUDA_HOME:-/usr/local/cuda}
OUT=${OUT:-$PWD/capi-out}
mkdir -p "$OUT"
log=$OUT/capi.log
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export FERRITE_CACHE_DIR=${FERRITE_CACHE_DIR:-/tmp/ferrite-cache}
# The library loads the driver, NVRTC and cuBLAS itself (dlopen); the runtime comes from -lcudart.
export LD_LIBRARY_PATH=$lib:$cuda/lib64:$cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}

for f in "$src" "$inc/ferrite.h" "$lib/libferrite_capi.so"; do
  [ -e "$f" ] || { echo "capi.sh: $f not found (bundle first, or build the library)" | tee -a "$log" >&2; exit 1; }
done
[ -d "$cuda/include" ] || { echo "capi.sh: no CUDA toolkit headers at $cuda/include (set CUDA_HOME)" | tee -a "$log" >&2; exit 1; }

{ echo "== machine"; date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 || true; } | tee -a "$log"

cuda_libdir=$cuda/lib64
[ -d "$cuda_libdir" ] || cuda_libdir=$cuda/targets/x86_64-linux/lib
common=(-I"$inc" "$src" -L"$lib" -lferrite_capi -Wl,-rpath,"$lib" -lm)
status=0
# Runs a command with its output in the log; its own exit status.
logged() { echo "\$ $*" >> "$log"; "$@" 2>&1 | tee -a "$log"; return "${PIPESTATUS[0]}"; }

echo "== CUDA path (device pointers, a stream): build and run" | tee -a "$log"
if command -v cc >/dev/null; then
  build=(cc -std=c11 -O1 -Wall -Wextra -DFERRITE_TEST_CUDA -I"$cuda/include" "${common[@]}"
         -L"$cuda_libdir" -lcudart -Wl,-rpath,"$cuda_libdir" -o "$work/test_capi_cuda")
else
  # nvcc hands a C file to the host compiler as C; -Xlinker passes the rpath through.
  build=("$cuda/bin/nvcc" -x c -DFERRITE_TEST_CUDA -I"$inc" "$src" -L"$lib" -lferrite_capi
         -Xlinker -rpath -Xlinker "$lib" -lcudart -lm -o "$work/test_capi_cuda")
fi
if logged "${build[@]}"; then
  logged "$work/test_capi_cuda" || { status=1; echo "FAIL: CUDA path" | tee -a "$log"; }
else
  status=1; echo "FAIL: the CUDA build did not compile" | tee -a "$log"
fi

if command -v cc >/dev/null; then
  echo "== CPU path (host pointers): build and run" | tee -a "$log"
  if logged cc -std=c11 -O1 -Wall -Wextra "${common[@]}" -o "$work/test_capi_cpu"; then
    logged "$work/test_capi_cpu" || { status=1; echo "FAIL: CPU path" | tee -a "$log"; }
  else
    status=1; echo "FAIL: the CPU build did not compile" | tee -a "$log"
  fi
fi

if [ $status -eq 0 ]; then echo "capi: all passed" | tee -a "$log"; else echo "capi: FAILED (see $log)" | tee -a "$log"; fi
exit $status
