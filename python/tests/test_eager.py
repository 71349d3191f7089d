"""The eager fast path (ferrite/_eager.py): in plain eager mode ops skip the dispatcher but give
the dispatcher's results and gradients bit for bit; under anything that could tell the difference
the dispatcher runs."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

import ferrite
from ferrite._eager import eager


class _Refuse:
    """Stands in for an op's dispatcher callable: any call fails the test."""

    def __init__(self, name):
        self.name = name
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise AssertionError(f"the dispatcher ran {self.name}")


@pytest.fixture
def no_dispatch():
    ops = [eager.rms_norm, eager.rms_norm_backward, eager.softmax, eager.softmax_backward]
    real = [o.op for o in ops]
    for o in ops:
        o.op = _Refuse(o.op)
    yield
    for o, r in zip(ops, real):
        o.op = r


def _rms_inputs():
    torch.manual_seed(3)
    x = torch.randn(6, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    return x, w


def test_fast_path_equals_dispatcher_bitwise():
    x, w = _rms_inputs()
    y_ref, rstd_ref = torch.ops.ferrite.rms_norm(x, [40], w, 1e-5)
    g = torch.randn_like(y_ref)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), g)
    y, rstd = eager.rms_norm(x, [40], w, 1e-5)
    assert "FerriteEager" in type(y.grad_fn).__name__
    dx, dw = torch.autograd.grad(y, (x, w), g)
    for a, b in [(y, y_ref), (rstd, rstd_ref), (dx, dx_ref), (dw, dw_ref)]:
        assert torch.equal(a, b)


def test_plain_eager_never_dispatches(no_dispatch):
    x, w = _rms_inputs()
    y = ferrite.rms_norm(x, [40], w)
    y.sum().backward()  # the backward op takes the fast path too
    assert x.grad is not None and w.grad is not None
    with torch.no_grad():
        z = ferrite.softmax(x)
    assert z.grad_fn is None
    s = ferrite.softmax(x)
    s.square().sum().backward()


def test_dispatcher_under_modes_kwargs_and_double_backward():
    x, w = _rms_inputs()
    op = eager.rms_norm
    real, op.op = op.op, _Refuse("rms_norm")
    try:
        with pytest.raises(AssertionError, match="dispatcher ran"):
            with TorchFunctionMode():
                op(x, [40], w, 1e-5)
        with pytest.raises(AssertionError, match="dispatcher ran"):
            op(x, [40], w, eps=1e-5)  # keyword arguments
        with pytest.raises(AssertionError, match="dispatcher ran"):
            op(x, [40], w)  # an omitted argument
    finally:
        op.op = real
    # create_graph: the backward op has no autograd of its own, so it goes through the
    # dispatcher, which raises its usual error rather than returning an untracked gradient.
    y = ferrite.rms_norm(x, [40], w)
    (dx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert dx.requires_grad  # tracked by the dispatcher (a direct call would return a plain tensor)


def test_mutating_op_keeps_the_dispatcher():
    assert eager.append_kv.fn is None
