"""linear's backward at GPT-2's classifier (8192×50257×768 bf16) with and without the padded-gradient
copy (ferrite._ops._aligned_rows): time and error against an fp32 reference."""
import torch, time, ferrite
torch.manual_seed(0)
x = torch.randn(8192, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(50257, 768, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
g = torch.randn(8192, 50257, device="cuda", dtype=torch.bfloat16)
def run(pad):
    from ferrite import _ops
    _ops._PAD_MIN_ELEMS = 1 << 22 if pad else 1 << 62
    y = ferrite.linear(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        y = ferrite.linear(x, w)
        t0 = time.perf_counter(); dx, dw = torch.autograd.grad(y, (x, w), g); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return sorted(ts)[5] * 1e3, dx, dw
a = run(False); b = run(True)
rx = (g.float() @ w.float()); rw = g.float().t() @ x.float()
err = lambda u, r: ((u.float() - r).norm() / r.norm()).item()
print(f"linear backward 8192x50257x768 bf16: unpadded {a[0]:.2f} ms (dx err {err(a[1], rx):.2e}, dw {err(a[2], rw):.2e}); padded dY {b[0]:.2f} ms (dx err {err(b[1], rx):.2e}, dw {err(b[2], rw):.2e})")
