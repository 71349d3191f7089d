"""PyTorch peers for ferrite's memory-bound ops, measured on the GPU in the same suite run.

Times F.rms_norm, F.layer_norm and softmax (eager and torch.compile; forward and backward) at the
shapes `ferrite bench` uses, with CUDA events (median of many repeats after warm-up), and merges
the ratio of ferrite's best variant to each peer into a table. Usage:
    python3 torch_peers.py BENCH_JSON OUT_JSON [--rows 32768 --cols 4096]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def bench(fn, reps=100, warmup=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def cases(rows, cols, dtype):
    x = torch.empty(rows, cols, device="cuda", dtype=dtype).uniform_(-1, 2)
    w = torch.empty(cols, device="cuda", dtype=dtype).uniform_(0.5, 1.5)
    b = torch.empty(cols, device="cuda", dtype=dtype).uniform_(-0.5, 0.5)
    dy = torch.empty_like(x).uniform_(-1, 1)
    rms = lambda t, w_: F.rms_norm(t, (cols,), w_, 1e-5)
    ln = lambda t, w_, b_: F.layer_norm(t, (cols,), w_, b_, 1e-5)
    sm = lambda t: torch.softmax(t, -1)
    es = x.element_size()
    n = rows * cols
    out = []
    for name, fn, args, fwd_bytes, bwd_bytes in [
        (f"rms_norm {rows}×{cols}", rms, (x, w), 2 * n * es, 3 * n * es),
        (f"layer_norm {rows}×{cols}", ln, (x, w, b), 2 * n * es, 3 * n * es),
        (f"{rows}×{cols}", sm, (x,), 2 * n * es, 3 * n * es),
    ]:
        op = "softmax" if name.startswith(f"{rows}") else "norm"
        for label, f in [("torch", fn), ("torch.compile", torch.compile(fn))]:
            ms = bench(lambda: f(*args))
            out.append(dict(op=op, variant=label, dtype=str(dtype).split(".")[-1].replace("bfloat16", "bf16").replace("float32", "f32"),
                            shape=f"{name} fwd", median_ms=ms, gbps=fwd_bytes / ms / 1e6))
            leaves = [a.detach().requires_grad_(True) for a in args]
            y = f(*leaves)
            ms = bench(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True))
            out.append(dict(op=op, variant=label, dtype=out[-1]["dtype"], shape=f"{name} bwd", median_ms=ms, gbps=bwd_bytes / ms / 1e6))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_json")
    ap.add_argument("out_json")
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--cols", type=int, default=4096)
    a = ap.parse_args()
    peers = []
    for dtype in (torch.bfloat16, torch.float32):
        peers += cases(a.rows, a.cols, dtype)
    ours = json.load(open(a.bench_json))["records"]
    print(f"{'op':8} {'dtype':5} {'shape':28} {'peer':14} {'peer GB/s':>9} {'ferrite best':>22} {'× peer':>7}")
    for p in peers:
        mine = [r for r in ours if r["op"] == p["op"] and r["dtype"] == p["dtype"] and r["shape"] == p["shape"] and not r.get("is_peer")]
        if not mine:
            continue
        best = min(mine, key=lambda r: r["median_ms"])
        p["ferrite_variant"], p["ferrite_ms"] = best["variant"], best["median_ms"]
        p["ratio_ferrite_to_peer"] = p["median_ms"] / best["median_ms"]
        print(f"{p['op']:8} {p['dtype']:5} {p['shape']:28} {p['variant']:14} {p['gbps']:9.0f} {best['variant']:>12} {best['gbps']:7.0f} GB/s {p['ratio_ferrite_to_peer']:7.2f}")
    json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name(), peers=peers), open(a.out_json, "w"), indent=1)


if __name__ == "__main__":
    main()
