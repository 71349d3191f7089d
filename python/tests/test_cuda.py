"""CUDA: parity in every dtype, torch's stream, CUDA graphs, torch.compile reduce-overhead.
Skipped without a GPU (they run on the H100)."""

import pytest
import torch
import torch.nn.functional as F

import ferrite
from conftest import requires_cuda
from helpers import close, grads_vs_torch

pytestmark = requires_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def r(*shape, dtype=torch.float32, grad=True, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=dtype) * scale).requires_grad_(grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "sa,sb",
    [((64, 96), (96, 80)), ((3, 33, 65), (65, 17)), ((4, 40, 72), (4, 72, 24)), ((40, 72), (3, 72, 24)), ((1, 1), (1, 1))],
)
def test_matmul(dtype, sa, sb):
    k = sa[-1]
    grads_vs_torch(ferrite.matmul, torch.matmul, [r(*sa, dtype=dtype, scale=k**-0.5), r(*sb, dtype=dtype)], scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_transposed_and_strided(dtype):
    a = torch.randn(96, 64, device="cuda", dtype=dtype).t() * 0.1  # transposed view: no copy
    b = torch.randn(96, 200, device="cuda", dtype=dtype)[:, ::2]  # no unit stride: copied
    close(ferrite.matmul(a, b), (a.double() @ b.double()).to(dtype), scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear(dtype, bias):
    x = r(4, 50, 256, dtype=dtype, scale=1 / 16)
    w = r(384, 256, dtype=dtype)
    b = r(384, dtype=dtype) if bias else None
    grads_vs_torch(ferrite.linear, F.linear, [x, w, b], scale=2)


def test_linear_tf32():
    x, w = r(128, 512, grad=False, scale=1 / 22), r(256, 512, grad=False)
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # ferrite then runs f32 as tf32 too
        close(ferrite.linear(x, w), F.linear(x.double(), w.double()).float(), dtype=torch.bfloat16)
    finally:
        torch.set_float32_matmul_precision(prev)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [64, 1000, 4096])
def test_rms_norm(dtype, cols):
    f = lambda x, w: ferrite.rms_norm(x, [cols], w, 1e-6)  # noqa: E731
    t = lambda x, w: F.rms_norm(x, [cols], w, 1e-6)  # noqa: E731
    grads_vs_torch(f, t, [r(3, 37, cols, dtype=dtype), r(cols, dtype=dtype)], scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [64, 1000, 4096])
def test_layer_norm(dtype, cols):
    f = lambda x, w, b: ferrite.layer_norm(x, [cols], w, b)  # noqa: E731
    t = lambda x, w, b: F.layer_norm(x, [cols], w, b)  # noqa: E731
    grads_vs_torch(f, t, [r(2, 45, cols, dtype=dtype), r(cols, dtype=dtype), r(cols, dtype=dtype)], scale=2)


def test_runs_on_torchs_current_stream():
    """Work is queued on torch's current stream: consuming the result on that stream needs no
    synchronisation, and a side stream works like any torch op."""
    x = torch.randn(2048, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda") / 32
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = ferrite.linear(x, w)
        z = ferrite.rms_norm(y, [1024])
        ref = F.rms_norm(F.linear(x, w), [1024])
        diff = (z - ref).abs().max()  # same stream: ordered after ferrite's kernels
    torch.cuda.current_stream().wait_stream(s)
    assert diff.item() < 1e-3


def test_cuda_graph_capture_and_replay():
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16) / 22
    b = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    nw = torch.randn(768, device="cuda", dtype=torch.bfloat16)

    def f(x):
        return ferrite.rms_norm(ferrite.linear(x, w, b), [768], nw)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (kernels compiled and loaded) outside the capture
        for _ in range(2):
            f(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    close(out, F.rms_norm(F.linear(x, w, b), [768], nw), scale=2)


class Block(torch.nn.Module):
    def __init__(self, d=512):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)
        self.rms = torch.nn.RMSNorm(d)

    def forward(self, x):
        return self.rms(x + self.down(F.gelu(self.up(self.ln(x)))))


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compile_fullgraph(mode):
    torch._dynamo.reset()
    m = Block().cuda().to(torch.bfloat16)
    x = torch.randn(4, 64, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = m(x)
        ferrite.optimize(m)
        eager = m(x)
        cm = torch.compile(m, fullgraph=True, mode=mode)
        for _ in range(3):  # reduce-overhead records the graph after warm-up runs
            out = cm(x)
    close(eager, ref, scale=2)
    close(out, eager, scale=2)


def test_compile_training_step():
    torch._dynamo.reset()
    m = Block().cuda()
    m2 = Block().cuda()
    m2.load_state_dict(m.state_dict())
    ferrite.optimize(m2)
    cm = torch.compile(m2, fullgraph=True)
    x = torch.randn(8, 32, 512, device="cuda")
    m(x).square().mean().backward()
    cm(x).square().mean().backward()
    for p, p2 in zip(m.parameters(), m2.parameters()):
        close(p2.grad, p.grad, dtype=torch.float16)


def test_opcheck_cuda():
    ops = torch.ops.ferrite
    a, b = r(33, 65, dtype=torch.bfloat16), r(65, 17, dtype=torch.bfloat16)
    torch.library.opcheck(ops.matmul.default, (a, b))
    x, w = r(8, 256, dtype=torch.bfloat16), r(256, dtype=torch.bfloat16)
    torch.library.opcheck(ops.rms_norm.default, (x, [256], w, 1e-6))
    torch.library.opcheck(ops.layer_norm.default, (x, [256], w, w.detach().clone().requires_grad_(), 1e-5))
    torch.library.opcheck(ops.linear.default, (x, r(64, 256, dtype=torch.bfloat16), None))


@requires_cuda
def test_unaligned_linear_gradient_is_padded_for_the_backward_gemms():
    from ferrite import _ops

    g = torch.randn(1024, 4097, device="cuda", dtype=torch.bfloat16)
    p = _ops._aligned_rows(g, "none")
    assert p.stride(0) % 8 == 0 and p.stride(0) >= 4097 and torch.equal(p, g)
    assert _ops._aligned_rows(g[:, :4096], "none").is_contiguous()  # aligned rows: no copy
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(4097, 256, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_()
    dx, dw = torch.autograd.grad(ferrite.linear(x, w), (x, w), g)
    rx, rw = g.float() @ w.float(), g.float().t() @ x.float()
    assert ((dx.float() - rx).norm() / rx.norm()).item() < 1e-2
    assert ((dw.float() - rw).norm() / rw.norm()).item() < 1e-2


@requires_cuda
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_unaligned_linear_output_runs_on_padded_rows_with_the_same_result(activation):
    from ferrite import _ops

    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(4097, 256, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_()
    b = torch.randn(4097, device="cuda", dtype=torch.bfloat16).requires_grad_()
    assert _ops._padded_width(x, 1024, 4097) == 4104
    y = ferrite.linear(x, w, b, activation=activation)
    assert y.is_contiguous() and y.shape == (1024, 4097)
    z = x.float() @ w.float().t() + b.float()
    ref = z if activation is None else torch.nn.functional.gelu(z, approximate="tanh")
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    g = torch.randn_like(y)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), g)
    zz = z.detach().requires_grad_()
    out = zz if activation is None else torch.nn.functional.gelu(zz, approximate="tanh")
    (gz,) = torch.autograd.grad(out, zz, g.float())
    for got, want in ((dx, gz @ w.float()), (dw, gz.t() @ x.float()), (db, gz.sum(0))):
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@requires_cuda
def test_classifier_logits_stay_in_padded_rows_through_cross_entropy():
    """linear_rows on a 4097-wide classifier: the logits are the padded rows' view (no copy out),
    cross-entropy writes dlogits with the same rows, the backward GEMMs take them as they are —
    same loss and gradients as torch; also compiled (the fake output has the padded strides)."""
    import torch.nn.functional as F

    x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(4097, 256, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_()
    t = torch.randint(0, 4097, (1024,), device="cuda")
    torch.library.opcheck(torch.ops.ferrite.linear_rows.default, (x, w, None))
    y = ferrite.linear_rows(x, w)
    assert y.shape == (2, 512, 4097) and y.stride() == (512 * 4104, 4104, 1)
    ref = x.float() @ w.float().t()
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    lr = F.cross_entropy((xr @ wr.t()).reshape(-1, 4097), t)
    lr.backward()

    def step(fn):
        x.grad = w.grad = None
        loss = fn(x, w)
        loss.backward()
        assert abs(loss.item() - lr.item()) < 2e-2 * abs(lr.item())
        for got, want in ((x.grad, xr.grad), (w.grad, wr.grad)):
            assert ((got.float() - want).norm() / want.norm()).item() < 2e-2

    from helpers import aligned_rows_seen

    with aligned_rows_seen() as seen:
        step(lambda x, w: ferrite.cross_entropy(ferrite.linear_rows(x, w).reshape(-1, 4097), t))
        torch._dynamo.reset()
        step(torch.compile(lambda x, w: ferrite.cross_entropy(ferrite.linear_rows(x, w).reshape(-1, 4097), t), fullgraph=True))
    # eager and compiled alike: dlogits reach the backward GEMMs in the padded rows, uncopied
    assert seen == [(4104, True), (4104, True)], seen
