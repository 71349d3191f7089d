import contextlib

import torch

# Tolerances for comparing ferrite against torch in each dtype (fp32 math in both; 16-bit
# outputs differ by rounding of intermediates).
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=2e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=6e-2),
}


def close(a, b, dtype=None, scale=1.0):
    tol = TOL[dtype or a.dtype]
    torch.testing.assert_close(
        a.float(), b.float(), atol=tol["atol"] * scale, rtol=tol["rtol"] * scale
    )


def leaf(t, requires_grad=True):
    return t.detach().clone().requires_grad_(requires_grad)


def grads_vs_torch(f_ferrite, f_torch, inputs, dtype=None, scale=1.0):
    """Runs both functions forward and backward (a fixed random cotangent); compares the outputs
    and the gradient of every input that requires one. The torch reference runs in float64 on a
    copy of the inputs."""
    ins_f = [leaf(t, t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs]
    ins_t = [leaf(t.double(), t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs]
    out_f = f_ferrite(*ins_f)
    out_t = f_torch(*ins_t)
    close(out_f, out_t.to(out_f.dtype), dtype=out_f.dtype, scale=scale)
    g = torch.randn_like(out_f)
    out_f.backward(g)
    out_t.backward(g.double())
    for i, (a, b) in enumerate(zip(ins_f, ins_t)):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert a.grad is not None, f"input {i}: no gradient"
            close(a.grad, b.grad.to(a.dtype), dtype=a.dtype, scale=scale)


@contextlib.contextmanager
def aligned_rows_seen():
    """Records, for each gradient linear's backward GEMMs receive, (its row stride, whether it was
    taken as it is — no copy into padded rows)."""
    from ferrite import _ops_linear

    seen = []
    orig = _ops_linear._aligned_rows

    def spy(g, act):
        r = orig(g, act)
        seen.append((g.stride(0), r.data_ptr() == g.data_ptr()))
        return r

    _ops_linear._aligned_rows = spy
    try:
        yield seen
    finally:
        _ops_linear._aligned_rows = orig
