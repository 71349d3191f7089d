"""int8-weight matmul (w8a16) against torch's float64 product of the dequantised weight, and the
quantiser against its definition."""

import pytest
import torch

import ferrite


def quantised(n, k, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(n, k, generator=g) * 2 - 1) * 0.1
    w[1] = 0.0  # a row of zeros: scale 1, codes 0
    q, s = ferrite.quantize_int8(w.to(device))
    return w, q, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 33, 64), (5, 40, 40), (17, 70, 528)])
def test_w8a16_matches_dequantised_product(dtype, m, n, k):
    _, q, s = quantised(n, k, 1)
    x = (torch.rand(2, m, k, generator=torch.Generator().manual_seed(2)) * 2 - 1).to(dtype)
    bias = torch.randn(n).to(dtype)
    y = ferrite.w8a16(x, q, s, bias)
    assert y.dtype == dtype and y.shape == (2, m, n)
    ref = x.double() @ (q.double() * s.double()[:, None]).T + bias.double()
    assert torch.allclose(y.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    # Every variant the CPU has gives the same answer.
    y2 = ferrite.w8a16(x, q, s, bias, variant="naive")
    assert torch.allclose(y.double(), y2.double(), rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_quantize_int8_matches_its_definition():
    w, q, s = quantised(9, 31, 3)
    amax = w.abs().amax(dim=1)
    want_s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    assert torch.equal(s, want_s) and s[1] == 1.0
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and torch.all(q[1] == 0)
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] * 0.5 + 1e-7).all()
    # Half away from zero: 0.5 → 1, −0.5 → −1 (torch.round would give 0).
    below_half = torch.nextafter(torch.tensor(0.5), torch.tensor(0.0)).item()
    q2, s2 = ferrite.quantize_int8(torch.tensor([[127.0, 0.5, -0.5, 63.5, below_half]]))
    assert s2.item() == 1.0 and q2.tolist() == [[127, 1, -1, 64, 0]]


def test_w8a16_refuses_bad_input():
    _, q, s = quantised(8, 32, 4)
    x = torch.rand(3, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="`x`"):
        ferrite.w8a16(x.float(), q, s)
    with pytest.raises(ValueError, match="`w`"):
        ferrite.w8a16(x, q.float(), s)
    with pytest.raises(ValueError, match="`w`"):
        ferrite.w8a16(x, q[:, :16], s)
    with pytest.raises(ValueError, match="`scale`"):
        ferrite.w8a16(x, q, s[:4])
    with pytest.raises(ValueError, match="`bias`"):
        ferrite.w8a16(x, q, s, torch.zeros(8))
    with pytest.raises(ValueError, match="finite"):
        ferrite.quantize_int8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(Exception, match="scale"):
        ferrite.w8a16(x, q, torch.zeros(8))  # a zero scale is refused on the CPU


def test_opcheck():
    _, q, s = quantised(24, 48, 7)
    x = torch.rand(2, 3, 48).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.ferrite.w8a16.default, (x, q, s, None, None))
    torch.library.opcheck(torch.ops.ferrite.w8a16.default, (x[0], q, s, torch.randn(24).to(torch.bfloat16), "parallel"))


def test_w8a16_under_torch_compile():
    _, q, s = quantised(24, 48, 5)
    x = torch.rand(4, 48).to(torch.bfloat16)
    f = torch.compile(lambda x: ferrite.w8a16(x, q, s) * 2, fullgraph=True)
    assert torch.allclose(f(x).float(), 2 * ferrite.w8a16(x, q, s).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", [None, "naive"])
@pytest.mark.parametrize("m", [1, 9, 40])
def test_w8a16_cuda_matches_dequantised_product(variant, m):
    n, k = 300, 1024
    _, q, s = quantised(n, k, 6, "cuda")
    x = (torch.rand(m, k, device="cuda") * 2 - 1).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    y = ferrite.w8a16(x, q, s, bias, variant=variant)
    ref = x.double() @ (q.double() * s.double()[:, None]).T + bias.double()
    assert torch.allclose(y.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
