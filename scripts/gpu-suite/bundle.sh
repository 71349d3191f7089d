#!/usr/bin/env bash
# Builds the release CLI and the test binaries here and bundles them, with the runner, into
# .gpu-bundle/ (git-ignored, ≤ 64 MiB) for a CUDA machine that has no Rust toolchain.
#   bash scripts/gpu-suite/bundle.sh     then, on the GPU machine:   bash .gpu-bundle/run.sh [quick|full]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.gpu-bundle
rm -rf "$out"
mkdir -p "$out/bin" "$out/tests"
cargo build --release -p ferrite-cli
cp target/release/ferrite "$out/bin/"
# Test executables (release profile so the f64 references are quick), located from cargo's JSON.
cargo test --release --workspace --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        # package-target: the library tests and the CLI binary tests share the name ferrite.
        pkg = m["package_id"].split("#")[0].rstrip("/").split("/")[-1].split("@")[0]
        print(pkg + "-" + m["target"]["name"] + "\t" + m["executable"])
' | while IFS=$'\t' read -r name exe; do cp "$exe" "$out/tests/$name"; done
rm -f "$out"/tests/*-cli  # drives the CLI by its build path; covered by CI
rm -f "$out"/tests/ferrite-capi-c_test  # builds from the source tree; capi.sh runs the C test here
cp scripts/gpu-suite/run.sh scripts/gpu-suite/train.sh scripts/gpu-suite/train_peers.py scripts/gpu-suite/train_table.py scripts/gpu-suite/torch_peers.py scripts/gpu-suite/attention_peers.py scripts/gpu-suite/bench-families.sh scripts/gpu-suite/moe_peers.py scripts/gpu-suite/moe.sh scripts/gpu-suite/moe_profile.py scripts/gpu-suite/decode_linear.py scripts/gpu-suite/models.sh scripts/gpu-suite/models_profile.py scripts/gpu-suite/pad_check.py scripts/gpu-suite/dist.sh scripts/gpu-suite/nccl-env.sh scripts/gpu-suite/moe_ep.sh scripts/gpu-suite/dist_table.py scripts/gpu-suite/nccl_bw.py scripts/gpu-suite/sanitize.sh scripts/gpu-suite/decode.sh scripts/gpu-suite/serving_decode.py scripts/gpu-suite/matmul_sweep.sh "$out/"
# The C API: its library, header, C test program and runner (capi.sh run, called by run.sh).
cargo build --release -p ferrite-capi
mkdir -p "$out/capi/lib" "$out/capi/include"
cp target/release/libferrite_capi.so "$out/capi/lib/"
cp crates/ferrite-capi/include/ferrite.h "$out/capi/include/"
cp crates/ferrite-capi/examples/c/test_capi.c scripts/gpu-suite/capi.sh "$out/capi/"
# Token shards for the trainer runs, when packed here (scripts/fetch-shakespeare.sh).
if [ -d target/data/shakespeare ]; then mkdir -p "$out/data" && cp -r target/data/shakespeare "$out/data/"; fi
strip "$out"/bin/* "$out"/tests/* "$out"/capi/lib/* 2>/dev/null || true
size=$(du -sm "$out" | cut -f1)
echo "bundle: $out (${size} MiB): $(ls "$out/bin" "$out/tests" | tr '\n' ' ')"
[ "$size" -le 64 ] || { echo "bundle exceeds 64 MiB" >&2; exit 1; }
