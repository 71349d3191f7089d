"""ferrite vs torch on the CPU: forward and backward of every op (float32; the norms also in
float16/bfloat16), against torch's float64 autograd."""

import pytest
import torch
import torch.nn.functional as F

import ferrite
from helpers import close, grads_vs_torch


def r(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


@pytest.mark.parametrize(
    "sa,sb",
    [
        ((5, 7), (7, 3)),  # 2-D
        ((1, 1), (1, 1)),
        ((2, 5, 7), (7, 3)),  # [..., m, k] @ [k, n]: one GEMM over all rows
        ((2, 3, 5, 7), (7, 4)),
        ((4, 5, 7), (4, 7, 3)),  # batched
        ((2, 3, 5, 7), (2, 3, 7, 4)),  # batch dims flattened
        ((5, 7), (4, 7, 3)),  # 2-D a broadcast over b's batch
        ((33, 65), (65, 17)),
    ],
)
def test_matmul(sa, sb):
    grads_vs_torch(ferrite.matmul, torch.matmul, [r(*sa), r(*sb)])


@pytest.mark.parametrize("ta,tb", [(False, True), (True, False), (True, True)])
def test_matmul_transposed_views(ta, tb):
    """Transposed operands run as they are (stride 1 in either of the last two dims)."""
    a = torch.randn(7, 5).t() if ta else torch.randn(5, 7)
    b = torch.randn(3, 7).t() if tb else torch.randn(7, 3)
    grads_vs_torch(ferrite.matmul, torch.matmul, [a.requires_grad_(), b.requires_grad_()])


def test_matmul_only_one_grad():
    a, b = r(6, 4), r(4, 5, grad=False)
    y = ferrite.matmul(a, b)
    y.sum().backward()
    assert b.grad is None
    close(a.grad, torch.ones(6, 5) @ b.t())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("xshape", [(9,), (6, 9), (2, 3, 9), (2, 2, 2, 9)])
def test_linear(bias, xshape):
    w, b = r(5, 9), (r(5) if bias else None)
    grads_vs_torch(ferrite.linear, F.linear, [r(*xshape), w, b])


def test_linear_input_without_grad():
    x, w, b = r(4, 9, grad=False), r(5, 9), r(5)
    ferrite.linear(x, w, b).sum().backward()
    assert x.grad is None
    close(w.grad, torch.ones(4, 5).t() @ x)
    close(b.grad, torch.full((5,), 4.0))


NORM_SHAPES = [((4, 16), [16]), ((2, 3, 32), [32]), ((2, 3, 4, 5), [4, 5]), ((7,), [7]), ((3, 1), [1])]


@pytest.mark.parametrize("shape,ns", NORM_SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm(shape, ns, affine):
    w = r(*ns) if affine else None
    f = lambda x, w: ferrite.rms_norm(x, ns, w, 1e-6)  # noqa: E731
    t = lambda x, w: F.rms_norm(x, ns, w, 1e-6)  # noqa: E731
    grads_vs_torch(f, t, [r(*shape), w])


def test_rms_norm_default_eps_is_torchs():
    x, w = r(3, 8), r(8)
    close(ferrite.rms_norm(x, [8], w), F.rms_norm(x, [8], w))


@pytest.mark.parametrize("shape,ns", NORM_SHAPES)
@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, True), (False, False)])
def test_layer_norm(shape, ns, weight, bias):
    w = r(*ns) if weight else None
    b = r(*ns) if bias else None
    f = lambda x, w, b: ferrite.layer_norm(x, ns, w, b, 1e-5)  # noqa: E731
    t = lambda x, w, b: F.layer_norm(x, ns, w, b, 1e-5)  # noqa: E731
    grads_vs_torch(f, t, [r(*shape), w, b])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norms_16bit_cpu(dtype, kind):
    x, w, b = r(8, 64, dtype=dtype), r(64, dtype=dtype), r(64, dtype=dtype)
    if kind == "rms":
        f = lambda x, w, b: ferrite.rms_norm(x, [64], w, 1e-5)  # noqa: E731
        t = lambda x, w, b: F.rms_norm(x, [64], w, 1e-5)  # noqa: E731
        b = b.detach()
    else:
        f = lambda x, w, b: ferrite.layer_norm(x, [64], w, b)  # noqa: E731
        t = lambda x, w, b: F.layer_norm(x, [64], w, b)  # noqa: E731
    grads_vs_torch(f, t, [x, w, b], scale=2.0)


def test_non_contiguous_inputs_are_copied():
    """Layouts the kernels cannot read are copied (as torch does): results stay right and the
    inputs are untouched."""
    big = torch.randn(10, 14)
    a = big[::2, ::2]  # strides (28, 2): no unit stride
    b = torch.randn(7, 6)[:, ::2]
    before = big.clone()
    close(ferrite.matmul(a, b), a @ b)
    x = torch.randn(6, 32).t()  # [32, 6] transposed
    close(ferrite.rms_norm(x, [6]), F.rms_norm(x, [6]))
    close(ferrite.layer_norm(x, [6]), F.layer_norm(x, [6]))
    w = torch.randn(4, 12)[:, ::2]
    close(ferrite.linear(x, w), F.linear(x, w))
    assert torch.equal(big, before)


def test_empty_tensors():
    assert ferrite.matmul(torch.randn(0, 4), torch.randn(4, 3)).shape == (0, 3)
    assert torch.equal(ferrite.matmul(torch.randn(2, 0), torch.randn(0, 3)), torch.zeros(2, 3))
    assert torch.equal(ferrite.linear(torch.randn(2, 0), torch.randn(3, 0), torch.ones(3)), torch.ones(2, 3))
    assert ferrite.rms_norm(torch.randn(0, 8), [8]).shape == (0, 8)
    assert ferrite.layer_norm(torch.randn(2, 0, 8), [8]).shape == (2, 0, 8)


def test_cpu_operands_borrowed_or_copied():
    """CPU operands are used in place when 8-byte aligned and not overlapping another operand of
    the call, copied otherwise: the same tensor passed twice, views sharing storage, a 2-byte
    offset bf16 view and a strided view all give torch's results and leave the inputs as they
    were."""
    x = torch.randn(33, 33)
    before = x.clone()
    close(ferrite.matmul(x, x), x @ x)  # one buffer as both operands (the second is copied)
    close(ferrite.matmul(x, x.t()), x @ x.t())
    big = torch.randn(40, 33)
    close(ferrite.matmul(big[:20], big[7:]), big[:20] @ big[7:])  # overlapping views
    assert torch.equal(x, before)
    hb = torch.randn(9, 65, dtype=torch.bfloat16)
    odd = hb[:, 1:]  # data pointer 2 bytes past an 8-byte boundary: copied
    assert odd.data_ptr() % 8 != 0
    close(ferrite.rms_norm(odd, [64]), F.rms_norm(odd.float(), [64]).to(torch.bfloat16), scale=2.0)
    close(ferrite.softmax(odd, -1), torch.softmax(odd.float(), -1).to(torch.bfloat16), scale=2.0)
    # In place: AdamW writes params and moments straight into the borrowed tensors.
    p = torch.randn(37, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    g = torch.randn(37)
    p.grad, q.grad = g.clone(), g.clone()
    ferrite.optim.AdamW([p], lr=1e-2, weight_decay=0.1).step()
    torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1).step()
    close(p.detach(), q.detach())
