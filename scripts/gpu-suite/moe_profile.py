"""Where a `ferrite.moe` call's time goes, as a PyTorch user runs it: torch.profiler over a few
forward-only (no_grad) and forward+backward calls at one shape, printing the GPU time per kernel
and the host time per call (a host slower than the GPU leaves the GPU idle between kernels).

    python3 moe_profile.py [--shape T,H,I,E,k] [--out DIR]
"""
import argparse
import time

import torch
import ferrite

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="32768,2048,768,128,8")
ap.add_argument("--out", default=".")
a = ap.parse_args()
t, h, i, e, k = (int(v) for v in a.shape.split(","))
dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)
x = torch.rand(t, h, device=dev, dtype=dt, generator=g) * 2 - 1
router = (torch.rand(e, h, device=dev, dtype=dt, generator=g) * 2 - 1) * 0.05
w_up = (torch.rand(e, h, 2 * i, device=dev, dtype=dt, generator=g) * 2 - 1) / h**0.5
w_down = (torch.rand(e, i, h, device=dev, dtype=dt, generator=g) * 2 - 1) / i**0.5
dout = torch.rand(t, h, device=dev, dtype=dt, generator=g) * 2 - 1


def fwd():
    with torch.no_grad():
        ferrite.moe(x, router, w_up, w_down, k)


ps = [p.detach().requires_grad_() for p in (x, router, w_up, w_down)]


def fwd_bwd():
    o, aux = ferrite.moe(*ps, k)
    o.backward(dout)
    for p in ps:
        p.grad = None


for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps
    print(f"== {name}: host {host * 1e3:.3f} ms per call (queueing), wall {wall * 1e3:.3f} ms per call")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)
    print(table)
    prof.export_chrome_trace(f"{a.out}/moe-trace-{name.replace('+', '-')}.json")
