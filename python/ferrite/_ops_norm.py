"""``ferrite::rms_norm``, ``layer_norm``, their backward ops, and ``add_norm`` (the residual add
fused with either norm)."""

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _native
from ._eager import eager
from ._ops_common import _check_tensors, _describe, _empty, _fail, _native_call, _where


# ----------------------------------------------------------------------------------------------
# checks (shared by the real and the fake implementations, so torch.compile fails early too)


def _norm_shape(normalized_shape: Union[int, Sequence[int]]) -> List[int]:
    if isinstance(normalized_shape, int):
        return [normalized_shape]
    return [int(d) for d in normalized_shape]


def _norm_check(op, x, normalized_shape, weight, bias=None) -> Tuple[List[int], int]:
    """Returns (leading shape, cols): x is normalised over its last len(normalized_shape) dims."""
    _check_tensors(op, [("input", x), ("weight", weight), ("bias", bias)])
    ns = list(normalized_shape)
    if len(ns) == 0 or x.dim() < len(ns) or list(x.shape[x.dim() - len(ns):]) != ns:
        _fail(op, "normalized_shape", f"the trailing dims of input {list(x.shape)}", str(ns))
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and list(t.shape) != ns:
            _fail(op, name, f"shape {ns} (normalized_shape)", _describe(t))
    cols = 1
    for d in ns:
        cols *= d
    return list(x.shape[: x.dim() - len(ns)]), cols


# ----------------------------------------------------------------------------------------------
# norms


def _norm_forward(kind, x, ns, weight, bias, eps):
    return _norm_run(f"ferrite.{kind}", kind, x, ns, weight, bias, eps)[:3]


def _norm_run(op, kind, x, ns, weight, bias, eps, residual=None):
    """(y, mean, rstd, h): the norm of x, or with `residual` of h = x + residual (written too)."""
    lead, cols = _norm_check(op, x, ns, weight, bias)
    xc = x.contiguous()  # the norm kernels need contiguous rows: copy if not
    y = x.new_empty(x.shape)
    h = None if residual is None else x.new_empty(x.shape)
    mean = x.new_empty(lead, dtype=torch.float32) if kind == "layer_norm" else None
    rstd = x.new_empty(lead, dtype=torch.float32)
    if x.numel() > 0:
        shape2 = lead + [cols]
        dev, stream = _where(x)
        _native_call(
            _native.norm_forward,
            kind,
            xc.view(shape2),
            y.view(shape2),
            residual=None if residual is None else residual.contiguous().view(shape2),
            weight=None if weight is None else weight.contiguous().view(cols),
            bias=None if bias is None else bias.contiguous().view(cols),
            h=None if h is None else h.view(shape2),
            mean=mean,
            rstd=rstd,
            eps=float(eps),
            device=dev,
            stream=stream,
        )
    return y, mean, rstd, h


def _norm_backward(kind, grad, x, ns, weight, mean, rstd, need_w, need_b):
    op = f"ferrite.{kind}_backward"
    lead, cols = _norm_check(op, x, ns, weight)
    _check_tensors(op, [("input", x), ("grad", grad)])
    dx = x.new_empty(x.shape)
    dw = x.new_empty(ns) if need_w else None
    db = x.new_empty(ns) if need_b else None
    if x.numel() > 0:
        shape2 = lead + [cols]
        dev, stream = _where(x)
        _native_call(
            _native.norm_backward,
            kind,
            grad.contiguous().view(shape2),
            x.contiguous().view(shape2),
            rstd.contiguous(),
            dx.view(shape2),
            weight=None if weight is None else weight.contiguous().view(cols),
            mean=None if mean is None else mean.contiguous(),
            dweight=None if dw is None else dw.view(cols),
            dbias=None if db is None else db.view(cols),
            device=dev,
            stream=stream,
        )
    else:
        if dw is not None:
            dw.zero_()
        if db is not None:
            db.zero_()
    return dx, (dw if need_w else _empty(x)), (db if need_b else _empty(x))


def _norm_fake(kind, x, ns, weight, bias):
    lead, _ = _norm_check(f"ferrite.{kind}", x, ns, weight, bias)
    y = x.new_empty(x.shape)
    rstd = x.new_empty(lead, dtype=torch.float32)
    mean = x.new_empty(lead, dtype=torch.float32) if kind == "layer_norm" else None
    return y, mean, rstd


@torch.library.custom_op("ferrite::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, normalized_shape: List[int], weight: Optional[Tensor], eps: float) -> Tuple[Tensor, Tensor]:
    y, _, rstd = _norm_forward("rms_norm", x, normalized_shape, weight, None, eps)
    return y, rstd


@_rms_norm.register_fake
def _(x, normalized_shape, weight, eps):
    y, _, rstd = _norm_fake("rms_norm", x, normalized_shape, weight, None)
    return y, rstd


@torch.library.custom_op("ferrite::rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    grad: Tensor, x: Tensor, normalized_shape: List[int], weight: Optional[Tensor], rstd: Tensor, need_w: bool
) -> Tuple[Tensor, Tensor]:
    dx, dw, _ = _norm_backward("rms_norm", grad, x, normalized_shape, weight, None, rstd, need_w, False)
    return dx, dw


@_rms_norm_backward.register_fake
def _(grad, x, normalized_shape, weight, rstd, need_w):
    _norm_check("ferrite.rms_norm_backward", x, normalized_shape, weight)
    return x.new_empty(x.shape), (x.new_empty(normalized_shape) if need_w else _empty(x))


def _rms_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # outputs without a gradient: None, not filled zeros
    x, ns, weight, eps = inputs
    ctx.ns = ns
    ctx.save_for_backward(x, weight, output[1])


def _rms_bwd(ctx, grad, _grad_rstd):
    if grad is None:  # only an output without a gradient was used
        return (None,) * 4
    x, weight, rstd = ctx.saved_tensors
    need_w = weight is not None and ctx.needs_input_grad[2]
    dx, dw = eager.rms_norm_backward(grad, x, ctx.ns, weight, rstd, need_w)
    return dx, None, (dw if need_w else None), None


_rms_norm.register_autograd(_rms_bwd, setup_context=_rms_setup)


@torch.library.custom_op("ferrite::layer_norm", mutates_args=())
def _layer_norm(
    x: Tensor, normalized_shape: List[int], weight: Optional[Tensor], bias: Optional[Tensor], eps: float
) -> Tuple[Tensor, Tensor, Tensor]:
    return _norm_forward("layer_norm", x, normalized_shape, weight, bias, eps)


@_layer_norm.register_fake
def _(x, normalized_shape, weight, bias, eps):
    return _norm_fake("layer_norm", x, normalized_shape, weight, bias)


@torch.library.custom_op("ferrite::layer_norm_backward", mutates_args=())
def _layer_norm_backward(
    grad: Tensor,
    x: Tensor,
    normalized_shape: List[int],
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    need_w: bool,
    need_b: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    return _norm_backward("layer_norm", grad, x, normalized_shape, weight, mean, rstd, need_w, need_b)


@_layer_norm_backward.register_fake
def _(grad, x, normalized_shape, weight, mean, rstd, need_w, need_b):
    _norm_check("ferrite.layer_norm_backward", x, normalized_shape, weight)
    return (
        x.new_empty(x.shape),
        x.new_empty(normalized_shape) if need_w else _empty(x),
        x.new_empty(normalized_shape) if need_b else _empty(x),
    )


def _ln_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # outputs without a gradient: None, not filled zeros
    x, ns, weight, bias, eps = inputs
    ctx.ns = ns
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, output[1], output[2])


def _ln_bwd(ctx, grad, _grad_mean, _grad_rstd):
    if grad is None:  # only an output without a gradient was used
        return (None,) * 5
    x, weight, mean, rstd = ctx.saved_tensors
    need_w = weight is not None and ctx.needs_input_grad[2]
    need_b = ctx.has_bias and ctx.needs_input_grad[3]
    dx, dw, db = eager.layer_norm_backward(grad, x, ctx.ns, weight, mean, rstd, need_w, need_b)
    return dx, None, (dw if need_w else None), (db if need_b else None), None


_layer_norm.register_autograd(_ln_bwd, setup_context=_ln_setup)


# ----------------------------------------------------------------------------------------------
# residual add + norm, fused: h = x + residual, y = norm(h) in one kernel (one read of each input,
# one write of y and h)


def _add_norm_check(op, x, residual):
    if not isinstance(residual, Tensor) or residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        _fail(op, "residual", f"a tensor like `input` ({_describe(x)})", _describe(residual))


@torch.library.custom_op("ferrite::add_norm", mutates_args=())
def _add_norm(
    kind: str,
    x: Tensor,
    residual: Tensor,
    normalized_shape: List[int],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    op = f"ferrite.add_{kind}"
    _add_norm_check(op, x, residual)
    y, mean, rstd, h = _norm_run(op, kind, x, normalized_shape, weight, bias, eps, residual)
    return y, h, (mean if mean is not None else _empty(x)), rstd


@_add_norm.register_fake
def _(kind, x, residual, normalized_shape, weight, bias, eps):
    _add_norm_check(f"ferrite.add_{kind}", x, residual)
    y, mean, rstd = _norm_fake(kind, x, normalized_shape, weight, bias)
    return y, x.new_empty(x.shape), (mean if mean is not None else _empty(x)), rstd


def _add_norm_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # outputs without a gradient: None, not filled zeros
    kind, x, residual, ns, weight, bias, eps = inputs
    ctx.kind, ctx.ns, ctx.has_bias = kind, ns, bias is not None
    ctx.save_for_backward(output[1], weight, output[2], output[3])


def _add_norm_bwd(ctx, grad_y, grad_h, _grad_mean, _grad_rstd):
    h, weight, mean, rstd = ctx.saved_tensors
    need_w = weight is not None and ctx.needs_input_grad[4]
    need_b = ctx.has_bias and ctx.needs_input_grad[5]
    if grad_y is None:  # only the new residual stream was used
        need_w = need_b = False
        dh, dw, db = grad_h, None, None
    elif ctx.kind == "rms_norm":
        dh, dw = eager.rms_norm_backward(grad_y, h, ctx.ns, weight, rstd, need_w)
        db = None
    else:
        dh, dw, db = eager.layer_norm_backward(grad_y, h, ctx.ns, weight, mean, rstd, need_w, need_b)
    # h = x + residual feeds both the norm and the caller (the new residual stream)
    if grad_y is not None and grad_h is not None:
        dh = dh + grad_h
    return (
        None,
        dh if ctx.needs_input_grad[1] else None,
        dh if ctx.needs_input_grad[2] else None,
        None,
        dw if need_w else None,
        db if need_b else None,
        None,
    )


_add_norm.register_autograd(_add_norm_bwd, setup_context=_add_norm_setup)
