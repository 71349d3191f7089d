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
