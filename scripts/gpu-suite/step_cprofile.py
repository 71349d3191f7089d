"""The host's side of a few training steps of a bench_model model (cProfile: Python functions and
the native calls they make, by own time), to find where a host-bound step spends its time.
    python3 step_cprofile.py gpt2-124m ferrite [rows]"""
import cProfile
import pstats
import sys
import time

import torch

from ferrite import bench_model as bm

name, v = sys.argv[1], sys.argv[2]
rows = int(sys.argv[3]) if len(sys.argv) > 3 else 45
torch.manual_seed(0)
base, shapes = bm.build(name)
base = base.to(device="cuda", dtype=torch.bfloat16)
b, t = shapes["train"]
ids = torch.randint(0, base.config.vocab_size, (b, t), device="cuda")
m, _ = bm.variant_model(base, v)
opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)


def step():
    m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(5):
    step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(5):
    step()
host = (time.perf_counter() - t0) / 5
torch.cuda.synchronize()
wall = (time.perf_counter() - t0) / 5
print(f"{name} {v}: host {host * 1e3:.2f} ms per step (queueing), wall {wall * 1e3:.2f} ms")
pr = cProfile.Profile()
pr.enable()
for _ in range(3):
    step()
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(rows)
