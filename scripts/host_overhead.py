"""Host time per call of ferrite's torch ops, through the dispatcher (``torch.ops.ferrite.*``)
and through the eager fast path (``ferrite._eager.eager.*``, what the public functions call), on
inputs small enough that the kernel itself is negligible. Runs on the CPU (any machine) or, with
``--device cuda``, on a GPU (host time only: calls are queued, the stream synchronised once per
batch of calls).

    python scripts/host_overhead.py [--device cpu|cuda] [--json out.json]
"""

import argparse
import json
import statistics
import time

import torch

import ferrite
from ferrite._eager import eager


def per_call_us(f, dev, calls=500, reps=7):
    for _ in range(50):
        f()
    out = []
    for _ in range(reps):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            f()
        if dev == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(out)


def cases(dev):
    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    x = torch.randn(8, 64, device=dev, dtype=dt)
    w = torch.randn(64, device=dev, dtype=dt)
    a = torch.randn(8, 64, device=dev, dtype=dt)
    b = torch.randn(64, 8, device=dev, dtype=dt)
    lw = torch.randn(32, 64, device=dev, dtype=dt)
    lb = torch.randn(32, device=dev, dtype=dt)
    tgt = torch.randint(0, 64, (8,), device=dev)
    return [
        ("rms_norm", lambda o: o.rms_norm, (x, [64], w, 1e-6), 0),
        ("layer_norm", lambda o: o.layer_norm, (x, [64], w, w, 1e-5), 0),
        ("softmax", lambda o: o.softmax, (x, 1.0), None),
        ("matmul", lambda o: o.matmul, (a, b), None),
        ("linear", lambda o: o.linear, (x, lw, lb), None),
        ("glu", lambda o: o.glu, (x, "silu"), None),
        ("cross_entropy", lambda o: o.cross_entropy, (x, tgt, -100, 0.0, "mean", False, False), 0),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = args.device
    rows = []
    print(f"host µs per call ({dev}, torch {torch.__version__}): dispatcher / fast path")
    print(f"{'op':15} {'no grad':>22} {'with grad (forward)':>26}")
    for name, pick, inputs, first in cases(dev):
        res = {}
        for grad in (False, True):
            ins = tuple(
                t.detach().requires_grad_(grad) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in inputs
            )
            for path, ns in (("dispatcher", torch.ops.ferrite), ("fast", eager)):
                op = pick(ns)
                res[(grad, path)] = per_call_us(lambda: op(*ins), dev)
        row = {
            "op": name,
            "device": dev,
            "no_grad_dispatcher_us": res[(False, "dispatcher")],
            "no_grad_fast_us": res[(False, "fast")],
            "grad_dispatcher_us": res[(True, "dispatcher")],
            "grad_fast_us": res[(True, "fast")],
        }
        rows.append(row)
        print(
            f"{name:15} {row['no_grad_dispatcher_us']:9.1f} / {row['no_grad_fast_us']:6.1f} "
            f"({row['no_grad_dispatcher_us'] / row['no_grad_fast_us']:.1f}×)"
            f" {row['grad_dispatcher_us']:9.1f} / {row['grad_fast_us']:6.1f} "
            f"({row['grad_dispatcher_us'] / row['grad_fast_us']:.1f}×)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "ferrite": ferrite.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
