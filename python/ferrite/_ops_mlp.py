"""``ferrite::mlp`` and ``mlp_backward``: the two-layer MLP on ferrite's linear."""

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _native
from ._eager import eager
from ._ops_common import _activation, _check_tensors, _describe, _empty, _fail, _native_call, _tf32, _where
from ._ops_linear import _linear_grads, _linear_run, _linear_shape, _rows2


# the two-layer MLP, y = act(x·W1ᵀ + b1)·W2ᵀ + b2, with its backward in the chain form: the
# second layer's dX GEMM applies act' of the first layer's pre-activation in its epilogue and
# writes the column sums that are db1 (ferrite's linear backward with `x_pre`, `db_pre`), so no
# pass over the hidden activations' gradient is left; then the first layer's two GEMMs.


def _mlp_shapes(op, x, w1, b1, w2, b2) -> Tuple[List[int], List[int]]:
    hidden = _linear_shape(op, x, w1, b1)
    _check_tensors(op, [("input", x), ("w2", w2), ("b2", b2)])
    if w2.dim() != 2 or w2.shape[1] != w1.shape[0]:
        _fail(op, "w2", f"a 2-D tensor [out_features, {w1.shape[0]}] (w1 is {list(w1.shape)})", _describe(w2))
    if b2 is not None and (b2.dim() != 1 or b2.shape[0] != w2.shape[0]):
        _fail(op, "b2", f"a 1-D tensor [{w2.shape[0]}] (out_features)", _describe(b2))
    return hidden, list(x.shape[:-1]) + [w2.shape[0]]


@torch.library.custom_op("ferrite::mlp", mutates_args=())
def _mlp(
    x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: str, save_preact: bool
) -> Tuple[Tensor, Tensor, Tensor]:
    _mlp_shapes("ferrite.mlp", x, w1, b1, w2, b2)
    act = _activation("ferrite.mlp", activation)
    h, z = _linear_run(x, w1, b1, act, save_preact)
    y, _ = _linear_run(h, w2, b2, "none", False)
    z = _empty(x) if z is None else z
    return y, h, z


@_mlp.register_fake
def _(x, w1, b1, w2, b2, activation, save_preact):
    hidden, out = _mlp_shapes("ferrite.mlp", x, w1, b1, w2, b2)
    _activation("ferrite.mlp", activation)
    return x.new_empty(out), x.new_empty(hidden), (x.new_empty(hidden) if save_preact else _empty(x))


def _mlp_grads(grad, x, w1, h, z, w2, act, need):
    """(dx, dw1, db1, dw2, db2) of the MLP; `need` says which (the rest: empty placeholders)."""
    nx, nw1, nb1, nw2, nb2 = need
    rows, k, hid, n = math.prod(x.shape[:-1]), x.shape[-1], w1.shape[0], w2.shape[0]
    out = [
        x.new_empty(x.shape) if nx else _empty(x),
        w1.new_empty(w1.shape) if nw1 else _empty(w1),
        w1.new_empty((hid,)) if nb1 else _empty(w1),
    ]
    lower = nx or nw1 or nb1
    if min(rows, k, hid, n) == 0:
        # an empty GEMM somewhere: the two layers' own backward (its edge cases included)
        dh = _linear_grads(grad, h, w2, None, "none", lower, nw2, nb2)
        if lower:
            out[:3] = _linear_grads(dh[0], x, w1, z, act, nx, nw1, nb1)
        return (*out, dh[1], dh[2])
    dw2 = w2.new_empty(w2.shape) if nw2 else None
    db2 = w2.new_empty((n,)) if nb2 else None
    dz = x.new_empty((rows, hid)) if lower else None
    dev, stream = _where(x)
    tf32 = _tf32(x)
    if lower or nw2 or nb2:
        _native_call(
            _native.linear_backward,
            grad.reshape(rows, n).contiguous(),
            _rows2(h.reshape(rows, hid)),
            _rows2(w2),
            dx=dz,
            dw=dw2,
            db=db2,
            tf32=tf32,
            device=dev,
            stream=stream,
            x_pre=z.reshape(rows, hid).contiguous() if lower else None,
            x_pre_activation=act,
            db_pre=out[2] if nb1 else None,
        )
    if nx or nw1:
        _native_call(
            _native.linear_backward,
            dz,
            _rows2(x.reshape(rows, k)),
            _rows2(w1),
            dx=out[0].view(rows, k) if nx else None,
            dw=out[1] if nw1 else None,
            tf32=tf32,
            device=dev,
            stream=stream,
        )
    return (*out, dw2 if nw2 else _empty(w2), db2 if nb2 else _empty(w2))


@torch.library.custom_op("ferrite::mlp_backward", mutates_args=())
def _mlp_backward(
    grad: Tensor,
    x: Tensor,
    w1: Tensor,
    h: Tensor,
    preact: Tensor,
    w2: Tensor,
    activation: str,
    need: List[bool],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    op = "ferrite.mlp_backward"
    _check_tensors(op, [("grad", grad), ("input", x), ("w1", w1), ("hidden", h), ("preact", preact), ("w2", w2)])
    act = _activation(op, activation)
    if len(need) != 5:
        _fail(op, "need", "5 flags (dx, dw1, db1, dw2, db2)", str(len(need)))
    if list(preact.shape) != list(h.shape):
        _fail(op, "preact", f"the forward's pre-activation {list(h.shape)}", _describe(preact))
    return _mlp_grads(grad, x, w1, h, preact, w2, act, need)


@_mlp_backward.register_fake
def _(grad, x, w1, h, preact, w2, activation, need):
    nx, nw1, nb1, nw2, nb2 = need
    return (
        x.new_empty(x.shape) if nx else _empty(x),
        w1.new_empty(w1.shape) if nw1 else _empty(w1),
        w1.new_empty((w1.shape[0],)) if nb1 else _empty(w1),
        w2.new_empty(w2.shape) if nw2 else _empty(w2),
        w2.new_empty((w2.shape[0],)) if nb2 else _empty(w2),
    )


def _mlp_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # outputs without a gradient: None, not filled zeros
    x, w1, b1, w2, b2, activation, save_preact = inputs
    ctx.save_for_backward(x, w1, output[1], output[2], w2)
    ctx.has_bias = (b1 is not None, b2 is not None)
    ctx.activation = activation
    ctx.saved_preact = save_preact


def _mlp_bwd(ctx, grad, _grad_h, _grad_z):
    if grad is None:  # only an output without a gradient was used
        return (None,) * 7
    x, w1, h, z, w2 = ctx.saved_tensors
    if not ctx.saved_preact:
        raise RuntimeError(
            "ferrite.mlp: backward needs the pre-activation, which was not kept (save_preact=False: "
            "the forward ran without gradients)"
        )
    nx, nw1, nb1, nw2, nb2 = ctx.needs_input_grad[:5]
    need = [bool(nx), bool(nw1), bool(nb1) and ctx.has_bias[0], bool(nw2), bool(nb2) and ctx.has_bias[1]]
    g = eager.mlp_backward(grad, x, w1, h, z, w2, ctx.activation, need)
    return tuple(t if n else None for t, n in zip(g, need)) + (None, None)


_mlp.register_autograd(_mlp_bwd, setup_context=_mlp_setup)
