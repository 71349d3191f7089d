#!/usr/bin/env bash
# On the GPU machine, from the bundle (scripts/gpu-suite/bundle.sh, with token shards copied to
# .gpu-bundle/data): the trainer's GPU test, then `ferrite train` against PyTorch eager and
# torch.compile on the same shards and model, in one call. Results under $OUT.
#   usage: OUT=results bash .gpu-bundle/train.sh [MODEL] [B] [T] [STEPS]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-results}"
mkdir -p "$out"
model="${1:-gpt2-124m}"; b="${2:-16}"; t="${3:-1024}"; steps="${4:-40}"
data="$here/data/shakespeare"
val="$data/shard_000011.ftok"    # held-out rows for both sides' validation loss
batches="${TMPDIR:-/tmp}/ferrite-batches.i32"   # ferrite's batches, replayed by the PyTorch runs
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee "$out/gpu.txt"
echo "== trainer GPU test (bf16 GPU against f32 CPU)"
two=(); if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then two=(--skip on_two_gpus); echo "skipped: gpu_data_parallel_on_two_gpus (fewer than 2 GPUs)"; fi
"$here/tests/ferrite-ferrite" --include-ignored train:: "${two[@]}" 2>&1 | tail -12 | tee "$out/train-tests.txt"
# SAME_INIT=1 (GPT-2): every run starts from PyTorch's seeded initial weights (saved in Hugging
# Face layout, loaded by `ferrite train --init-hf`), so the loss curves differ only by the training.
init=()
if [ "${SAME_INIT:-0}" = 1 ]; then
  python3 "$here/train_peers.py" "$data" --model "$model" --save-init "${TMPDIR:-/tmp}/ferrite-init.safetensors" 2>&1 | grep -v Warning | tail -2
  init=(--init-hf "${TMPDIR:-/tmp}/ferrite-init.safetensors")
fi
echo "== ferrite train $model B $b T $t"
"$here/bin/ferrite" train --data "$data" --model "$model" -b "$b" -t "$t" --steps "$steps" "${init[@]}" \
  --val-data "$val" --val-every "$steps" --val-batches 6 --dump-batches "$batches" \
  --json "$out/ferrite.json" --svg "$out/loss.svg" --print-every 5 --profile-step 10 2>&1 | tee "$out/ferrite.txt"
for run in "eager fp32 torch_eager" "compile fp32 torch_compile" "compile bf16 torch_compile_bf16"; do
  set -- $run
  echo "== torch $1, $2 weights"
  python3 "$here/train_peers.py" "$data" --model "$model" -b "$b" -t "$t" --steps "$steps" --mode "$1" \
    --params "$2" --batches "$batches" --val "$val" --val-batches 6 --json "$out/$3.json" 2>&1 | grep -v Warning | tail -3
done
python3 "$here/train_table.py" "$out" | tee "$out/table.txt"
