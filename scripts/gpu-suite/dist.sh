#!/usr/bin/env bash
# On a machine with 2 GPUs, from the bundle (scripts/gpu-suite/bundle.sh, with the Shakespeare
# shards in .gpu-bundle/data and, for the PyTorch test, the wheel): the NCCL and 2-GPU trainer
# tests, `ferrite train` on one GPU and data-parallel on two (--nproc 2: the all-reduce overlapped
# with the backward, then after it with --no-overlap, then ZeRO-1 with --zero), torch.compile on
# one GPU, DDP + torch.compile and FSDP2 + torch.compile on two (DIST_FSDP=0 leaves FSDP2 out), NCCL's own bandwidth through torch.distributed, ferrite's
# modules under DDP/FSDP2 over NCCL (python/tests/test_distributed.py), all in one call. Results
# under $OUT.
#   usage: OUT=results bash .gpu-bundle/dist.sh [MODEL] [B] [T] [STEPS]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-results}"
mkdir -p "$out"
model="${1:-gpt2-124m}"; b="${2:-16}"; t="${3:-1024}"; steps="${4:-30}"
data="$here/data/shakespeare"
export PYTHONUNBUFFERED=1
source "$here/nccl-env.sh"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee "$out/gpu.txt"
nvidia-smi topo -m | tee "$out/topo.txt"
echo "== NCCL collectives and the 2-GPU trainer test (two ranks, one per GPU)"
"$here/tests/ferrite-ferrite" --include-ignored gpu_nccl gpu_data_parallel 2>&1 | tail -8 | tee "$out/gpu-tests.txt"
common=(train --data "$data" --model "$model" -b "$b" -t "$t" --steps "$steps" --print-every 10)
echo "== ferrite train, 1 GPU"
"$here/bin/ferrite" "${common[@]}" --json "$out/ferrite-1gpu.json" 2>&1 | tee "$out/ferrite-1gpu.txt"
echo "== ferrite train --nproc 2"
"$here/bin/ferrite" "${common[@]}" --nproc 2 --profile-step 10 --json "$out/ferrite-2gpu.json" 2>&1 | tee "$out/ferrite-2gpu.txt"
echo "== ferrite train --nproc 2 --no-overlap"
"$here/bin/ferrite" "${common[@]}" --nproc 2 --no-overlap --profile-step 10 --json "$out/ferrite-2gpu-no-overlap.json" 2>&1 | tee "$out/ferrite-2gpu-no-overlap.txt"
echo "== ferrite train --nproc 2 --zero"
"$here/bin/ferrite" "${common[@]}" --nproc 2 --zero --profile-step 10 --json "$out/ferrite-2gpu-zero.json" 2>&1 | tee "$out/ferrite-2gpu-zero.txt"
echo "== torch.compile, 1 GPU"
python3 "$here/train_peers.py" "$data" --model "$model" -b "$b" -t "$t" --steps "$steps" --mode compile \
  --json "$out/torch-compile-1gpu.json" 2>&1 | grep -v Warning | tail -2
echo "== torch DDP + torch.compile, 2 GPUs"
torchrun --standalone --nproc_per_node 2 "$here/train_peers.py" "$data" --model "$model" -b "$b" -t "$t" \
  --steps "$steps" --mode compile --json "$out/torch-ddp-compile-2gpu.json" 2>&1 | grep -v Warning | tail -2
if [ "${DIST_FSDP:-1}" = 1 ]; then
  echo "== torch FSDP2 (fully_shard per block) + torch.compile, 2 GPUs"
  torchrun --standalone --nproc_per_node 2 "$here/train_peers.py" "$data" --model "$model" -b "$b" -t "$t" \
    --steps "$steps" --mode compile --fsdp --json "$out/torch-fsdp2-compile-2gpu.json" 2>&1 | grep -v Warning | tail -2
fi
echo "== NCCL through torch.distributed"
torchrun --standalone --nproc_per_node 2 "$here/nccl_bw.py" --json "$out/nccl-bw.json" 2>&1 | grep -v Warning | tail -12
if ls "$here"/ferrite-*.whl >/dev/null 2>&1 && [ -f "$here/test_distributed.py" ]; then
  echo "== ferrite's modules under DDP / FSDP2 over NCCL (pytest)"
  site=$(mktemp -d); python3 -m zipfile -e "$here"/ferrite-*.whl "$site"
  (cd "$here" && PYTHONPATH="$site" timeout 300 python3 -m pytest -q -p no:cacheprovider test_distributed.py 2>&1 | tail -6) | tee "$out/pytest-distributed.txt"
fi
python3 "$here/dist_table.py" "$out" | tee "$out/table.txt"
