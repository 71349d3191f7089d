#!/usr/bin/env bash
# Nsight Compute of the wgmma attention backward (attn_hopper_bwd) at B4 H16 S4096 D128 bf16,
# non-causal: stall reasons and pipe use, for planning its next step (it runs at 0.75-0.8x
# cuDNN's backward). On the GPU machine, with the bundle:   OUT=dir bash scripts/gpu-suite/ncu-hopper-bwd.sh
source "$(dirname "$0")/ncu-env.sh"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH FERRITE_CACHE_DIR=/tmp/fc PATH=$PWD/.gpu-bundle-py/bin:$PATH:$cuda_tools_path
S=$stall_sections
mkdir -p "$OUT/ncu-hopper-bwd"; ferrite kernels --arch sm_90a --only attention/hopper > /dev/null
timeout 240 ncu --clock-control none $S -k regex:attn_hopper_bwd --launch-skip 2 --launch-count 1 \
  ferrite bench attention --device cuda --dtype bf16 --variant hopper --size 4096 > "$OUT/ncu-hopper-bwd/ncu.txt" 2>&1
echo "ncu rc=$?"
grep -E "Duration|Registers Per|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Compute \(SM\) Throughput|Memory Throughput|Est. Speedup|stalled" "$OUT/ncu-hopper-bwd/ncu.txt" | head -40
