"""One bf16 GEMM through torch (cuBLAS) inside an NVTX range "mm", for Nsight Compute to profile
beside ferrite's kernel of the same shape: python3 cublas_mm.py M N K [NN|NT]"""
import sys

import torch

m, n, k = (int(v) for v in sys.argv[1:4])
layout = sys.argv[4] if len(sys.argv) > 4 else "NN"
a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) if layout == "NN" else torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
for _ in range(3):
    torch.matmul(a, b)
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("mm")
c = torch.matmul(a, b)
torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
print("ok", tuple(c.shape), layout)
