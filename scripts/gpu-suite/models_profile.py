"""torch.profiler of a few training steps of a bench_model model, per variant: the kernels by GPU
time, to see where a variant loses against another.
    python3 models_profile.py gpt2-124m torch_compile,ferrite_compile"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from ferrite import bench_model as bm

name = sys.argv[1]
variants = sys.argv[2].split(",")
torch.manual_seed(0)
base, shapes = bm.build(name)
base = base.to(device="cuda", dtype=torch.bfloat16)
b, t = shapes["train"]
ids = torch.randint(0, base.config.vocab_size, (b, t), device="cuda")
for v in variants:
    m, _ = bm.variant_model(base, v)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)
    f = lambda ids: m(input_ids=ids, labels=ids, use_cache=False).loss  # noqa: E731
    if v.endswith("compile"):
        f = torch.compile(f)

    def step():
        f(ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(f"===== {name} {v}: 3 steps")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=28, max_name_column_width=70))
    del m, opt
    torch._dynamo.reset()
