#!/usr/bin/env bash
# What still waits for the GPU (see core::variant::PENDING_GPU_RUN and the "not yet measured"
# notes in docs/), checked and timed in device calls of < 600 s each. Carry the bundle made by:
#   cargo build --release -p ferrite-cli && mkdir -p .gpu-bundle-py/bin && cp target/release/ferrite .gpu-bundle-py/bin/ \
#     && strip .gpu-bundle-py/bin/ferrite && cp -r target/python/wheels .gpu-bundle-py/   (wheel: scripts/python-ci.sh)
# then on the GPU machine:   bash scripts/gpu-suite/pending.sh .gpu-bundle-py PART
# Every part first compiles all sm_90a modules on all cores (`ferrite kernels`, ~60 s on the
# H100 machine, cubins included): run one at a time, NVRTC and the driver's JIT took a check's
# whole time limit in the 2026-11-23 run. Results are packed into $OUT/pending-PART.tgz.
# Promote a rung (remove it from PENDING_GPU_RUN) only once its check passes and its bench wins.
#
# History: parts a–c of 2026-11-23 (bench/results/2026-11-23-h100-pending) measured and promoted
# tf32 `wgmma`, cross_entropy `resident`, the activation and norm-backward reworks, the GPU-consumer
# data loop and pytest on CUDA.
set -uo pipefail
bundle=${1:-.gpu-bundle-py}
part=${2:-d}
here=$(cd "$(dirname "$0")" && pwd)
warm='warm|150|ferrite kernels --arch sm_90a > $D/kernels-table.txt'
status=0
# d: the linear pair rungs' check (pace printed per record: a slow case or a hang?), the wgmma
# tuner (every configuration checked, then the tuned pick benched at the issue's shapes); if both
# pass, set matmul::cuda::WG_TUNE_BY_DEFAULT = true.
[[ $part == *d* ]] && { bash "$here/steps.sh" pending-d "$bundle" "$warm" \
  'check-pairs|150|ferrite check linear --device cuda --variant persistent_pairs --variant fused_pairs --trace --json $D/check-pairs.json' \
  'check-matmul|120|ferrite check matmul --device cuda --variant wgmma --json $D/check-matmul.json' \
  'bench-matmul|150|for s in 4096 8192; do ferrite bench matmul --device cuda --dtype bf16 --dtype f16 --variant wgmma --size $s --json $D/bench-matmul-$s.json || exit 1; done' \
  'bench-llm|100|for nk in "4096 4096" "14336 4096" "4096 14336"; do set -- $nk; ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n $1 --k $2 --json $D/bench-llm-$1-$2.json || exit 1; done' \
  || status=1; }
# e: linear (the pair rungs' promotion decides the default) and the PyTorch binding overhead:
# every op of binding_overhead.py benched from Rust in the same run, and each op also timed
# against the same kernel through ferrite._native, interleaved in one process (op/native).
[[ $part == *e* ]] && { bash "$here/steps.sh" pending-e "$bundle" "$warm" \
  'bench-linear|120|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  'bench-for-python|200|ferrite bench norm --device cuda --dtype bf16 --json $D/b-norm.json && ferrite bench softmax --device cuda --dtype bf16 --json $D/b-softmax.json && ferrite bench cross_entropy --device cuda --dtype bf16 --json $D/b-ce.json && ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --size 4096 --json $D/b-matmul.json && ferrite bench attention --device cuda --dtype bf16 --variant hopper --json $D/b-attention.json' \
  "python|200|OUT=\$D/python SKIP_PYTEST=1 SKIP_DEMO=1 HOST_OVERHEAD=1 bash $here/python-gpu.sh $bundle/wheels \$D/b-norm.json,\$D/b-softmax.json,\$D/b-ce.json,\$D/b-matmul.json,\$D/b-attention.json" \
  || status=1; }
# f: session 6's kernels — matmul `warptile` rewritten (cp.async ring, 2 blocks/SM), cross_entropy
# `cluster` (a row over a 2/4/8-block cluster, DSMEM), norm backward re-reading its stage — checked
# then benched against their predecessors, plus the linear pair rungs' check (k ≤ 1 shapes now
# run the warmed layout). Promote each that passes (core::variant::PENDING_GPU_RUN).
[[ $part == *f* ]] && { bash "$here/steps.sh" pending-f "$bundle" "$warm" \
  'check-pairs|120|ferrite check linear --device cuda --variant persistent_pairs --variant fused_pairs --json $D/check-pairs.json' \
  'check-new|120|ferrite check matmul --device cuda --dtype f32 --variant warptile --variant vectorized --json $D/check-matmul.json; a=$?; ferrite check cross_entropy --device cuda --variant cluster --variant resident --json $D/check-ce.json; b=$?; ferrite check norm --device cuda --json $D/check-norm.json; c=$?; exit $((a|b|c))' \
  'bench-new|150|ferrite bench matmul --device cuda --dtype f32 --variant warptile --variant vectorized --size 4096 --json $D/bench-matmul-f32.json; ferrite bench cross_entropy --device cuda --dtype bf16 --json $D/bench-ce.json; ferrite bench norm --device cuda --dtype bf16 --json $D/bench-norm.json' \
  || status=1; }
# g: f's follow-ups — warptile's branch-free copies for interior tiles, cross_entropy `cluster`
# launched one cluster per row (a persistent grid ran a second wave of clusters), the 8192³ f16
# and LLM-shape GEMMs again (at the targets' edge in d), then the linear rungs now promoted, and
# the PyTorch front: pytest on CUDA (its linear now takes the default selection) and the binding
# overhead against the Rust benches of this run.
[[ $part == *g* ]] && { bash "$here/steps.sh" pending-g "$bundle" "$warm" \
  'check-new|90|ferrite check matmul --device cuda --dtype f32 --variant warptile --json $D/check-matmul.json; a=$?; ferrite check cross_entropy --device cuda --variant cluster --json $D/check-ce.json; exit $((a|$?))' \
  'bench-new|120|ferrite bench matmul --device cuda --dtype f32 --variant warptile --variant vectorized --size 4096 --json $D/bench-matmul-f32.json; ferrite bench cross_entropy --device cuda --dtype bf16 --variant resident --variant cluster --json $D/bench-ce.json; ferrite bench matmul --device cuda --dtype f16 --variant wgmma --size 8192 --json $D/bench-matmul-f16-8192.json; ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n 14336 --k 4096 --json $D/bench-llm-14336-4096.json' \
  'bench-linear|60|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  'bench-for-python|150|ferrite bench norm --device cuda --dtype bf16 --json $D/b-norm.json && ferrite bench softmax --device cuda --dtype bf16 --json $D/b-softmax.json && ferrite bench cross_entropy --device cuda --dtype bf16 --variant resident --json $D/b-ce.json && ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --size 4096 --json $D/b-matmul.json && ferrite bench attention --device cuda --dtype bf16 --variant hopper --json $D/b-attention.json' \
  "python|240|OUT=\$D/python SKIP_DEMO=1 HOST_OVERHEAD=1 bash $here/python-gpu.sh $bundle/wheels \$D/b-norm.json,\$D/b-softmax.json,\$D/b-ce.json,\$D/b-matmul.json,\$D/b-attention.json" \
  || status=1; }
# h: the naive / PyTorch / torch.compile / ferrite demo again (inference and training), now that
# the PyTorch front's linear runs the fused-epilogue Hopper GEMM (`persistent_pairs`).
[[ $part == *h* ]] && { bash "$here/steps.sh" pending-h "$bundle" "$warm" \
  "demo|400|OUT=\$D/python SKIP_PYTEST=1 bash $here/python-gpu.sh $bundle/wheels" \
  || status=1; }
# i: Nsight Compute profiles (hardware counters, --clock-control none) of the kernels whose gaps
# the 2026-11-23 runs could not explain by timing alone: warptile vs vectorized (fp32 SIMT),
# ce_resident at V = 50257 (83% of copy), norm_bwd_vec LayerNorm (86%), and wgmma vs cuBLAS at
# 8192×14336×4096 (0.85×). One launch of each after the bench's warm-up; text reports.
source "$here/ncu-env.sh"
[[ $part == *[ijlo]* ]] && export PATH="$PATH:$cuda_tools_path"
[[ $part == *i* ]] && { bash "$here/steps.sh" pending-i "$bundle" "$warm" \
  "ncu-simt|120|for v in warptile vectorized; do ncu --clock-control none $ncu_sections -k regex:matmul_\$v --launch-skip 5 --launch-count 1 ferrite bench matmul --device cuda --dtype f32 --variant \$v --size 4096 > \$D/ncu-\$v.txt 2>&1 || exit 1; done" \
  "ncu-ce|90|ncu --clock-control none $ncu_sections -k regex:ce_resident --launch-skip 5 --launch-count 1 ferrite bench cross_entropy --device cuda --dtype bf16 --variant resident > \$D/ncu-ce-resident.txt 2>&1" \
  "ncu-norm|120|ferrite bench norm --device cuda --dtype bf16 --variant vectorized > \$D/tune-norm.txt 2>&1; ncu --clock-control none $ncu_sections -k regex:norm_bwd_vec --launch-skip 215 --launch-count 1 ferrite bench norm --device cuda --dtype bf16 --variant vectorized > \$D/ncu-norm-bwd.txt 2>&1" \
  "ncu-gemm|180|ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n 14336 --k 4096 > \$D/tune-gemm.txt 2>&1; for k in matmul_wgmma 'nvjet|xmma|gemm|cutlass|sm90'; do ncu --clock-control none $ncu_sections -k regex:\"\$k\" --launch-skip 5 --launch-count 1 ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n 14336 --k 4096 >> \$D/ncu-gemm.txt 2>&1 || exit 1; done" \
  || status=1; }
# j: what the profiles of i suggested — warptile rebuilt on cuBLAS's own SGEMM shape (its kernel
# in i: 256×128×8 tiles, 3-stage cp.async, 8 warps of 64×64, 254 registers, one block per SM,
# issue slots 87% busy) and the norm backward's grid capped at the blocks that fit an SM.
[[ $part == *j* ]] && { bash "$here/steps.sh" pending-j "$bundle" "$warm" \
  'check|90|ferrite check matmul --device cuda --dtype f32 --variant warptile --json $D/check-matmul.json; a=$?; ferrite check norm --device cuda --json $D/check-norm.json; exit $((a|$?))' \
  'bench|120|ferrite bench matmul --device cuda --dtype f32 --variant warptile --variant vectorized --size 4096 --json $D/bench-matmul-f32.json; ferrite bench matmul --device cuda --dtype f32 --variant warptile --size 8192 --json $D/bench-matmul-f32-8192.json; ferrite bench norm --device cuda --dtype bf16 --variant vectorized --json $D/bench-norm.json' \
  "ncu|60|ncu --clock-control none $ncu_sections -k regex:matmul_warptile --launch-skip 5 --launch-count 1 ferrite bench matmul --device cuda --dtype f32 --variant warptile --size 4096 > \$D/ncu-warptile.txt 2>&1" \
  || status=1; }
# k: warptile with its fragments double-buffered in registers (issue slots 63% in j) — measured
# 0.73× (j's 0.75×): ptxas already interleaves the loads; reverted, kept as the record of the try.
[[ $part == *k* ]] && { bash "$here/steps.sh" pending-k "$bundle" "$warm" \
  'check|60|ferrite check matmul --device cuda --dtype f32 --variant warptile --json $D/check-matmul.json' \
  'bench|60|ferrite bench matmul --device cuda --dtype f32 --variant warptile --variant vectorized --size 4096 --json $D/bench-matmul-f32.json' \
  || status=1; }
# l: stall reasons (PC sampling: SourceCounters, WarpStateStats) of the kernels still short of
# their targets, and cuBLAS's bf16 kernel under the same profile as ours (its SM clock and
# tensor-pipe share at 8192×14336×4096), for the next session's plan.
[[ $part == *l* ]] && { bash "$here/steps.sh" pending-l "$bundle" "$warm" \
  "stalls|200|ncu --clock-control none $stall_sections -k regex:matmul_warptile --launch-skip 3 --launch-count 1 ferrite bench matmul --device cuda --dtype f32 --variant warptile --size 4096 > \$D/ncu-warptile.txt 2>&1; ncu --clock-control none $stall_sections -k regex:ce_resident --launch-skip 5 --launch-count 1 ferrite bench cross_entropy --device cuda --dtype bf16 --variant resident > \$D/ncu-ce-resident.txt 2>&1; ferrite bench norm --device cuda --dtype bf16 --variant vectorized > \$D/tune-norm.txt 2>&1; ncu --clock-control none $stall_sections -k regex:norm_bwd_vec --launch-skip 215 --launch-count 1 ferrite bench norm --device cuda --dtype bf16 --variant vectorized > \$D/ncu-norm-bwd.txt 2>&1" \
  "cublas|120|ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n 14336 --k 4096 > \$D/tune-gemm.txt 2>&1; ncu --clock-control none $ncu_sections -k regex:'nvjet|sm90_xmma|cutlass' --launch-skip 5 --launch-count 1 ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n 14336 --k 4096 > \$D/ncu-cublas-bf16.txt 2>&1" \
  || status=1; }
# m: the wgmma attention backward (attn_hopper_bwd, FA3's layout of the work: 128 keys per block,
# 2 consumer warpgroups, dQ through one red.global per element and 128-key block) checked on
# every feature case (hopper's backward runs it wherever it applies), with the forwards of
# hopper and flash whose mask test moved out of the per-element loop; and cross_entropy's
# resident rung after its pass-2 change (one LDS.128 per kept vector, loop not unrolled).
[[ $part == *m* ]] && { bash "$here/steps.sh" pending-m "$bundle" \
  'warm|120|ferrite kernels --arch sm_90a --only attention > $D/kernels-attn.txt && ferrite kernels --arch sm_90a --only cross_entropy > $D/kernels-ce.txt' \
  'check-attn|300|ferrite check attention --device cuda --variant hopper --variant flash --json $D/check-attn.json' \
  'ce|120|ferrite check cross_entropy --device cuda --variant resident --json $D/check-ce.json && ferrite bench cross_entropy --device cuda --dtype bf16 --variant resident --variant cluster --json $D/bench-ce.json' \
  || status=1; }
# n: the attention bench (hopper and flash, forward and backward) with the SDPA peers of the
# same call (cuDNN and flash backends).
[[ $part == *n* ]] && { bash "$here/steps.sh" pending-n "$bundle" \
  'warm|100|ferrite kernels --arch sm_90a --only attention > $D/kernels-attn.txt' \
  "bench-attn|400|ferrite bench attention --device cuda --dtype bf16 --variant hopper --variant flash --json \$D/attention.json && python3 $here/attention_peers.py \$D/attention.json \$D/attention_peers.json" \
  || status=1; }
# o: compute-sanitizer on the new backward (quick attention check of `hopper`): memcheck for
# out-of-bounds and misaligned accesses, then synccheck (named barriers, mbarrier waits).
[[ $part == *o* ]] && { bash "$here/steps.sh" pending-o "$bundle" \
  'warm|100|ferrite kernels --arch sm_90a --only attention > $D/kernels-attn.txt' \
  'memcheck|240|compute-sanitizer --tool memcheck --error-exitcode 9 ferrite check attention --device cuda --variant hopper --quick' \
  'synccheck|200|compute-sanitizer --tool synccheck --error-exitcode 9 ferrite check attention --device cuda --variant hopper --quick' \
  || status=1; }
# The attention check (hopper and flash, every case) and the bench with the SDPA peers on every
# shape of the bench, as steps for steps.sh.
attn_steps=(
  'warm|100|ferrite kernels --arch sm_90a --only attention > $D/kernels-attn.txt'
  'check-attn|200|ferrite check attention --device cuda --variant hopper --variant flash --json $D/check-attn.json'
  "bench-attn|280|ferrite bench attention --device cuda --dtype bf16 --variant hopper --variant flash --json \$D/attention.json && python3 $here/attention_peers.py \$D/attention.json \$D/attention_peers.json --only attention && python3 $here/attention_table.py \$D/attention.json \$D/attention_peers.json > \$D/attention_table.md"
)
# p: the hopper kernels launched longest-first in L2-sized chunks of (batch, head) units under a
# mask (hopper.cu `schedule`), with the SDPA peers now run on every shape of the bench.
[[ $part == *p* ]] && { bash "$here/steps.sh" pending-p "$bundle" "${attn_steps[@]}" || status=1; }
# r: `flash` forward with lazy rescaling (O and l rescaled only when a row's max grows by > 2^8):
# the same steps as p (flash ≥ FA2 at long sequences is the target it is for).
[[ $part == *r* ]] && { bash "$here/steps.sh" pending-r "$bundle" "${attn_steps[@]}" || status=1; }
# t: the wgmma backward adding dQ with one 16-byte red.global per 4 columns (lanes trade halves)
# instead of an 8-byte one per column pair: the same steps as p. Measured 5-7 % slower than r
# (pending-t); reverted, kept as the record of the try.
[[ $part == *t* ]] && { bash "$here/steps.sh" pending-t "$bundle" "${attn_steps[@]}" || status=1; }
# q: the PyTorch front on CUDA now that its attention backward defaults to the wgmma kernel.
[[ $part == *q* ]] && { bash "$here/steps.sh" pending-q "$bundle" \
  'warm|100|ferrite kernels --arch sm_90a --only attention > $D/kernels-attn.txt' \
  "pytest|300|OUT=\$D/python SKIP_DEMO=1 bash $here/python-gpu.sh $bundle/wheels" \
  || status=1; }
# u: where warptile (0.75x cuBLAS fp32) and flash's forward at D128 (0.93x FA2 at S16384) wait,
# per SASS instruction (ncu-source.sh), and A/B runs of edited kernels from the bundle's kdir/
# through FERRITE_KERNEL_DIR (no rebuild): warptile with 16-deep k-slices (half the barriers),
# flash's forward as committed before P was packed at once (head), and with FA2's 64-key tile
# at D128 (bn64: 92 bytes of spills, to learn what the tile is worth before finding registers).
kd=$(cd "$bundle" && pwd)/kdir
[[ $part == *u* ]] && { bash "$here/steps.sh" pending-u "$bundle" \
  'warm|120|ferrite kernels --arch sm_90a --only matmul/warptile > $D/k1.txt; ferrite kernels --arch sm_90a --only attention/flash > $D/k2.txt; FERRITE_KERNEL_DIR='"$kd"'/wbk16 ferrite kernels --arch sm_90a --only matmul/warptile > $D/k3.txt' \
  "ncu-warptile|150|bash $here/ncu-source.sh \$D warptile matmul_warptile 3 -- ferrite bench matmul --device cuda --dtype f32 --variant warptile --size 4096" \
  "ncu-flash|150|bash $here/ncu-source.sh \$D flash-fwd flash_fwd 3 -- ferrite bench attention --device cuda --dtype bf16 --variant flash --size 16384" \
  'ab-matmul|150|for v in base wbk16; do FERRITE_KERNEL_DIR='"$kd"'/$v ferrite bench matmul --device cuda --dtype f32 --variant warptile --size 4096 --json $D/mm-$v.json; done; FERRITE_KERNEL_DIR='"$kd"'/wbk16 ferrite check matmul --device cuda --dtype f32 --variant warptile' \
  'ab-flash|240|ferrite check attention --device cuda --variant flash --quick; for v in base head bn64 base; do for s in 16384 4096; do FERRITE_KERNEL_DIR='"$kd"'/$v ferrite bench attention --device cuda --dtype bf16 --variant flash --size $s --json $D/fl-$v-$s.json; done; done' \
  || status=1; }
# v: u's follow-ups. warptile: 16-deep k-slices in a dynamic-shared ring, and the transposing
# copies remapped (a warp instruction = 4 lines × 8 k: 4 sectors, not 16); against u's wbk16
# (the same slices, old copies) in the same run. flash forward: ldmatrix from 32-bit shared
# addresses, the block's geometry in shared memory, the loop in 32 bits (229 registers at
# D128, was 253); against head (the committed kernel), and FA2's 64-key tile at D128 (bn64:
# bin-bn64 is a build whose host sizes the forward for 64-key tiles; 4 bytes of spills).
[[ $part == *v* ]] && { bash "$here/steps.sh" pending-v "$bundle" \
  'warm|120|ferrite kernels --arch sm_90a --only matmul/warptile > $D/k1.txt; ferrite kernels --arch sm_90a --only attention/flash > $D/k2.txt' \
  'check-matmul|100|ferrite check matmul --device cuda --dtype f32 --variant warptile --json $D/check-matmul.json' \
  'ab-matmul|150|for v in base wbk16; do FERRITE_KERNEL_DIR='"$kd"'/$v ferrite bench matmul --device cuda --dtype f32 --variant warptile --size 4096 --json $D/mm-$v.json; done; ferrite bench matmul --device cuda --dtype f32 --variant warptile --variant vectorized --size 8192 --json $D/mm-8192.json' \
  'check-flash|200|ferrite check attention --device cuda --variant flash --json $D/check-flash.json' \
  'ab-flash|250|ferrite bench attention --device cuda --dtype bf16 --variant flash --size 16384 --json $D/fl-base-16384.json; FERRITE_KERNEL_DIR='"$kd"'/head ferrite bench attention --device cuda --dtype bf16 --variant flash --size 16384 --json $D/fl-head-16384.json; FERRITE_KERNEL_DIR='"$kd"'/bn64 '"$bundle"'/bin-bn64/ferrite bench attention --device cuda --dtype bf16 --variant flash --size 16384 --json $D/fl-bn64-16384.json; ferrite bench attention --device cuda --dtype bf16 --variant flash --size 4096 --json $D/fl-base-4096.json' \
  || status=1; }
# w: flash's forward with 64-key tiles at every head dim (v's bn64, now without spills: the
# masked path rebuilds a lane's row position from threadIdx): the attention check and the bench
# with the SDPA peers, as p.
[[ $part == *w* ]] && { bash "$here/steps.sh" pending-w "$bundle" "${attn_steps[@]}" || status=1; }
# x: w's kernels under compute-sanitizer memcheck (quick flash check), the committed forward
# (kdir/head, 32-key tiles) against the new one in the same run, and the new forward's
# per-instruction profile.
[[ $part == *x* ]] && { bash "$here/steps.sh" pending-x "$bundle" \
  'warm|100|ferrite kernels --arch sm_90a --only attention/flash > $D/kernels-flash.txt' \
  'memcheck|200|compute-sanitizer --tool memcheck --error-exitcode 9 ferrite check attention --device cuda --variant flash --quick' \
  'ab-flash|150|for v in head base; do FERRITE_KERNEL_DIR='"$kd"'/$v ferrite bench attention --device cuda --dtype bf16 --variant flash --size 16384 --json $D/fl-$v-16384.json; done' \
  "ncu-flash|150|bash $here/ncu-source.sh \$D flash-fwd flash_fwd 3 -- ferrite bench attention --device cuda --dtype bf16 --variant flash --size 16384" \
  || status=1; }
# y: issue 3's targets in one run after warptile's rework: every matmul variant checked, the
# whole ladder at 4096³ (every dtype, with the chart), the fast rungs at 8192³, the LLM shapes.
[[ $part == *y* ]] && { bash "$here/steps.sh" pending-y "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only matmul > $D/kernels-matmul.txt' \
  'check-matmul|200|ferrite check matmul --device cuda --json $D/check-matmul.json' \
  'bench-4096|150|ferrite bench matmul --device cuda --size 4096 --json $D/bench-4096.json --plot $D/ladder-4096.svg' \
  'bench-8192|120|ferrite bench matmul --device cuda --size 8192 --variant wgmma --variant warptile --variant vectorized --json $D/bench-8192.json' \
  'bench-llm|100|for nk in "4096 4096" "14336 4096" "4096 14336"; do set -- $nk; ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n $1 --k $2 --json $D/bench-llm-$1-$2.json || exit 1; done' \
  || status=1; }
# z: the GEMMs of y that landed at the targets' edge (f16 4096³ 0.89, LLM 14336×4096 0.84) and
# their neighbours, the tune table cleared, twice each in separate processes (the first tunes,
# the second reads the remembered pick). Run with a tuner that timed its candidates in three
# interleaved rounds: the same picks as y, so that change was dropped. Found instead: in the
# process that tuned, wgmma ran ~10 % slower than in the next one (cuBLAS unchanged); see
# docs/matmul.md.
[[ $part == *z* ]] && { bash "$here/steps.sh" pending-z "$bundle" \
  'warm|150|rm -f ${FERRITE_CACHE_DIR:-/tmp/ferrite-cache}/tune.json; ferrite kernels --arch sm_90a --only matmul/wgmma > $D/kernels-matmul.txt' \
  'bench|300|for r in 1 2; do ferrite bench matmul --device cuda --dtype bf16 --dtype f16 --variant wgmma --size 4096 --json $D/b4096-$r.json; ferrite bench matmul --device cuda --dtype bf16 --dtype f16 --variant wgmma --size 8192 --json $D/b8192-$r.json; for nk in "4096 4096" "14336 4096" "4096 14336"; do set -- $nk; ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n $1 --k $2 --json $D/llm-$1-$2-$r.json; done; done; cat ${FERRITE_CACHE_DIR:-/tmp/ferrite-cache}/tune.json > $D/tune.json' \
  || status=1; }
# A: z again with the matmul bench timing every variant and both cuBLAS peers in alternating
# rounds (harness::bench::time_gpu_alternating, 3 rounds): the ratio no longer depends on which
# of the two ran first after the tuner or after an idle GPU. Twice in separate processes (the
# first tunes), then the fp32 and tf32 rows at 4096³.
[[ $part == *A* ]] && { bash "$here/steps.sh" pending-A "$bundle" \
  'warm|150|rm -f ${FERRITE_CACHE_DIR:-/tmp/ferrite-cache}/tune.json; ferrite kernels --arch sm_90a --only matmul > $D/kernels-matmul.txt' \
  'bench|400|for r in 1 2; do ferrite bench matmul --device cuda --dtype bf16 --dtype f16 --variant wgmma --size 4096 --json $D/b4096-$r.json; ferrite bench matmul --device cuda --dtype bf16 --dtype f16 --variant wgmma --size 8192 --json $D/b8192-$r.json; for nk in "4096 4096" "14336 4096" "4096 14336"; do set -- $nk; ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n $1 --k $2 --json $D/llm-$1-$2-$r.json; done; done; ferrite bench matmul --device cuda --dtype f32 --variant warptile --variant vectorized --variant wgmma --size 4096 --json $D/f32-4096.json' \
  || status=1; }
# B: the linear bench with its backward and the two cuBLAS GEMMs timed in alternating rounds
# (issue 4's "backward ≥ 0.9× the two cuBLAS GEMMs", 0.83-0.87 when timed one after the other).
[[ $part == *B* ]] && { bash "$here/steps.sh" pending-B "$bundle" \
  'bench-linear|400|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  || status=1; }
# C: wgmma's TMA-store epilogue (C staged per consumer warp in shared memory, written by TMA
# stores while the warp goes on to the next tile): check every wgmma configuration and the
# direct-store one, then each configuration with (cXgY) and without (cXgYd) the TMA store in
# the same alternating rounds as cuBLAS, and the tuner's pick.
[[ $part == *C* ]] && { bash "$here/steps.sh" pending-C "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only matmul/wgmma > $D/kernels-wgmma.txt' \
  'check-matmul|200|ferrite check matmul --device cuda --variant wgmma --json $D/check-wgmma.json && ferrite check linear --device cuda --quick --json $D/check-linear.json' \
  'ab-4096|200|ferrite bench matmul --device cuda --dtype bf16 --dtype f16 --variant wgmma --size 4096 --config c2g8 --config c2g8d --config c2g4 --config c2g4d --config c1g16 --config c1g16d --json $D/ab-4096.json' \
  'ab-big|200|ferrite bench matmul --device cuda --dtype bf16 --dtype f16 --variant wgmma --size 8192 --config c2g8 --config c2g8d --json $D/ab-8192.json; for nk in "4096 4096" "14336 4096" "4096 14336"; do set -- $nk; ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n $1 --k $2 --config c2g8 --config c2g8d --json $D/ab-llm-$1-$2.json || exit 1; done' \
  'tuned|120|ferrite bench matmul --device cuda --dtype bf16 --dtype f16 --variant wgmma --size 4096 --json $D/tuned-4096.json' \
  || status=1; }
# D: C's TMA store in the linear layer's pair epilogue too (`persistent_pairs`: Z and Y staged and
# TMA-stored on interior tiles; the old direct pair path removed): its check (and the GPU
# backward's, under `naive`), the linear bench (forward against the bare GEMM, backward against
# the two cuBLAS GEMMs), and the whole matmul ladder at 4096³ for the README table.
[[ $part == *D* ]] && { bash "$here/steps.sh" pending-D "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only matmul > $D/kernels-matmul.txt' \
  'check-linear|170|ferrite check linear --device cuda --variant persistent_pairs --variant naive --trace --json $D/check-linear.json' \
  'bench-linear|120|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  'bench-4096|120|ferrite bench matmul --device cuda --size 4096 --json $D/bench-4096.json --plot $D/ladder-4096.svg' \
  || status=1; }
# E: the full matmul check (every variant, dtype, layout, odd shapes) and the GEMM targets at
# 8192³ and the LLM shapes with the tuner's picks.
[[ $part == *E* ]] && { bash "$here/steps.sh" pending-E "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only matmul > $D/kernels-matmul.txt' \
  'check-matmul|250|ferrite check matmul --device cuda --json $D/check-matmul.json' \
  'bench-big|180|ferrite bench matmul --device cuda --dtype bf16 --dtype f16 --variant wgmma --size 8192 --json $D/bench-8192.json; for nk in "4096 4096" "14336 4096" "4096 14336"; do set -- $nk; ferrite bench matmul --device cuda --dtype bf16 --dtype f16 --variant wgmma --m 8192 --n $1 --k $2 --json $D/bench-llm-$1-$2.json || exit 1; done' \
  || status=1; }
# F: the linear bench with its forward rows (bare GEMM, cuBLAS, every variant) timed in
# alternating rounds too (D timed them one after the other).
[[ $part == *F* ]] && { bash "$here/steps.sh" pending-F "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only matmul/wgmma > $D/kernels-wgmma.txt' \
  'bench-linear|200|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  || status=1; }
# G: the linear backward broken down: its dX and dW GEMMs alone (matmul's default pick) in the
# same alternating rounds as the whole backward and the two cuBLAS GEMMs.
[[ $part == *G* ]] && { bash "$here/steps.sh" pending-G "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only matmul/wgmma > $D/kernels-wgmma.txt' \
  'bench-linear|200|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  || status=1; }
# H: cross_entropy `resident` refilling each kept vector's shared slot with the block's next row
# (cp.async) as pass 2 consumes it, so the next row's pass 1 reads shared memory: check, the
# quick check under compute-sanitizer (memcheck, racecheck), and the bench.
[[ $part == *H* ]] && { bash "$here/steps.sh" pending-H "$bundle" \
  'check-ce|150|ferrite check cross_entropy --device cuda --json $D/check-ce.json' \
  'sanitize|200|compute-sanitizer --tool memcheck --error-exitcode 9 ferrite check cross_entropy --device cuda --variant resident --quick && compute-sanitizer --tool racecheck --error-exitcode 9 ferrite check cross_entropy --device cuda --variant resident --quick' \
  'bench-ce|200|for r in 1 2; do ferrite bench cross_entropy --device cuda --dtype bf16 --variant resident --variant cluster --json $D/bench-ce-$r.json; FERRITE_KERNEL_DIR='"$kd"'/ceold ferrite bench cross_entropy --device cuda --dtype bf16 --variant resident --variant cluster --json $D/bench-ce-old-$r.json; done' \
  || status=1; }
# I: the linear backward's dZ + db pass with 16-byte accesses (linear_bwd_dz_vec; the scalar
# kernel reached ~64% of copy): the linear check (the GPU backward runs under `naive`; its db bits
# are compared across two runs) and the bench with its backward breakdown.
[[ $part == *I* ]] && { bash "$here/steps.sh" pending-I "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only matmul/wgmma > $D/kernels-wgmma.txt; ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt' \
  'check-linear|170|ferrite check linear --device cuda --variant naive --variant persistent_pairs --json $D/check-linear.json' \
  'bench-linear|200|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  || status=1; }
# J: I plus linear_db through col_sum_fixed_order (16 chunk slices in flight per column; one
# thread walked all 128 chunks of its column before): check and bench as in I.
[[ $part == *J* ]] && { bash "$here/steps.sh" pending-J "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only matmul/wgmma > $D/kernels-wgmma.txt; ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt' \
  'check-linear|170|ferrite check linear --device cuda --variant naive --variant persistent_pairs --json $D/check-linear.json' \
  'bench-linear|200|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  || status=1; }
# K: the linear backward's chain form (Bwd::x_pre): the dX GEMM forms the layer below's dZ in
# wgmma's activation-backward epilogue (FE_EPI_DACT). The check (the GPU backward under `naive`:
# GEMM + linear_dact; under `fused`: the epilogue kernel on 16-bit inputs) and the bench's new
# `backward (chain)` row in the same alternating rounds as the backward and cuBLAS's two GEMMs.
[[ $part == *K* ]] && { bash "$here/steps.sh" pending-K "$bundle" \
  'warm|200|ferrite kernels --arch sm_90a --only matmul/wgmma > $D/kernels-wgmma.txt; ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt' \
  'check-linear|200|ferrite check linear --device cuda --variant naive --variant fused --json $D/check-linear.json' \
  'bench-linear|220|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  || status=1; }
# L (session 12): K's chain-form check and bench, plus the norm backward's partial rows written
# with 16-byte stores (ncu had 7% of its sectors excessive: scalar 4-byte partial stores, a
# burst at the kernel's end, LayerNorm twice RMSNorm's) — checked, then benched against the
# committed kernel (kdir/normold) in two alternations; and the per-SASS profiles of ce_resident
# at V = 50257 and the new LayerNorm backward (what stalls now).
[[ $part == *L* ]] && { bash "$here/steps.sh" pending-L "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only matmul/wgmma > $D/kernels-wgmma.txt; ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt; ferrite kernels --arch sm_90a --only norm > $D/kernels-norm.txt' \
  'check-linear|150|ferrite check linear --device cuda --variant naive --variant fused --json $D/check-linear.json' \
  'check-norm|40|ferrite check norm --device cuda --json $D/check-norm.json' \
  'bench-linear|120|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  'bench-norm|120|for r in 1 2; do ferrite bench norm --device cuda --dtype bf16 --json $D/bench-norm-$r.json; FERRITE_KERNEL_DIR='"$kd"'/normold ferrite bench norm --device cuda --dtype bf16 --json $D/bench-norm-old-$r.json; done' \
  "ncu-ce|60|bash $here/ncu-source.sh \$D ce-resident ce_resident 5 -- ferrite bench cross_entropy --device cuda --dtype bf16 --variant resident" \
  "ncu-norm|60|bash $here/ncu-source.sh \$D norm-bwd norm_bwd_vec 215 -- ferrite bench norm --device cuda --dtype bf16 --variant vectorized" \
  || status=1; }
# M (session 12): the linear chain form's check (the DACT epilogue runs under every variant but
# naive) with the epilogue's pre-activation prefetched into L2 eight k-steps ahead (pending-L: the
# epilogue cost ~60 µs per 8192×4096 output), its bench; cross_entropy with pass 1 by cp.async
# (pending-L's profile: 45% of stall samples waiting on pass 1's loads), checked, raced and
# benched against the committed kernel (kdir/ceold) in two alternations.
[[ $part == *M* ]] && { bash "$here/steps.sh" pending-M "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only matmul/wgmma > $D/kernels-wgmma.txt; ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt; ferrite kernels --arch sm_90a --only cross_entropy > $D/kernels-ce.txt' \
  'check-linear|170|ferrite check linear --device cuda --variant naive --variant persistent_pairs --json $D/check-linear.json' \
  'bench-linear|100|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  'check-ce|60|ferrite check cross_entropy --device cuda --json $D/check-ce.json' \
  'sanitize|60|compute-sanitizer --tool memcheck --error-exitcode 9 ferrite check cross_entropy --device cuda --variant resident --variant cluster --quick && compute-sanitizer --tool racecheck --error-exitcode 9 ferrite check cross_entropy --device cuda --variant resident --quick' \
  'bench-ce|150|for r in 1 2; do ferrite bench cross_entropy --device cuda --dtype bf16 --variant resident --variant cluster --json $D/bench-ce-$r.json; FERRITE_KERNEL_DIR='"$kd"'/ceold ferrite bench cross_entropy --device cuda --dtype bf16 --variant resident --variant cluster --json $D/bench-ce-old-$r.json; done' \
  || status=1; }
# N (session 12): the chain form's db from the dX epilogue (FE_EPI_DACT column sums of the
# staged boxes, BwdOut::db_pre) — the library's GPU tests of linear/norm/cross_entropy, the
# linear check (naive: GEMM + linear_dact + a pass; persistent_pairs: the epilogue), memcheck of
# the quick check (the [384]x136<-512 case takes the column sums), the linear bench with its new
# row, and cross_entropy's default pick (resident at V = 128256 now) benched.
[[ $part == *N* ]] && { bash "$here/steps.sh" pending-N "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only matmul/wgmma > $D/kernels-wgmma.txt; ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt; ferrite kernels --arch sm_90a --only cross_entropy > $D/kernels-ce.txt' \
  "tests|120|$bundle/tests/ferrite-lib --test-threads=1 ops::linear ops::norm ops::cross_entropy" \
  'check-linear|200|ferrite check linear --device cuda --variant naive --variant persistent_pairs --json $D/check-linear.json' \
  'bench-linear|120|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  'bench-ce|100|ferrite bench cross_entropy --device cuda --dtype bf16 --json $D/bench-ce.json' \
  'memcheck|150|compute-sanitizer --tool memcheck --error-exitcode 9 ferrite check linear --device cuda --variant persistent_pairs --quick' \
  || status=1; }
# O (session 12): N's check ran the GPU backward under `naive` only (the check runs it under
# `naive` and `fused`), so the activation-backward epilogue and its column sums were not in it:
# the quick 16-bit check under `fused` ([384]x136<-512: every tile writes column sums;
# [264]x520<-64: edge tiles, the pass over dx), the same under memcheck, the norm GPU tests
# (determinism of the 16-byte partial stores), and the linear bench once more.
[[ $part == *O* ]] && { bash "$here/steps.sh" pending-O "$bundle" \
  'check-fused|150|ferrite check linear --device cuda --variant fused --quick --dtype bf16 --dtype f16 --json $D/check-fused.json' \
  'memcheck|120|compute-sanitizer --tool memcheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16' \
  "tests-norm|60|$bundle/tests/ferrite-lib --test-threads=1 ops::norm" \
  'bench-linear|100|ferrite bench linear --device cuda --json $D/bench-linear.json' \
  || status=1; }
# P (session 12): the PyTorch front's tests on CUDA with this session's kernels (norm backward
# stores, cross_entropy's cp.async pass 1 and default pick, the linear changes).
[[ $part == *P* ]] && { bash "$here/steps.sh" pending-P "$bundle" \
  "pytest|300|OUT=\$D/python SKIP_DEMO=1 bash $here/python-gpu.sh $bundle/wheels" \
  || status=1; }
# Q (session 13): where the chain form's dX GEMM loses its ~45 µs (8192×4096←4096): the bench's
# new rows (the dX GEMM with the act' epilogue alone, with and without the column sums) under
# the committed kernel and four ablations of its epilogue (kdir/: R made from registers instead
# of loaded, the same without the L2 prefetch, act' left out, column sums left out: timing only,
# their results are wrong), with the SM clock, power and throttle reasons logged every 100 ms.
lin='ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --m 8192 --n 4096 --k 4096'
[[ $part == *Q* ]] && { bash "$here/steps.sh" pending-Q "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only FE_EPI_DACT=1 > $D/kernels-dact.txt; ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt' \
  'check|90|ferrite check linear --device cuda --variant naive --variant fused --quick --dtype bf16 --json $D/check-linear.json' \
  "ablate|420|nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active --format=csv -lms 100 > \$D/smi.csv 2>&1 & sp=\$!; for v in base noR noRpf noact nocs base; do if [ \$v = base ]; then $lin --json \$D/abl-\$v-\$SECONDS.json; else FERRITE_KERNEL_DIR=$kd/\$v $lin --json \$D/abl-\$v.json; fi || exit 1; done; kill \$sp" \
  || status=1; }
# R (session 13): Q found the act' epilogue's +45 µs unchanged with R's loads, its prefetch, act'
# or the column sums left out; what remains different from the plain dX GEMM is the launch
# configuration (the plain GEMM runs the tuner's pick, the epilogue kernels WG_DEFAULT, c2g8).
# The plain NN GEMM at the dX shapes under every configuration, and the DACT kernel forced to
# each configuration (kdir/dact-*: FE_CLUSTER and group_m overridden in the DACT build only).
[[ $part == *R* ]] && { bash "$here/steps.sh" pending-R "$bundle" \
  'configs|200|for nk in "4096 4096" "4096 14336" "14336 4096"; do set -- $nk; ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n $1 --k $2 --config c2g8 --config c2g4 --config c2g16 --config c2g32 --config c1g8 --config c1g16 --json $D/configs-$1-$2.json || exit 1; done' \
  "dact|300|nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv -lms 200 > \$D/smi.csv 2>&1 & sp=\$!; for v in base c1g8 c1g16 c2g16 c2g4 c2g32; do if [ \$v = base ]; then $lin --json \$D/dact-base.json; else FERRITE_KERNEL_DIR=$kd/dact-\$v $lin --json \$D/dact-\$v.json; fi || exit 1; done; kill \$sp" \
  || status=1; }
# S (session 13): R found every configuration within noise (the act' kernel ~0.445 ms under all
# six, the plain NN GEMM ~0.40–0.42): the +45 µs is not the configuration either. The act'
# kernel with the plain store in place of its epilogue (kdir/dact-plainepi) and with no store at
# all (kdir/dact-nostore), timed; then per-SASS profiles of the act' kernel (now named
# matmul_wgmma_dact) and of the plain NN GEMM at the same shape.
[[ $part == *S* ]] && { bash "$here/steps.sh" pending-S "$bundle" \
  "time|240|for v in base plainepi nostore base; do if [ \$v = base ]; then $lin --json \$D/t-base-\$SECONDS.json; else FERRITE_KERNEL_DIR=$kd/dact-\$v $lin --json \$D/t-\$v.json; fi || exit 1; done" \
  "ncu-dact|150|bash $here/ncu-source.sh \$D dact matmul_wgmma_dact 5 -- $lin" \
  "ncu-plain|150|bash $here/ncu-source.sh \$D plain-nn '^matmul_wgmma\$' 5 -- ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n 4096 --k 4096 --config c2g8" \
  || status=1; }
# T (session 13): S's profile put the act' kernel's extra time in its epilogue (consumer samples
# there 2.6× the plain kernel's, with the tensor cores idle). The helper epilogue: consumers stage
# the whole tile (3-stage ring), warps 1–3 of the producer warpgroup apply act', sum the columns
# and store under the next tile's mainloop. Its check (quick 16-bit, every tile of [384]x136<-512
# staged with column sums; edge tiles), memcheck and racecheck, the bench at the three shapes
# twice, and the plain NN GEMM with a 3-stage ring (kdir/plain3) against the 4-stage one.
[[ $part == *T* ]] && { bash "$here/steps.sh" pending-T "$bundle" \
  'check|120|ferrite check linear --device cuda --variant fused --quick --dtype bf16 --dtype f16 --json $D/check-fused.json' \
  'memcheck|90|compute-sanitizer --tool memcheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16' \
  'racecheck|90|compute-sanitizer --tool racecheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16' \
  'bench|180|for r in 1 2; do ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json $D/bench-linear-$r.json || exit 1; done' \
  "stages|90|for r in 1 2; do ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n 4096 --k 4096 --config c2g8 --json \$D/stages4-\$r.json && FERRITE_KERNEL_DIR=$kd/plain3 ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n 4096 --k 4096 --config c2g8 --json \$D/stages3-\$r.json || exit 1; done" \
  || status=1; }
# U (session 13): T's helpers were too slow at K = 4096 (the act' kernel 0.574 ms against 0.445
# before: ~74 µs of helper work per tile, more than the mainloop; 4-byte accesses, R from DRAM).
# Now 16-byte accesses (a warp access = 4 rows), R prefetched into L2 a tile ahead, 88/200
# registers. The check (after compiling), memcheck, and the bench at the three shapes.
[[ $part == *U* ]] && { bash "$here/steps.sh" pending-U "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt; ferrite kernels --arch sm_90a --only FE_EPI > $D/kernels-epi.txt' \
  'check|150|ferrite check linear --device cuda --variant fused --quick --dtype bf16 --dtype f16 --json $D/check-fused.json' \
  'memcheck|90|compute-sanitizer --tool memcheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16' \
  'bench|120|ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json $D/bench-linear.json' \
  || status=1; }
# V (session 13): U's kernel (check 720/720, memcheck clean) under racecheck, and the linear
# bench twice more (the backward ratios move ±3–5% between calls).
[[ $part == *V* ]] && { bash "$here/steps.sh" pending-V "$bundle" \
  'racecheck|120|compute-sanitizer --tool racecheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16 --dtype f16' \
  'bench|240|for r in 1 2; do ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json $D/bench-linear-$r.json || exit 1; done' \
  || status=1; }
# W (session 13): the helper epilogue is about as slow per tile as the mainloop at k = 4096
# (U/V: the act' kernel +45–50 µs over the plain dX GEMM at 8192×4096←4096); where its warps
# stall, per SASS instruction.
[[ $part == *W* ]] && { bash "$here/steps.sh" pending-W "$bundle" \
  "ncu-dact|200|bash $here/ncu-source.sh \$D dact-helpers matmul_wgmma_dact 5 -- $lin" \
  || status=1; }
# X (session 13): W's profile: the helpers now wait on the consumers, the consumers' epilogue is
# a third of the plain kernel's, but the mainloop waits on its `full` barrier (10.9k samples
# against 1.2k in the plain kernel): with 3 stages the producer has one stage of lookahead. The
# producer now asks L2 for the boxes a ring's length ahead (cp.async.bulk.prefetch.tensor);
# timed against U's kernel (kdir/head), and each with the DACT build's cluster forced to 1
# (kdir/c1, kdir/pfc1: a stage no longer waits on the peer block's consumers), twice.
[[ $part == *X* ]] && { bash "$here/steps.sh" pending-X "$bundle" \
  "time|400|for r in 1 2; do for v in pf head c1 pfc1; do if [ \$v = pf ]; then $lin --json \$D/t-\$v-\$r.json; else FERRITE_KERNEL_DIR=$kd/\$v $lin --json \$D/t-\$v-\$r.json; fi || exit 1; done; done" \
  || status=1; }
# Y (session 13): X's L2 prefetch by the producer made the act' kernel slower (0.547 ms against
# 0.470; dropped); the DACT build without a cluster was faster (0.452). The DACT kernel now
# launches with no cluster (matmul::cuda::WG_DACT): its check, memcheck and racecheck, and the
# linear bench at the three shapes twice.
[[ $part == *Y* ]] && { bash "$here/steps.sh" pending-Y "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt; ferrite kernels --arch sm_90a --only FE_EPI > $D/kernels-epi.txt' \
  'check|150|ferrite check linear --device cuda --variant fused --quick --dtype bf16 --dtype f16 --json $D/check-fused.json' \
  'memcheck|90|compute-sanitizer --tool memcheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16' \
  'racecheck|90|compute-sanitizer --tool racecheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16' \
  'bench|200|for r in 1 2; do ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json $D/bench-linear-$r.json || exit 1; done' \
  || status=1; }
# Z (session 13): the DACT kernel's ring as 6 stages of k = 32 (64-byte K-major rows with the
# 64-byte swizzle; m/n-major boxes of 64 × 32): the same 144 KiB, but the consumers hold 48 KiB
# instead of 96 and the producer keeps 96 KiB in flight, as in the 4-stage ring. Its check,
# memcheck, racecheck, and the linear bench twice. (Result: correct but slower — the act'
# kernel +95–283 µs over the plain dX GEMM against Y's +17–128 — so it was not kept; the part
# needs that build to rerun.)
[[ $part == *Z* ]] && { bash "$here/steps.sh" pending-Z "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt; ferrite kernels --arch sm_90a --only FE_EPI > $D/kernels-epi.txt' \
  'check|150|ferrite check linear --device cuda --variant fused --quick --dtype bf16 --dtype f16 --json $D/check-fused.json' \
  'memcheck|90|compute-sanitizer --tool memcheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16' \
  'racecheck|90|compute-sanitizer --tool racecheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16' \
  'bench|200|for r in 1 2; do ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json $D/bench-linear-$r.json || exit 1; done' \
  || status=1; }
# AA (session 13): a hybrid, 4-stage ring: the consumers apply act' to boxes 2–3 in registers (as
# in session 12) and stage boxes 0–1 raw in the plain kernel's 32 KiB area for the helper warps.
# Check (quick 16-bit) and the linear bench once. (Result: 720/720, but not faster than Y's
# kernel — act' +55 / +72 / +134 µs over the plain dX GEMM — and it spilled 8–16 bytes in the
# tanh activations: not kept; the part needs that build to rerun. Its `*A*` also ran part A.)
[[ $part == AA ]] && { bash "$here/steps.sh" pending-AA "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only FE_EPI_DACT > $D/kernels-dact.txt; ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt' \
  'check|150|ferrite check linear --device cuda --variant fused --quick --dtype bf16 --dtype f16 --json $D/check-fused.json' \
  'bench|120|ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json $D/bench-linear.json' \
  || status=1; }
# 14.1 (session 14; parts from here on are named by session and number, matched exactly): the
# DACT kernel borrows its staging area as a 4th ring slot for the k-blocks from FE_DACT_SLOT_FROM
# (8) of each tile on (wgmma.cu, ring_step), once the helpers have stored the previous tile.
# Check (quick 16-bit), memcheck, racecheck, then the linear bench at the three shapes under
# session 13's kernel (kdir/head) and the new one with the slot from k-block 4, 8 (built in),
# 12 and 16 (kdir/f4, f12, f16), alternating. (Result: correct, but the act' kernel +96–423 µs
# over the plain dX GEMM against head's +12–84: the producer waited on the helpers. Not kept;
# the part needs that build: bench/results/2026-11-26-h100-session14/pending-14.2/dact-experiment.patch.)
[[ $part == 14.1 ]] && { bash "$here/steps.sh" pending-14.1 "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt; ferrite kernels --arch sm_90a --only FE_EPI > $D/kernels-epi.txt' \
  'check|150|ferrite check linear --device cuda --variant fused --quick --dtype bf16 --dtype f16 --json $D/check-fused.json' \
  'memcheck|60|compute-sanitizer --tool memcheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16' \
  'racecheck|60|compute-sanitizer --tool racecheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16' \
  "ab|330|for v in head f8 f4 f12 f16 head f8 f12; do if [ \$v = f8 ]; then k=; else k=$kd/\$v; fi; FERRITE_KERNEL_DIR=\$k ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json \$D/ab-\$v-\$(date +%s).json > \$D/ab-\$v.txt 2>&1 || exit 1; done" \
  || status=1; }
# 14.2 (session 14): 14.1's borrowed slot made the act' kernel slower (+96–423 µs over the plain
# dX GEMM against head's +12–84): the producer waited for the helpers, which take ~20 µs per
# tile (R loads, one box at a time). Now the helpers keep 1 or 2 boxes of R loading ahead
# (FE_DACT_R_AHEAD, registers 104/200 or 120/192). Built in: ahead 1, slot from k-block 12;
# check, memcheck, racecheck (and the check under a2f12), then the linear bench under head,
# a1 / a2 (no borrowed slot), a1f12, a2f12, a2f8, alternating. (Result: correct; the borrowed
# slot still slower, the lookahead alone within noise of head. Not kept; the kdir copies are the
# patch in bench/results/2026-11-26-h100-session14/pending-14.2 with FE_DACT_R_AHEAD and
# FE_DACT_SLOT_FROM defined first.)
[[ $part == 14.2 ]] && { bash "$here/steps.sh" pending-14.2 "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only linear > $D/kernels-linear.txt; ferrite kernels --arch sm_90a --only FE_EPI > $D/kernels-epi.txt' \
  'check|150|ferrite check linear --device cuda --variant fused --quick --dtype bf16 --dtype f16 --json $D/check-fused.json' \
  "check-a2f12|100|FERRITE_KERNEL_DIR=$kd/a2f12 ferrite check linear --device cuda --variant fused --quick --dtype bf16 --json \$D/check-a2f12.json" \
  'memcheck|60|compute-sanitizer --tool memcheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16' \
  'racecheck|60|compute-sanitizer --tool racecheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16' \
  "ab|330|for v in head a1 a2 a1f12 a2f12 a2f8 head a2 a1f12 a2f12; do FERRITE_KERNEL_DIR=$kd/\$v ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json \$D/ab-\$v-\$(date +%s).json > \$D/ab-\$v.txt 2>&1 || exit 1; done" \
  || status=1; }
# 14.3 (session 14): the PyTorch front's `ferrite.mlp` (fc1 → activation → fc2 with the chain-form
# backward: act' and db1 in fc2's dX GEMM epilogue): pytest on CUDA (all tests, the new MLP
# parity included), then fwd+bwd against torch eager and ferrite's two `linear` calls at
# 8192 rows, 4096 → 14336 → 4096 and 4096 → 16384 → 4096 (mlp_peers.py).
[[ $part == 14.3 ]] && { bash "$here/steps.sh" pending-14.3 "$bundle" \
  "pytest|300|OUT=\$D/python SKIP_DEMO=1 bash $here/python-gpu.sh $bundle/wheels" \
  "mlp|200|site=\$(mktemp -d); python3 -m zipfile -e \$(ls $bundle/wheels/ferrite-*.whl | head -1) \$site && cp python/ferrite/*.py \$site/ferrite/ && export PYTHONPATH=\$site LD_LIBRARY_PATH=/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-} && for h in 14336 16384; do python3 $here/mlp_peers.py \$D/mlp-\$h.json --hidden \$h || exit 1; done" \
  || status=1; }
# 14.4 (session 14): our NN GEMM ran 5–11% slower than our NT GEMM of the same m, n, k in
# 14.1–14.2 (the backward's dX GEMM against the forward's). Nsight Compute per-SASS profiles of
# both at 8192×14336×4096: NT = the linear bench's bare forward GEMM, NN = the matmul bench.
# (Result: 1.22 ms each at 1.60 GHz — the bench's gap was the blocks' clock histories.)
[[ $part == 14.4 ]] && { bash "$here/steps.sh" pending-14.4 "$bundle" \
  "ncu-nt|150|bash $here/ncu-source.sh \$D nt '^matmul_wgmma\$' 5 -- ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --m 8192 --n 14336 --k 4096" \
  "ncu-nn|150|bash $here/ncu-source.sh \$D nn '^matmul_wgmma\$' 5 -- ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n 14336 --k 4096 --config c2g8" \
  "gz|30|gzip \$D/*-sass.csv; rm -f \$D/*.ncu-rep" \
  || status=1; }
# 14.5 (session 14): 14.4 timed our NN and NT GEMMs alike under Nsight Compute (1.22 ms each at
# 8192×14336×4096, SM clock 1.60 GHz): cuBLAS's NN GEMM of that shape under the same profiler.
[[ $part == 14.5 ]] && { bash "$here/steps.sh" pending-14.5 "$bundle" \
  "ncu-cublas|150|source $here/ncu-env.sh; PATH=\$PATH:\$cuda_tools_path; for l in NN NT; do ncu --clock-control none \$ncu_sections --nvtx --nvtx-include 'mm/' -f -o \$D/cublas-\$l python3 $here/cublas_mm.py 8192 14336 4096 \$l > \$D/cublas-\$l.txt 2>&1; ncu -i \$D/cublas-\$l.ncu-rep --print-details all >> \$D/cublas-\$l.txt 2>&1; done" \
  "gz|30|rm -f \$D/*.ncu-rep" \
  || status=1; }
# 14.6 (session 14): 14.4/14.5 put our GEMM 1.7% behind cuBLAS's at equal clocks (1.22 against
# 1.20 ms at 1.6 GHz, 8192×14336×4096) while the benches see 2–10%: sustained throughput, SM
# clock and board power of each, back to back for 3 s, alternating (power_clocks.py). (Result:
# both at the 700 W limit; cuBLAS 974/1005 GFLOP/J, ours 929/980: 0.94/0.975 of its speed.)
[[ $part == 14.6 ]] && { bash "$here/steps.sh" pending-14.6 "$bundle" \
  "power|200|site=\$(mktemp -d); python3 -m zipfile -e \$(ls $bundle/wheels/ferrite-*.whl | head -1) \$site && cp python/ferrite/*.py \$site/ferrite/ && export PYTHONPATH=\$site LD_LIBRARY_PATH=/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-} FERRITE_CACHE_DIR=/tmp/ferrite-cache && python3 $here/power_clocks.py \$D/power-14336-4096.json --n 14336 --k 4096 && python3 $here/power_clocks.py \$D/power-4096-14336.json --n 4096 --k 14336" \
  || status=1; }
# 14.7 (session 14): the f32 norm backward, not re-measured since its partial-sum stores became
# float4 (session 12 measured bf16 only; f32 layer_norm bwd was 89% of copy before): the norm
# bench in f32 and bf16, and the norm check.
[[ $part == 14.7 ]] && { bash "$here/steps.sh" pending-14.7 "$bundle" \
  'bench|150|ferrite bench norm --device cuda --dtype f32 --dtype bf16 --json $D/bench-norm.json' \
  'check|150|ferrite check norm --device cuda --json $D/check-norm.json' \
  || status=1; }
# 14.8 (session 14): 14.6 put our GEMM's sustained gap in energy per FLOP at the 700 W limit.
# Does operand traffic drive it? The same sustained runs with the wgmma launch forced to c2g8
# (B multicast across a 2-block cluster: 32 KiB of L2 reads per block-stage), c1g8 (no cluster:
# 48 KiB), c2g16 and c2g8d (direct stores), beside the tuner's pick (FERRITE_WGMMA_CONFIG).
[[ $part == 14.8 ]] && { bash "$here/steps.sh" pending-14.8 "$bundle" \
  "power|300|site=\$(mktemp -d); python3 -m zipfile -e \$(ls $bundle/wheels/ferrite-*.whl | head -1) \$site && cp python/ferrite/*.py \$site/ferrite/ && export PYTHONPATH=\$site LD_LIBRARY_PATH=/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-} FERRITE_CACHE_DIR=/tmp/ferrite-cache && python3 $here/power_clocks.py \$D/power-configs.json --n 14336 --k 4096 --configs c2g8,c1g8,c2g16,c2g8d" \
  || status=1; }
# 14.9 (session 14): 14.8 — sustained energy per FLOP: c1g8 (+50% L2 reads) 1.5% below c2g8,
# direct stores (c2g8d) 9% below: the epilogue, not the operand traffic. Its share: our GEMM
# with no C store at all (kdir/nostore: the TMA-store epilogue skipped; output unwritten, timing
# only), against the committed one, each run alternating with cuBLAS.
[[ $part == 14.9 ]] && { bash "$here/steps.sh" pending-14.9 "$bundle" \
  "power|300|site=\$(mktemp -d); python3 -m zipfile -e \$(ls $bundle/wheels/ferrite-*.whl | head -1) \$site && cp python/ferrite/*.py \$site/ferrite/ && export PYTHONPATH=\$site LD_LIBRARY_PATH=/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-} FERRITE_CACHE_DIR=/tmp/ferrite-cache FERRITE_WGMMA_CONFIG=c2g8 && python3 $here/power_clocks.py \$D/power-base.json --n 14336 --k 4096 && FERRITE_KERNEL_DIR=$kd/nostore python3 $here/power_clocks.py \$D/power-nostore.json --n 14336 --k 4096 && python3 $here/power_clocks.py \$D/power-base2.json --n 14336 --k 4096" \
  || status=1; }
# 14.10 (session 14): 14.9 — with no C store at all ours ran 1.429 ms against cuBLAS's 1.412
# (which stores C) and our committed 1.481: the epilogue costs us ~3.5%, cuBLAS's is nearly free.
# Ours waits twice per tile for the TMA unit to read a staging buffer (2 per warp, 4 boxes).
# kdir/s3b4: 3 stages and the whole 16 × 256 slice staged (4 boxes, no waits; the ring shallower,
# which session 13 found free for this GEMM): check, then sustained runs against the committed.
[[ $part == 14.10 ]] && { bash "$here/steps.sh" pending-14.10 "$bundle" \
  "check|150|FERRITE_KERNEL_DIR=$kd/s3b4 ferrite check matmul --device cuda --variant wgmma --quick --json \$D/check-s3b4.json" \
  "power|300|site=\$(mktemp -d); python3 -m zipfile -e \$(ls $bundle/wheels/ferrite-*.whl | head -1) \$site && cp python/ferrite/*.py \$site/ferrite/ && export PYTHONPATH=\$site LD_LIBRARY_PATH=/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-} FERRITE_CACHE_DIR=/tmp/ferrite-cache FERRITE_WGMMA_CONFIG=c2g8 && for s in '14336 4096' '4096 14336'; do set -- \$s; python3 $here/power_clocks.py \$D/power-base-\$1-\$2.json --n \$1 --k \$2 --rounds 2 && FERRITE_KERNEL_DIR=$kd/s3b4 python3 $here/power_clocks.py \$D/power-s3b4-\$1-\$2.json --n \$1 --k \$2 --rounds 2 || exit 1; done" \
  || status=1; }
# 14.11 (session 14): 14.10's whole-slice staging beside a 3-stage ring, now the host's choice
# for every TMA-store build (plain 16-bit C, the pair epilogue, the activation backward): the
# matmul and linear checks (quick) and racecheck, then sustained runs (power_clocks.py) of the
# previous build's wheel (wheels-old) and this one at two shapes, and the linear bench under the
# previous binary (bin-old) and this one, alternating.
[[ $part == 14.11 ]] && { bash "$here/steps.sh" pending-14.11 "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only wgmma > $D/kernels-wgmma.txt' \
  'check|200|ferrite check matmul --device cuda --variant wgmma --quick --json $D/check-matmul.json; a=$?; ferrite check linear --device cuda --variant fused --variant persistent_pairs --quick --dtype bf16 --dtype f16 --json $D/check-linear.json; exit $((a|$?))' \
  'racecheck|90|compute-sanitizer --tool racecheck --error-exitcode 9 ferrite check matmul --device cuda --variant wgmma --quick --dtype bf16' \
  "power|300|for w in wheels-old wheels; do site=\$(mktemp -d); python3 -m zipfile -e \$(ls $bundle/\$w/ferrite-*.whl | head -1) \$site && cp python/ferrite/*.py \$site/ferrite/ && for s in '14336 4096' '4096 4096'; do set -- \$s; PYTHONPATH=\$site LD_LIBRARY_PATH=/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-} FERRITE_CACHE_DIR=/tmp/ferrite-cache-\$w FERRITE_WGMMA_CONFIG=c2g8 python3 $here/power_clocks.py \$D/power-\$w-\$1-\$2.json --n \$1 --k \$2 --rounds 2 || exit 1; done; done" \
  "bench|300|for v in new old new old; do if [ \$v = old ]; then b=$bundle/bin-old/ferrite; else b=ferrite; fi; \$b bench linear --device cuda --dtype bf16 --variant persistent_pairs --json \$D/ab-\$v-\$(date +%s).json > \$D/ab-\$v.txt 2>&1 || exit 1; done" \
  || status=1; }
# 14.12 (session 14): 14.11 — whole-slice staging beside 3 stages helped the plain GEMM (sustained
# 0.940 → 0.956× cuBLAS at 8192×14336×4096) and the chain backward, but the pair epilogue's
# forward ran up to 8% slower: the pair build is back at 4 stages and 2 buffers per warp, the
# plain and DACT builds keep 3 + 4. Checks, racecheck, and the A/B of 14.11 once more.
[[ $part == 14.12 ]] && { bash "$here/steps.sh" pending-14.12 "$bundle" \
  'warm|150|ferrite kernels --arch sm_90a --only wgmma > $D/kernels-wgmma.txt' \
  'check|200|ferrite check matmul --device cuda --variant wgmma --quick --json $D/check-matmul.json; a=$?; ferrite check linear --device cuda --variant fused --variant persistent_pairs --quick --dtype bf16 --dtype f16 --json $D/check-linear.json; exit $((a|$?))' \
  'racecheck|120|compute-sanitizer --tool racecheck --error-exitcode 9 ferrite check matmul --device cuda --variant wgmma --quick --dtype bf16; a=$?; compute-sanitizer --tool racecheck --error-exitcode 9 ferrite check linear --device cuda --variant persistent_pairs --variant fused --quick --dtype bf16; exit $((a|$?))' \
  "power|200|for w in wheels-old wheels; do site=\$(mktemp -d); python3 -m zipfile -e \$(ls $bundle/\$w/ferrite-*.whl | head -1) \$site && cp python/ferrite/*.py \$site/ferrite/ && PYTHONPATH=\$site LD_LIBRARY_PATH=/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-} FERRITE_CACHE_DIR=/tmp/ferrite-cache-\$w FERRITE_WGMMA_CONFIG=c2g8 python3 $here/power_clocks.py \$D/power-\$w.json --n 14336 --k 4096 --rounds 2 || exit 1; done" \
  "bench|300|for v in new old new old; do if [ \$v = old ]; then b=$bundle/bin-old/ferrite; else b=ferrite; fi; \$b bench linear --device cuda --dtype bf16 --variant persistent_pairs --json \$D/ab-\$v-\$(date +%s).json > \$D/ab-\$v.txt 2>&1 || exit 1; done" \
  || status=1; }
# 14.13 (session 14): confirmation of 14.12's build: the linear bench three more times, and the
# square matmul benches (4096³, 8192³ bf16, wgmma's default pick and cuBLAS) under the previous
# binary (bin-old) and this one.
[[ $part == 14.13 ]] && { bash "$here/steps.sh" pending-14.13 "$bundle" \
  "bench|300|for v in new new new; do ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json \$D/ab-\$v-\$(date +%s).json > \$D/ab-\$v.txt 2>&1 || exit 1; done" \
  "matmul|200|for v in new old new old; do if [ \$v = old ]; then b=$bundle/bin-old/ferrite; else b=ferrite; fi; for n in 4096 8192; do \$b bench matmul --device cuda --dtype bf16 --variant wgmma --size \$n --json \$D/mm-\$v-\$n-\$(date +%s).json >> \$D/mm-\$v.txt 2>&1 || exit 1; done; done" \
  || status=1; }
# 14.14 (session 14): 14.13's square benches were inconclusive (8192³: 0.951/0.996 new against
# 1.04/1.024 old, cuBLAS itself moving 3%): sustained runs (power_clocks.py) of the previous
# wheel and this one at 8192³ and 4096³, the tuner's pick.
[[ $part == 14.14 ]] && { bash "$here/steps.sh" pending-14.14 "$bundle" \
  "power|300|for w in wheels-old wheels; do site=\$(mktemp -d); python3 -m zipfile -e \$(ls $bundle/\$w/ferrite-*.whl | head -1) \$site && cp python/ferrite/*.py \$site/ferrite/ && for n in 8192 4096; do PYTHONPATH=\$site LD_LIBRARY_PATH=/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-} FERRITE_CACHE_DIR=/tmp/ferrite-cache-\$w python3 $here/power_clocks.py \$D/power-\$w-\$n.json --m \$n --n \$n --k \$n --rounds 2 || exit 1; done; done" \
  || status=1; }
# 14.15 (session 14): with the whole-slice staging build the chain backward misses 0.9 only at
# 8192×4096←14336, where the act' dX kernel (8192×14336 output, k = 4096) costs +114–166 µs over
# the plain dX GEMM (now the same 3-stage ring and staging): per-SASS profiles of both there.
[[ $part == 14.15 ]] && { bash "$here/steps.sh" pending-14.15 "$bundle" \
  "ncu-dact|150|bash $here/ncu-source.sh \$D dact matmul_wgmma_dact 5 -- ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --m 8192 --n 4096 --k 14336" \
  "ncu-plain|150|bash $here/ncu-source.sh \$D plain '^matmul_wgmma\$' 5 -- ferrite bench matmul --device cuda --dtype bf16 --variant wgmma --m 8192 --n 14336 --k 4096 --config c1g8" \
  "gz|30|gzip \$D/*-sass.csv; rm -f \$D/*.ncu-rep" \
  || status=1; }
# 14.16 (session 14): 14.15 — at 8192×4096←14336 the act' dX kernel ran 1.35 ms against 1.21 for
# the plain dX GEMM (single launches), with DRAM traffic up by ~0.5 GB (R is 235 MB) and the L2
# hit rate down from 73.7 to 66.5%: R's lines crowd the operands out of L2. kdir/v1: the
# helpers' R loads with an L2 evict-first policy; kdir/v2: also every TMA store of C (both
# builds). A quick check under v2, then the linear bench at that shape, head/v1/v2 alternating.
# (Result: correct, no faster: act' dX 1.549–1.562 ms in every variant; not kept.)
[[ $part == 14.16 ]] && { bash "$here/steps.sh" pending-14.16 "$bundle" \
  "check|150|FERRITE_KERNEL_DIR=$kd/v2 ferrite check linear --device cuda --variant fused --quick --dtype bf16 --json \$D/check-v2.json; a=\$?; FERRITE_KERNEL_DIR=$kd/v2 ferrite check matmul --device cuda --variant wgmma --quick --dtype bf16 --json \$D/check-mm-v2.json; exit \$((a|\$?))" \
  "ab|300|for v in head v1 v2 head v1 v2; do FERRITE_KERNEL_DIR=$kd/\$v ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --m 8192 --n 4096 --k 14336 --json \$D/ab-\$v-\$(date +%s).json > \$D/ab-\$v.txt 2>&1 || exit 1; done" \
  || status=1; }
# 15.1 (session 15): the act' dX kernel (matmul_wgmma_dact) launches without a cluster since
# session 13, but kept g8, i.e. 8 tile rows per group where c2g8 has 16: a wave of 132 128×256
# tiles then spans 8 rows × 16.5 columns (A 1 MB + B 2 MB per panel at k = 4096: 41 MB of
# operands in a 50 MB L2 shared with R) against 32.5 MB for 16 × 8.25. The linear bench with the
# kernel's group height forced (FERRITE_WGMMA_DACT_GROUP) to 8, 16 and 32, alternating.
[[ $part == 15.1 ]] && { bash "$here/steps.sh" pending-15.1 "$bundle" \
  "ab|400|for g in 8 16 32 8 16 32; do FERRITE_WGMMA_DACT_GROUP=\$g ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json \$D/ab-g\$g-\$(date +%s).json > \$D/ab-g\$g.txt 2>&1 || exit 1; done; python3 $here/ab_linear.py \$D > \$D/ab-table.txt" \
  || status=1; }
# 15.2 (session 15): 15.1 — no group height helped (act' dX +125–169 µs at g16, +128–165 at g8,
# +184–198 at g32) and the same two GEMMs' ratio to cuBLAS's moved 0.926–0.997 between calls of
# one binary: the linear bench now interleaves its launches repeat by repeat
# (time_gpu_interleaved). Under it, R's L2 traffic in the act' dX kernel: kdir/noprefetch drops
# the helpers' prefetch of R into L2 a tile ahead (its lines sat in L2 ~45 µs beside the
# operands; the helpers have ~25 µs of slack per tile to wait for R instead), kdir/evictfirst
# also loads R with an L2 evict-first policy (14.16 had the policy on loads of lines already
# prefetched at normal priority). A quick check under each, then the bench, alternating.
[[ $part == 15.2 ]] && { bash "$here/steps.sh" pending-15.2 "$bundle" \
  "check|200|s=0; for v in noprefetch evictfirst; do FERRITE_KERNEL_DIR=$kd/\$v ferrite check linear --device cuda --variant fused --quick --dtype bf16 --json \$D/check-\$v.json > \$D/check-\$v.txt 2>&1 || s=1; tail -2 \$D/check-\$v.txt; done; exit \$s" \
  "ab|400|for v in head noprefetch evictfirst head noprefetch evictfirst; do FERRITE_KERNEL_DIR=$kd/\$v ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json \$D/ab-\$v-\$(date +%s).json > \$D/ab-\$v.txt 2>&1 || exit 1; done; python3 $here/ab_linear.py \$D > \$D/ab-table.txt" \
  || status=1; }
# 15.3 (session 15): 15.2 — interleaved, the same binary's ratios repeat to ±0.002 and the act'
# dX kernel costs +37–62 µs over the plain dX GEMM (block rounds had shown +120–200): chain
# 0.930/0.976/0.941 and 0.930/0.973/0.939; neither R variant helped. Now the same build twice
# more interleaved, and once under --timing sustained (each launch 1 s settled + 1 s timed, 2
# rounds: at the clock its own power draw holds).
[[ $part == 15.3 ]] && { bash "$here/steps.sh" pending-15.3 "$bundle" \
  "ab|200|for v in inter inter; do ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json \$D/ab-\$v-\$(date +%s).json > \$D/ab-\$v.txt 2>&1 || exit 1; done" \
  "sustained|300|ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --timing sustained --json \$D/ab-sust-\$(date +%s).json > \$D/ab-sust.txt 2>&1; r=\$?; python3 $here/ab_linear.py \$D > \$D/ab-table.txt; exit \$r" \
  || status=1; }
# 15.4 (session 15): 15.3 — interleaved twice more 0.928/0.975/0.939–0.940; sustained
# 0.906/0.945/0.927 (8192×4096←4096 the closest). There the act' dX kernel (1024 tiles, ~8 per
# block) pays the helpers' ~15–20 µs of the last tile with nothing to hide it under: now the 8
# consumer warps join the 3 helpers on each block's last tile (kdir/old: the kernel before).
# Checks (a new GPU-only case where blocks take two tiles), racecheck, the bench new/old/new
# interleaved, then sustained.
[[ $part == 15.4 ]] && { bash "$here/steps.sh" pending-15.4 "$bundle" \
  "check|200|ferrite check linear --device cuda --variant fused --quick --json \$D/check.json" \
  "racecheck|150|compute-sanitizer --tool racecheck --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16 | tail -3" \
  "ab|200|for v in new old new; do FERRITE_KERNEL_DIR=$kd/\$v ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json \$D/ab-\$v-\$(date +%s).json > \$D/ab-\$v.txt 2>&1 || exit 1; done" \
  "sustained|220|ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --timing sustained --json \$D/ab-sust-\$(date +%s).json > \$D/ab-sust.txt 2>&1; r=\$?; python3 $here/ab_linear.py \$D > \$D/ab-table.txt; exit \$r" \
  || status=1; }
# 15.5 (session 15): 15.4 — the join: act' dX +21/+17/+40 µs over the plain dX GEMM (old kernel
# +35/+32/+68), chain 0.944/0.981/0.950 interleaved, 0.927/0.972/0.915 sustained; checks pass,
# but racecheck showed 4 hazards (the new GPU-only case is the first whose blocks take two act' dX
# tiles). Full racecheck reports under the new kernel and the old one.
[[ $part == 15.5 ]] && { bash "$here/steps.sh" pending-15.5 "$bundle" \
  "race-new|150|compute-sanitizer --tool racecheck --print-limit 40 --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16 > \$D/race-new.log 2>&1; r=\$?; tail -3 \$D/race-new.log; exit \$r" \
  "race-old|150|FERRITE_KERNEL_DIR=$kd/old compute-sanitizer --tool racecheck --print-limit 40 --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16 > \$D/race-old.log 2>&1; r=\$?; tail -3 \$D/race-old.log; exit \$r" \
  || status=1; }
# 15.6 (session 15): 15.5 — racecheck flags the joined build only (the old one: 0 hazards): a
# helper's STS of a box in an earlier tile against the joined tile's LDS of it by another warp
# (consumer or helper), ordered only through one-lane arrivals after __syncwarp. Now every thread
# of the handoff arrives on stg_full / stg_empty (256 / 96). Racecheck, check, one bench.
[[ $part == 15.6 ]] && { bash "$here/steps.sh" pending-15.6 "$bundle" \
  "race|150|compute-sanitizer --tool racecheck --print-limit 40 --error-exitcode 9 ferrite check linear --device cuda --variant fused --quick --dtype bf16 > \$D/race.log 2>&1; r=\$?; tail -3 \$D/race.log; exit \$r" \
  "check|200|ferrite check linear --device cuda --variant fused --quick --json \$D/check.json > \$D/check.log 2>&1; r=\$?; tail -2 \$D/check.log; exit \$r" \
  "ab|100|ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json \$D/ab-new-\$(date +%s).json > \$D/ab-new.txt 2>&1; r=\$?; python3 $here/ab_linear.py \$D > \$D/ab-table.txt; exit \$r" \
  || status=1; }
# 15.7 (session 15): 15.6 — racecheck 0 hazards, check 1125/1125; the bench (a fresh machine)
# put the act' dX kernel at +68 µs over plain dX at 8192×4096←14336 (15.4: +40). Same-call A/B of
# every-thread arrivals (new) against 15.4's one-lane ones (kdir/j1), then sustained.
[[ $part == 15.7 ]] && { bash "$here/steps.sh" pending-15.7 "$bundle" \
  "ab|200|for v in new j1 new j1; do FERRITE_KERNEL_DIR=$kd/\$v ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --json \$D/ab-\$v-\$(date +%s).json > \$D/ab-\$v.txt 2>&1 || exit 1; done" \
  "sustained|220|ferrite bench linear --device cuda --dtype bf16 --variant persistent_pairs --timing sustained --json \$D/ab-sust-\$(date +%s).json > \$D/ab-sust.txt 2>&1; r=\$?; python3 $here/ab_linear.py \$D > \$D/ab-table.txt; exit \$r" \
  || status=1; }
exit $status
