#!/usr/bin/env bash
# On a machine with 2 GPUs, from the bundle: the expert-parallel MoE layer against the one-GPU
# layer (the 2-GPU test), then `ferrite bench moe --ep 2` (each shape's expert-parallel forward
# and forward + backward, the one-GPU layer on the same tokens, NCCL's all-to-all at the
# dispatch's size). Results under $OUT.
#   usage: OUT=results bash .gpu-bundle/moe_ep.sh [--quick]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-results}"
mkdir -p "$out"
source "$here/nccl-env.sh"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee "$out/gpu.txt"
nvidia-smi topo -m | tee "$out/topo.txt"
echo "== the expert-parallel layer on two GPUs against the one-GPU layer (and the NCCL collectives)"
"$here/tests/ferrite-ferrite" --include-ignored gpu_ranks_match gpu_nccl 2>&1 | tail -8 | tee "$out/gpu-tests.txt"
echo "== ferrite bench moe --ep 2"
"$here/bin/ferrite" bench moe --ep 2 "$@" --json "$out/moe-ep.json" 2>&1 | tee "$out/moe-ep.txt"
