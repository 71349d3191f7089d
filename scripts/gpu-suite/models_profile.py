"""torch.profiler of a few steps of a bench_model model, per variant: the kernels by GPU time and
the GPU's busy share of the steps' span (idle = the host or a synchronisation held it back), to
see where a variant loses against another.
    python3 models_profile.py gpt2-124m torch_compile,ferrite [train|prefill] [rows]"""
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from ferrite import bench_model as bm

name = sys.argv[1]
variants = sys.argv[2].split(",")
mode = sys.argv[3] if len(sys.argv) > 3 else "train"
rows = int(sys.argv[4]) if len(sys.argv) > 4 else 30
torch.manual_seed(0)
base, shapes = bm.build(name)
base = base.to(device="cuda", dtype=torch.bfloat16)
b, t = shapes[mode]
ids = torch.randint(0, base.config.vocab_size, (b, t), device="cuda")


def busy_share(trace):
    """(span, busy) in ms of the GPU ops (kernels, memsets, copies) in a chrome trace."""
    ev = json.load(open(trace))["traceEvents"]
    gpu = sorted(((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")))
    busy, end = 0.0, None
    for s, e in gpu:
        if end is None or s >= end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return (gpu[-1][1] - gpu[0][0]) / 1e3, busy / 1e3, len(gpu)


for v in variants:
    m, _ = bm.variant_model(base, v)
    if mode == "train":
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)
        f = lambda ids: m(input_ids=ids, labels=ids, use_cache=False).loss  # noqa: E731
        if v.endswith("compile"):
            f = torch.compile(f)

        def step():
            f(ids).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        m.eval()
        f = lambda ids: m(input_ids=ids, use_cache=False).logits  # noqa: E731
        if v.endswith("compile"):
            f = torch.compile(f)

        def step():
            with torch.no_grad():
                f(ids)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(f"===== {name} {mode} {v}: 3 steps")
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70))
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    p.export_chrome_trace(trace)
    span, busy, n = busy_share(trace)
    print(f"GPU timeline: {n} ops, span {span:.2f} ms, busy {busy:.2f} ms ({100 * busy / span:.1f}%), per step {busy / 3:.2f} ms busy")
    del m, f
    torch._dynamo.reset()
