"""Host time per call of ferrite's PyTorch ops against torch's, on CUDA with tiny tensors (the GPU
finishes each kernel before the host issues the next, so wall time per queued call is the host's
cost). Each ferrite op is also timed at its native call alone (the arguments the Python layer
built for it, replayed): the Rust side's share.

    python3 host_cost.py"""
import time

import torch
import torch.nn.functional as F

import ferrite
from ferrite import _attention, _fused, _ops, _ops_linear, _ops_matmul, _ops_mlp, _ops_norm

dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
x = torch.randn(8, 64, device=dev, dtype=dt, requires_grad=True)
w = torch.randn(64, device=dev, dtype=dt, requires_grad=True)
b = torch.randn(64, device=dev, dtype=dt, requires_grad=True)
W = torch.randn(64, 64, device=dev, dtype=dt, requires_grad=True)
W2 = torch.randn(64, 256, device=dev, dtype=dt, requires_grad=True)
W1 = torch.randn(256, 64, device=dev, dtype=dt, requires_grad=True)
b1 = torch.randn(256, device=dev, dtype=dt, requires_grad=True)
qkv = torch.randn(2, 16, 3, 2, 64, device=dev, dtype=dt, requires_grad=True)
logits = torch.randn(8, 100, device=dev, dtype=dt, requires_grad=True)
tgt = torch.randint(0, 100, (8,), device=dev)


def per_call(f, n=300):
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return host * 1e6


captured = []
orig = _ops._native_call


def capture(fn, *args, **kwargs):
    conv = lambda v: _ops._desc(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
    captured.append((fn, [conv(a) for a in args], {k: conv(v) for k, v in kwargs.items()}, (args, kwargs)))
    return orig(fn, *args, **kwargs)


def native_cost(f):
    """µs per native call for each native function f issues (replayed with f's arguments)."""
    captured.clear()
    mods = [m for m in (_ops, _ops_linear, _ops_matmul, _ops_mlp, _ops_norm, _attention, _fused) if getattr(m, "_native_call", None) is orig]
    for m in mods:
        m._native_call = capture
    try:
        f()
    finally:
        for m in mods:
            m._native_call = orig
    out = []
    for fn, a, k, keep in list(captured):
        out.append(f"{fn.__name__} {per_call(lambda: fn(*a, **k)):.1f}")
    return ", ".join(out)


cases = [
    ("linear fwd", lambda: F.linear(x, W, b), lambda: ferrite.linear(x, W, b), True),
    ("layer_norm fwd", lambda: F.layer_norm(x, (64,), w, b), lambda: ferrite.layer_norm(x, (64,), w, b), True),
    ("mlp fwd", lambda: F.linear(F.gelu(F.linear(x, W1, b1), approximate="tanh"), W2), lambda: ferrite.mlp(x, W1, b1, W2, None), True),
    ("attn qkvpacked fwd", lambda: F.scaled_dot_product_attention(*qkv.unbind(2)[0:3], is_causal=True), lambda: ferrite.flash_attn_qkvpacked_func(qkv, causal=True), True),
    ("cross_entropy fwd", lambda: F.cross_entropy(logits, tgt), lambda: ferrite.cross_entropy(logits, tgt), True),
]
print(f"{'op':24s} {'torch us':>9s} {'ferrite us':>11s}  native calls (us each)")
for name, t, fe, nat in cases:
    with torch.no_grad():
        tt, ff = per_call(t), per_call(fe)
        nc = native_cost(fe) if nat else ""
    print(f"{name + ' (no_grad)':24s} {tt:9.1f} {ff:11.1f}  {nc}")
    fb = lambda: fe().float().sum().backward()  # noqa: E731
    tt, ff = per_call(lambda: t().float().sum().backward(), 150), per_call(fb, 150)
    print(f"{name[:-4] + ' fwd+bwd':24s} {tt:9.1f} {ff:11.1f}  {native_cost(fb) if nat else ''}")
ref = per_call(lambda: x.float().sum().backward(), 150)
print(f"{'(x.float().sum().backward() alone)':24s} {ref:9.1f}")
