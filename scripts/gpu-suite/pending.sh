#!/usr/bin/env bash
# Everything written in the session without a GPU (2026-11-23, see core::variant::PENDING_GPU_RUN
# and the "not yet run" notes in docs/), checked and timed in one device call (~9 min), results
# packed into $OUT/pending.tgz by steps.sh. Carry the bundle made by:
#   cargo build --release -p ferrite-cli && mkdir -p .gpu-bundle-py/bin && cp target/release/ferrite .gpu-bundle-py/bin/ \
#     && strip .gpu-bundle-py/bin/ferrite && cp -r target/python/wheels .gpu-bundle-py/   (wheel: scripts/python-ci.sh)
# then on the GPU machine:   bash scripts/gpu-suite/pending.sh .gpu-bundle-py
# Promote a rung (remove it from PENDING_GPU_RUN) only once its check passes and its bench wins.
set -uo pipefail
# The step limits add up past one device call (600 s), so it runs in two parts: `a` (checks and
# GEMM benches) and `b` (row benches, data, python); no part argument runs both.
bundle=${1:-.gpu-bundle-py}
part=${2:-ab}   # c: see below
here=$(cd "$(dirname "$0")" && pwd)
status=0
[[ $part == *a* ]] && { bash "$here/steps.sh" pending-a "$bundle" \
  'check-linear|120|ferrite check linear --device cuda --json $D/check-linear.json' \
  'check-matmul-f32|60|ferrite check matmul --device cuda --dtype f32 --variant wgmma --variant mma_pipelined --variant cublas --variant cublaslt' \
  'check-rows|120|for f in activation norm cross_entropy; do ferrite check $f --device cuda || exit 1; done' \
  'bench-linear|100|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  'bench-matmul-tf32|60|ferrite bench matmul --device cuda --dtype f32 --variant wgmma --variant mma_pipelined --size 4096 --json $D/bench-matmul-tf32.json' \
  || status=1; }
[[ $part == *b* ]] && { bash "$here/steps.sh" pending-b "$bundle" \
  'bench-rows|120|ferrite bench activation --device cuda --dtype bf16 --json $D/activation.json && ferrite bench norm --device cuda --dtype bf16 --json $D/norm.json && ferrite bench cross_entropy --device cuda --dtype bf16 --json $D/cross_entropy.json' \
  'data|120|ferrite data bench /tmp/fd --synthetic 4 --device cuda:0 --request-kib 4096 --queue-depth 128 --sweep-repeats 1 --rounds 1 --json $D/data-bench.json' \
  "python|150|OUT=\$D/python SKIP_DEMO=1 HOST_OVERHEAD=1 bash $here/python-gpu.sh $bundle/wheels" \
  || status=1; }
# `c`: the re-run after the first run (2026-11-23): kernels compiled up front on all cores (the
# first run's check-linear and pytest spent their time limits in one-at-a-time NVRTC compiles),
# the norm fix (16-bit rows of 4096: 48 KiB ring + static smem needed the opt-in), the rest.
[[ $part == *c* ]] && { bash "$here/steps.sh" pending-c "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a > $D/kernels-table.txt' \
  'check-rows|120|for f in norm cross_entropy; do ferrite check $f --device cuda || exit 1; done' \
  'check-linear|200|ferrite check linear --device cuda --json $D/check-linear.json' \
  'bench-rows|90|ferrite bench norm --device cuda --dtype bf16 --json $D/norm.json && ferrite bench cross_entropy --device cuda --dtype bf16 --json $D/cross_entropy.json' \
  "python|200|OUT=\$D/python SKIP_DEMO=1 HOST_OVERHEAD=1 PYTEST_ARGS='-v --tb=short' bash $here/python-gpu.sh $bundle/wheels" \
  || status=1; }
exit $status
