"""Where a `ferrite.moe` call's time goes, as a PyTorch user runs it: torch.profiler over a few
forward-only (no_grad) and forward+backward calls at one shape, printing the GPU time per kernel
and the host time per call (a host slower than the GPU leaves the GPU idle between kernels).

    python3 moe_profile.py [--shape T,H,I,E,k] [--out DIR]
"""
import argparse
import json
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


def gaps(path, name):
    """The GPU timeline of the last profiled call: every kernel (and memset/memcpy) with its
    duration and the idle time before it, so time between kernels shows up next to the kernels'."""
    ev = json.load(open(path))["traceEvents"]
    gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
    per = len(gpu) // 5
    last = gpu[-per:]
    busy = sum(e["dur"] for e in last)
    span = last[-1]["ts"] + last[-1]["dur"] - last[0]["ts"]
    print(f"== {name} timeline of one call: {per} GPU ops, span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms")
    prev = None
    for e in last:
        gap = 0.0 if prev is None else e["ts"] - prev
        print(f"  gap {gap:8.1f} us  dur {e['dur']:8.1f} us  {e['name'][:70]}")
        prev = e["ts"] + e["dur"]
    between = [gpu[j]["ts"] - (gpu[j - 1]["ts"] + gpu[j - 1]["dur"]) for j in range(1, len(gpu))]
    print(f"  all calls: {len(gpu)} ops, idle between ops {sum(between) / 1e3:.3f} ms in all")


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
    trace = f"{a.out}/moe-trace-{name.replace('+', '-')}.json"
    prof.export_chrome_trace(trace)
    gaps(trace, name)
