"""linear's forward and backward at GPT-2's classifier (8192×50257×768 bf16) with and without the
padded rows (ferrite._ops._padded_width for the output, _aligned_rows for the gradient): time and
error against an fp32 reference."""
import torch, time, ferrite
torch.manual_seed(0)
x = torch.randn(8192, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(50257, 768, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
g = torch.randn(8192, 50257, device="cuda", dtype=torch.bfloat16)
def run(pad):
    from ferrite import _ops_linear
    _ops_linear._PAD_MIN_ELEMS = 1 << 22 if pad else 1 << 62
    y = ferrite.linear(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    torch.cuda.synchronize()
    fs = []
    with torch.no_grad():
        for _ in range(10):
            t0 = time.perf_counter(); yy = ferrite.linear(x, w); torch.cuda.synchronize(); fs.append(time.perf_counter() - t0)
    ts = []
    for _ in range(10):
        y = ferrite.linear(x, w)
        t0 = time.perf_counter(); dx, dw = torch.autograd.grad(y, (x, w), g); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return sorted(ts)[5] * 1e3, dx, dw, sorted(fs)[5] * 1e3, yy
a = run(False); b = run(True)
rx = (g.float() @ w.float()); rw = g.float().t() @ x.float()
err = lambda u, r: ((u.float() - r).norm() / r.norm()).item()
ry = x.float() @ w.float().t()
print(f"linear forward 8192x50257x768 bf16: unpadded {a[3]:.2f} ms (err {err(a[4], ry):.2e}); padded {b[3]:.2f} ms (err {err(b[4], ry):.2e})")
print(f"linear backward 8192x50257x768 bf16: unpadded {a[0]:.2f} ms (dx err {err(a[1], rx):.2e}, dw {err(a[2], rw):.2e}); padded dY {b[0]:.2f} ms (dx err {err(b[1], rx):.2e}, dw {err(b[2], rw):.2e})")
