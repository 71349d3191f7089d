"""The FP8 scaled GEMM on the CPU against torch's float64 product of the dequantised inputs."""

import pytest
import torch

import ferrite


def fp8(shape, dtype, seed, lo=-6.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) * 2 * -lo + lo).to(dtype)


@pytest.mark.parametrize("a_dt,b_dt", [(torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e4m3fn, torch.float8_e5m2)])
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_matches_dequantised_product(a_dt, b_dt, rowwise, out_dtype):
    m, n, k = 37, 45, 70
    a, b = fp8((m, k), a_dt, 1), fp8((n, k), b_dt, 2)
    sa = torch.rand(m if rowwise else 1) + 0.1
    sb = torch.rand(n if rowwise else 1) + 0.1
    bias = torch.randn(n).to(out_dtype)
    d = ferrite.scaled_mm(a, b, sa, sb, bias, out_dtype=out_dtype)
    assert d.dtype == out_dtype and d.shape == (m, n)
    ref = (a.double() * sa.double().reshape(-1, 1)) @ (b.double() * sb.double().reshape(-1, 1)).T
    ref = ref + bias.double()
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    assert torch.allclose(d.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_scaled_mm_takes_torch_scale_shapes_and_refuses_bad_input():
    a, b = fp8((4, 32), torch.float8_e4m3fn, 3), fp8((8, 32), torch.float8_e4m3fn, 4)
    one = torch.ones(1)
    # torch._scaled_mm's row-wise shapes: [m, 1] and [1, n].
    d = ferrite.scaled_mm(a, b, torch.ones(4, 1), torch.ones(1, 8), out_dtype=torch.float32)
    assert torch.allclose(d, a.float() @ b.float().T)
    with pytest.raises(ValueError, match="`a`"):
        ferrite.scaled_mm(a.float(), b, one, one)
    with pytest.raises(ValueError, match="`b`.*list"):
        ferrite.scaled_mm(a, [1, 2], one, one)
    with pytest.raises(ValueError, match="out_dtype"):
        ferrite.scaled_mm(a, b, one, one, out_dtype=torch.int32)
    with pytest.raises(Exception, match="scale_b"):
        ferrite.scaled_mm(a, b, one, torch.ones(3))
    with pytest.raises(Exception, match="scale_a"):
        ferrite.scaled_mm(a, b, torch.zeros(1), one)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", [None, "wgmma_fast", "naive"])
@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_mm_cuda_matches_dequantised_product(variant, rowwise):
    m, n, k = 200, 272, 512
    a = fp8((m, k), torch.float8_e4m3fn, 5).cuda()
    b = fp8((n, k), torch.float8_e4m3fn, 6).cuda()
    sa = (torch.rand(m if rowwise else 1) + 0.1).cuda()
    sb = (torch.rand(n if rowwise else 1) + 0.1).cuda()
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    d = ferrite.scaled_mm(a, b, sa, sb, bias, out_dtype=torch.bfloat16, variant=variant)
    ref = (a.double() * sa.double().reshape(-1, 1)) @ (b.double() * sb.double().reshape(-1, 1)).T + bias.double()
    assert not d.isnan().any() and out.isnan().all()
    assert ((d.double() - ref).norm() / ref.norm()).item() < 1e-2


def _torch_quantize(x, dtype, rowwise):
    """The definition in torch: amax per row / tensor, s = FMAX / amax (1 for 0), the f32 product
    clamped to the finite range (torch's cast does not saturate) and rounded to nearest-even."""
    fmax = torch.finfo(dtype).max
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True) if rowwise else xf.abs().amax().reshape(1)
    s = torch.where(amax == 0, torch.ones_like(amax), torch.tensor(fmax, dtype=torch.float32) / amax)
    q = (xf * s).clamp(-fmax, fmax).to(dtype)
    return q, 1.0 / s, amax


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rowwise", [False, True])
def test_quantize_fp8_matches_torch_bit_for_bit(dtype, in_dtype, rowwise):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(37, 129, generator=g) * torch.logspace(-3, 3, 129)).to(in_dtype)
    x[5] = 0  # an all-zero row: s = 1
    q, inv, amax = ferrite.quantize_fp8(x, dtype, rowwise=rowwise)
    rq, rinv, ramax = _torch_quantize(x, dtype, rowwise)
    assert q.dtype == dtype and q.shape == x.shape
    assert inv.shape == ((37, 1) if rowwise else (1,)) and amax.shape == inv.shape
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(amax, ramax.reshape(amax.shape))
    assert torch.equal(inv, rinv.reshape(inv.shape))


def test_quantize_then_scaled_mm_approximates_the_product():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 256, generator=g), torch.randn(96, 256, generator=g)
    qx, sx, _ = ferrite.quantize_fp8(x, rowwise=True)
    qw, sw, _ = ferrite.quantize_fp8(w, rowwise=True)
    d = ferrite.scaled_mm(qx, qw, sx, sw.reshape(1, -1), out_dtype=torch.float32)
    ref = x.double() @ w.double().T
    assert (d.double() - ref).abs().max() < 0.05 * ref.abs().max()


def test_quantize_fp8_given_scale_non_finite_and_bad_input():
    x = torch.tensor([[1.0, float("inf")], [3.0, 1e6]])
    q, inv, amax = ferrite.quantize_fp8(x, rowwise=True)
    assert torch.isnan(inv[0]).all() and torch.isnan(q[0].float()).all()  # inf → NaN codes, visible
    q, inv, amax = ferrite.quantize_fp8(x, rowwise=True, scale=torch.ones(2))
    assert q[1, 1].float() == 448.0 and amax[1, 0] == 1e6  # saturates under a given scale
    assert torch.equal(inv, torch.ones(2, 1))
    with pytest.raises(ValueError, match="`x`"):
        ferrite.quantize_fp8(torch.ones(4))
    with pytest.raises(ValueError, match="`dtype`"):
        ferrite.quantize_fp8(torch.ones(2, 2), torch.bfloat16)
    with pytest.raises(ValueError, match="`scale`"):
        ferrite.quantize_fp8(torch.ones(3, 2), rowwise=True, scale=torch.ones(2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rowwise", [False, True])
def test_quantize_fp8_cuda_matches_cpu(dtype, in_dtype, rowwise):
    g = torch.Generator().manual_seed(11)
    for rows, cols in [(1, 1), (3, 5), (300, 1001), (64, 4096), (0, 7), (5, 0)]:
        x = (torch.randn(rows, cols, generator=g) * torch.logspace(-2, 2, cols)).to(in_dtype)
        if rows > 2:
            x[1] = 0
        n = rows if rowwise else 1
        for scale in [None, torch.rand(n, generator=g) + 0.5]:
            cpu = ferrite.quantize_fp8(x, dtype, rowwise, scale)
            gpu = ferrite.quantize_fp8(x.cuda(), dtype, rowwise, None if scale is None else scale.cuda())
            what = f"{rows}x{cols} given={scale is not None}"
            assert torch.equal(cpu[0].view(torch.uint8), gpu[0].cpu().view(torch.uint8)), what
            assert torch.equal(cpu[1], gpu[1].cpu()) and torch.equal(cpu[2], gpu[2].cpu()), what


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_fp8_forward_and_backward_track_the_high_precision_layer(recipe, dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 13, 64, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(48, 64, generator=g) * 0.1).to(dtype).requires_grad_()
    b = torch.randn(48, generator=g).to(dtype).requires_grad_()
    y = ferrite.linear(x, w, b, fp8=recipe)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(dy)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    yr = torch.nn.functional.linear(xr, wr, br)
    yr.backward(dy.double())
    assert y.shape == (3, 13, 48) and y.dtype == dtype
    # Rounding to e4m3 (3 mantissa bits: ≤ 3.1% per element, ≈ 1.8% RMS) of both operands gives
    # ≈ 2.5% relative error in y; the gradients also round dy to e5m2 (2 bits: ≈ 3.6% RMS), ≈ 6%
    # measured. A wrong scale or transpose is off by 100% or more.
    assert _rel(y, yr) < 0.035
    assert _rel(x.grad, xr.grad) < 0.09
    assert _rel(w.grad, wr.grad) < 0.09
    assert _rel(b.grad, br.grad) < 1e-2


def test_linear_fp8_bad_input():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="`fp8`"):
        ferrite.linear(x, w, fp8="blockwise")
    with pytest.raises(ValueError, match="`activation`"):
        ferrite.linear(x, w, activation="relu", fp8="rowwise")
    with pytest.raises(ValueError, match="`weight`"):
        ferrite.linear(x, torch.randn(6, 7), fp8="rowwise")


def test_linear_fp8_under_torch_compile():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(16, 32, generator=g, requires_grad=True)
    w = torch.randn(24, 32, generator=g, requires_grad=True)
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: ferrite.linear(x, w, fp8="rowwise").sum(), fullgraph=True, backend="aot_eager")
    f(x, w).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ferrite.linear(x, w, fp8="rowwise").sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)
