"""The two-layer MLP, forward + backward, through the PyTorch front on the GPU: torch eager
(F.linear, GELU, F.linear and autograd: cuBLAS GEMMs plus elementwise kernels), ferrite's two
`linear` calls (the activation fused into the first forward GEMM; backward: the dZ pass, then
the GEMMs) and `ferrite.mlp` (the same forward; the backward in the chain form: the activation's
derivative and db1 inside fc2's dX GEMM). CUDA events, medians of many alternating repeats
after warm-up, inputs past L2. Usage:
    python3 mlp_peers.py OUT_JSON [--rows 8192 --dim 4096 --hidden 14336 --act gelu_tanh]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

import ferrite


def timed(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=14336)
    p.add_argument("--act", default="gelu_tanh")
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    dt = torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(a.rows, a.dim, device="cuda", dtype=dt, requires_grad=True)
    w1 = (torch.randn(a.hidden, a.dim, device="cuda", dtype=dt) * a.dim**-0.5).requires_grad_()
    b1 = (torch.randn(a.hidden, device="cuda", dtype=dt) * 0.1).requires_grad_()
    w2 = (torch.randn(a.dim, a.hidden, device="cuda", dtype=dt) * a.hidden**-0.5).requires_grad_()
    b2 = (torch.randn(a.dim, device="cuda", dtype=dt) * 0.1).requires_grad_()
    dy = torch.randn(a.rows, a.dim, device="cuda", dtype=dt)
    params = (x, w1, b1, w2, b2)
    approx = "tanh" if a.act == "gelu_tanh" else "none"

    def torch_mlp():
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate=approx), w2, b2)

    def ferrite_linears():
        return ferrite.linear(ferrite.linear(x, w1, b1, activation=a.act), w2, b2)

    def ferrite_mlp():
        return ferrite.mlp(x, w1, b1, w2, b2, activation=a.act)

    ways = {"torch eager": torch_mlp, "ferrite linear ×2": ferrite_linears, "ferrite.mlp (chain)": ferrite_mlp}

    def step(f):
        for t in params:
            t.grad = None
        f().backward(dy)

    # the same gradients (bf16 rounding apart) before timing anything
    ref = {}
    for name, f in ways.items():
        step(f)
        ref[name] = [t.grad.float().clone() for t in params]
    for name in ways:
        for i, (g, r) in enumerate(zip(ref[name], ref["torch eager"])):
            err = ((g - r).abs().max() / r.abs().max().clamp_min(1e-6)).item()
            assert err < 5e-2, f"{name}: gradient {i} off by {err:.3g} (relative to its max)"
    times = {n: [] for n in ways}
    fwd = {n: [] for n in ways}
    for _ in range(3):
        for f in ways.values():
            step(f)
    torch.cuda.synchronize()
    for _ in range(a.reps):  # alternating: each way sees the same clocks on average
        for n, f in ways.items():
            times[n].append(timed(lambda: step(f)))
            with torch.no_grad():
                fwd[n].append(timed(f))
    flops = 2 * a.rows * a.dim * a.hidden * 2
    rows = []
    base = statistics.median(times["torch eager"])
    for n in ways:
        t, tf = statistics.median(times[n]), statistics.median(fwd[n])
        rows.append(
            dict(way=n, fwd_bwd_ms=t, fwd_ms=tf, bwd_ms=t - tf, tflops=3 * flops / t / 1e9, speedup_vs_torch=base / t)
        )
    head = f"MLP bf16 {a.rows}×{a.dim} → {a.hidden} → {a.dim}, {a.act}, {torch.cuda.get_device_name()}"
    print(head)
    print(f"{'way':<22}{'fwd+bwd ms':>12}{'fwd ms':>9}{'bwd ms':>9}{'TFLOP/s':>9}{'× torch':>9}")
    for r in rows:
        print(
            f"{r['way']:<22}{r['fwd_bwd_ms']:>12.3f}{r['fwd_ms']:>9.3f}{r['bwd_ms']:>9.3f}"
            f"{r['tflops']:>9.0f}{r['speedup_vs_torch']:>9.3f}"
        )
    with open(a.out, "w") as f:
        json.dump(dict(title=head, args=vars(a), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
