#!/usr/bin/env bash
# Nsight Compute of `flash`'s forward and of SDPA's FA2 forward on the same shape (B4 H16 S16384 D128,
# bf16): the one shape where `flash` still trails FA2 (0.93×). On the GPU machine, with the bundle:
#   OUT=dir bash scripts/gpu-suite/ncu-flash-vs-fa2.sh
source "$(dirname "$0")/ncu-env.sh"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH FERRITE_CACHE_DIR=/tmp/fc PATH=$PWD/.gpu-bundle-py/bin:$PATH:$cuda_tools_path
S=$stall_sections
mkdir -p $OUT/s; ferrite kernels --arch sm_90a --only attention/flash > /dev/null
timeout 200 ncu --clock-control none $S -k regex:flash_fwd --launch-skip 3 --launch-count 1 ferrite bench attention --device cuda --dtype bf16 --variant flash --size 16384 > $OUT/s/ncu-flash-fwd.txt 2>&1; echo ours rc=$?
cat > /tmp/fa2.py <<'P'
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
q = torch.randn(4, 16, 16384, 128, device="cuda", dtype=torch.bfloat16); k = torch.randn_like(q); v = torch.randn_like(q)
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    for _ in range(6): F.scaled_dot_product_attention(q, k, v)
torch.cuda.synchronize()
P
timeout 200 ncu --clock-control none $S -k regex:flash_fwd --launch-skip 3 --launch-count 1 python3 /tmp/fa2.py > $OUT/s/ncu-fa2-fwd.txt 2>&1; echo fa2 rc=$?
grep -E "Duration|Registers Per|Issue Slots Busy|Executed Ipc A|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|Shared Memory Config|Block Size|One or More Eligible" $OUT/s/*.txt
