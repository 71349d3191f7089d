"""``ferrite::linear``, ``linear_rows``, ``linear_act`` and their backward ops: ferrite's linear
with bias and activation in the GEMM's epilogue, and the padded output rows for widths that are
not a multiple of 16 bytes."""

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _native
from ._eager import eager
from ._ops_common import (
    _activation,
    _check_gemm_extents,
    _check_tensors,
    _describe,
    _empty,
    _fail,
    _native_call,
    _tf32,
    _torch_act,
    _where,
)


# ----------------------------------------------------------------------------------------------
# checks (shared by the real and the fake implementations, so torch.compile fails early too)


def _linear_shape(op: str, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> List[int]:
    _check_tensors(op, [("input", x), ("weight", weight), ("bias", bias)])
    if x.dim() < 1:
        _fail(op, "input", "a tensor of rank ≥ 1 ([..., in_features])", _describe(x))
    if weight.dim() != 2:
        _fail(op, "weight", "a 2-D tensor [out_features, in_features]", _describe(weight))
    if weight.shape[1] != x.shape[-1]:
        _fail(op, "weight", f"[out_features, {x.shape[-1]}] (input is {list(x.shape)})", _describe(weight))
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        _fail(op, "bias", f"a 1-D tensor [{weight.shape[0]}] (out_features)", _describe(bias))
    _check_gemm_extents(
        op,
        [
            ("input", "rows (all leading dims)", math.prod(x.shape[:-1])),
            ("input", "in_features", x.shape[-1]),
            ("weight", "out_features", weight.shape[0]),
        ],
    )
    return list(x.shape[:-1]) + [weight.shape[0]]


# ----------------------------------------------------------------------------------------------
# linear


def _rows2(t: Tensor) -> Tensor:
    """t ([rows, cols]) itself if its rows are unit-stride and apart by ≥ cols, else a copy."""
    if t.stride(-1) == 1 and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1]):
        return t
    return t.contiguous()


# On CUDA the linear forward takes ferrite's default selection: `persistent_pairs` (the Hopper
# wgmma GEMM with its epilogue fused, checked on the H100: 0.87–1.03× the bare GEMM at the LLM
# shapes), `fused_pairs` before sm_90. `naive` (the plain GEMM, then bias/activation kernels) ran
# at 0.57–0.78× the bare GEMM, faster than the element-wise epilogue rungs (docs/linear.md).
_CUDA_LINEAR_VARIANT = None


def _linear_run(x: Tensor, weight: Tensor, bias: Optional[Tensor], act: str, save_z: bool, padded_out: bool = False):
    """(y, z) of y = act(x·Wᵀ + b) with ferrite's linear (bias and activation in the GEMM's
    epilogue); z = x·Wᵀ + b is written only when ``save_z`` (else None). With
    ``padded_out``, a y the GEMM wrote into padded rows (see _padded_width) is returned as that
    row-strided view instead of being copied out."""
    shape = list(x.shape[:-1]) + [weight.shape[0]]
    y = x.new_empty(shape)
    z = x.new_empty(shape) if save_z else None
    rows, k, n = math.prod(x.shape[:-1]), x.shape[-1], weight.shape[0]
    if y.numel() == 0:
        return y, z
    if k == 0:  # no GEMM to run: z is the bias (or 0)
        zz = torch.zeros(shape, dtype=x.dtype, device=x.device)
        if bias is not None:
            zz += bias
        y.copy_(_torch_act(zz, act))
        if save_z:
            z.copy_(zz)
        return y, z
    dev, stream = _where(x)
    w_op, b_op = _rows2(weight), None if bias is None else bias.contiguous()
    y_op, z_op = y.view(rows, n), z.view(rows, n) if save_z else None
    npad = _padded_width(x, rows, n)
    if npad != n:
        # Output rows that are not a multiple of 16 bytes keep the GEMM off its TMA-store path:
        # it runs on a weight (and bias) padded with zero rows into padded output rows, and the
        # n columns are copied out below.
        w_op = torch.zeros((npad, k), dtype=weight.dtype, device=weight.device)
        w_op[:n].copy_(weight)
        if bias is not None:
            b_op = torch.zeros((npad,), dtype=bias.dtype, device=bias.device)
            b_op[:n].copy_(bias)
        y_op = x.new_empty((rows, npad))
        z_op = x.new_empty((rows, npad)) if save_z else None
    _native_call(
        _native.linear_forward,
        _rows2(x.reshape(rows, k)),
        w_op,
        y_op,
        bias=b_op,
        z=z_op,
        activation=act,
        tf32=_tf32(x),
        device=dev,
        stream=stream,
        variant=_CUDA_LINEAR_VARIANT if x.is_cuda else None,
    )
    if npad != n:
        if padded_out and not save_z:
            return y_op[:, :n].view(shape), z
        y.view(rows, n).copy_(y_op[:, :n])
        if save_z:
            z.view(rows, n).copy_(z_op[:, :n])
    return y, z


# CUDA linear operands (outputs, gradients) this many elements or more with 16-byte-unaligned
# rows run on padded rows (see _padded_width).
_PAD_MIN_ELEMS = 1 << 22


def _padded_width(t: Tensor, rows: int, n: int) -> int:
    """The row width `linear`'s GEMMs get for rows of n elements of t's dtype: n, or n rounded up
    to 16 bytes for a large (≥ _PAD_MIN_ELEMS) CUDA operand whose rows are unaligned. Hopper's
    TMA needs 16-byte row strides; without them a 50257-wide vocabulary sends the classifier's
    GEMMs to slower paths. At GPT-2's classifier (8192×50257×768 bf16, H100) the padded rows,
    with the copy in or out, take the forward from 4.30 to 2.68 ms and the backward from 22.42 to
    4.94 ms (bench/results/2026-11-27-h100-models/pad-check-fwd-bwd.txt). A stopgap until the
    GEMMs take unaligned rows themselves (issue 25)."""
    es = t.element_size()
    if not t.is_cuda or (n * es) % 16 == 0 or rows * n < _PAD_MIN_ELEMS:
        return n
    step = 16 // es
    return (n + step - 1) // step * step


def _aligned_rows(g: Tensor, act: str) -> Tensor:
    """dY for the backward GEMMs: contiguous, or in padded rows (see _padded_width) — as it came
    when its rows already are (the gradient of ``linear_rows``' output through cross-entropy),
    else copied there."""
    rows, n = g.shape
    npad = _padded_width(g, rows, n) if act == "none" else n
    if npad == n:
        return g.contiguous()
    if g.stride(1) == 1 and g.stride(0) >= n and (g.stride(0) * g.element_size()) % 16 == 0:
        return g
    padded = g.new_empty((rows, npad))[:, :n]
    padded.copy_(g)
    return padded


def _linear_grads(grad, x, weight, z, act, need_x, need_w, need_b):
    n, k = weight.shape
    rows = math.prod(x.shape[:-1])
    dx = x.new_empty(x.shape) if need_x else None
    dw = weight.new_empty(weight.shape) if need_w else None
    db = weight.new_empty((n,)) if need_b else None
    if rows == 0 or k == 0 or n == 0:
        # nothing for the kernels to do; what remains is zeros (and db when k == 0)
        for t in (dx, dw, db):
            if t is not None:
                t.zero_()
        if db is not None and rows > 0 and n > 0:
            g = grad.reshape(rows, n).float()
            if act != "none":
                zz = z.reshape(rows, n).detach().float().requires_grad_(True)
                with torch.enable_grad():
                    (g,) = torch.autograd.grad(_torch_act(zz, act), zz, g)
            db.copy_(g.sum(0))
    elif need_x or need_w or need_b:
        dev, stream = _where(x)
        _native_call(
            _native.linear_backward,
            _aligned_rows(grad.reshape(rows, n), act),
            _rows2(x.reshape(rows, k)),
            _rows2(weight),
            z=None if act == "none" else z.reshape(rows, n).contiguous(),
            dx=None if dx is None else dx.view(rows, k),
            dw=dw,
            db=db,
            activation=act,
            tf32=_tf32(x),
            device=dev,
            stream=stream,
        )
    return (
        dx if need_x else _empty(x),
        dw if need_w else _empty(weight),
        db if need_b else _empty(weight),
    )


@torch.library.custom_op("ferrite::linear", mutates_args=())
def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    _linear_shape("ferrite.linear", x, weight, bias)
    return _linear_run(x, weight, bias, "none", False)[0]


@_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(_linear_shape("ferrite.linear", x, weight, bias))


# linear whose output may keep padded rows: for a classifier whose width is not a multiple of
# 16 bytes (GPT-2's 50257), the GEMM writes padded rows (see _padded_width) and the output is that
# row-strided view — no copy out, and cross-entropy then writes its gradient with the same row
# stride, which the backward GEMMs take as it is (no copy in). Same values as `linear`.


def _rows_strides(shape: List[int], ld: int) -> List[int]:
    strides = [1] * len(shape)
    if len(shape) >= 2:
        strides[-2] = ld
        for i in range(len(shape) - 3, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
    return strides


@torch.library.custom_op("ferrite::linear_rows", mutates_args=())
def _linear_rows(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    _linear_shape("ferrite.linear", x, weight, bias)
    return _linear_run(x, weight, bias, "none", False, padded_out=True)[0]


@_linear_rows.register_fake
def _(x, weight, bias):
    shape = _linear_shape("ferrite.linear", x, weight, bias)
    rows, n = math.prod(shape[:-1]), shape[-1]
    npad = _padded_width(x, rows, n) if rows * n > 0 and x.shape[-1] > 0 else n
    return x.new_empty_strided(shape, _rows_strides(shape, npad))



# The gradient of `linear_rows`' output arrives in padded rows (cross-entropy writes it there);
# under torch.compile inductor would otherwise be free to hand it over densely packed (the stride
# order is the same), and the GEMMs would copy it back. Exact strides keep the padded rows.
_EXACT_STRIDES = tuple(t for t in (getattr(torch.Tag, "needs_exact_strides", None),) if t is not None)


@torch.library.custom_op("ferrite::linear_backward", mutates_args=(), tags=_EXACT_STRIDES)
def _linear_backward(
    grad: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_w: bool, need_b: bool
) -> Tuple[Tensor, Tensor, Tensor]:
    _check_tensors("ferrite.linear_backward", [("grad", grad), ("input", x), ("weight", weight)])
    return _linear_grads(grad, x, weight, None, "none", need_x, need_w, need_b)


def _linear_grads_fake(x, weight, need_x, need_w, need_b):
    return (
        x.new_empty(x.shape) if need_x else _empty(x),
        weight.new_empty(weight.shape) if need_w else _empty(weight),
        weight.new_empty((weight.shape[0],)) if need_b else _empty(weight),
    )


@_linear_backward.register_fake
def _(grad, x, weight, need_x, need_w, need_b):
    _check_tensors("ferrite.linear_backward", [("grad", grad), ("input", x), ("weight", weight)])
    return _linear_grads_fake(x, weight, need_x, need_w, need_b)


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_bwd(ctx, grad):
    x, weight = ctx.saved_tensors
    nx, nw, nb = ctx.needs_input_grad
    nb = bool(nb) and ctx.has_bias
    dx, dw, db = eager.linear_backward(grad, x, weight, nx, nw, nb)
    return (dx if nx else None), (dw if nw else None), (db if nb else None)


_linear.register_autograd(_linear_bwd, setup_context=_linear_setup)
_linear_rows.register_autograd(_linear_bwd, setup_context=_linear_setup)


# linear with a fused activation: y = act(x·Wᵀ + b); z (the pre-activation) kept for backward


@torch.library.custom_op("ferrite::linear_act", mutates_args=())
def _linear_act(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, save_preact: bool
) -> Tuple[Tensor, Tensor]:
    _linear_shape("ferrite.linear", x, weight, bias)
    act = _activation("ferrite.linear", activation)
    y, z = _linear_run(x, weight, bias, act, save_preact and act != "none")
    return y, (_empty(x) if z is None else z)


@_linear_act.register_fake
def _(x, weight, bias, activation, save_preact):
    shape = _linear_shape("ferrite.linear", x, weight, bias)
    act = _activation("ferrite.linear", activation)
    return x.new_empty(shape), (x.new_empty(shape) if save_preact and act != "none" else _empty(x))


@torch.library.custom_op("ferrite::linear_act_backward", mutates_args=())
def _linear_act_backward(
    grad: Tensor,
    x: Tensor,
    weight: Tensor,
    preact: Tensor,
    activation: str,
    need_x: bool,
    need_w: bool,
    need_b: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    op = "ferrite.linear_backward"
    _check_tensors(op, [("grad", grad), ("input", x), ("weight", weight), ("preact", preact)])
    act = _activation(op, activation)
    if act != "none" and list(preact.shape) != list(grad.shape):
        _fail(op, "preact", f"the forward's pre-activation {list(grad.shape)}", _describe(preact))
    return _linear_grads(grad, x, weight, preact, act, need_x, need_w, need_b)


@_linear_act_backward.register_fake
def _(grad, x, weight, preact, activation, need_x, need_w, need_b):
    _check_tensors("ferrite.linear_backward", [("grad", grad), ("input", x), ("weight", weight)])
    return _linear_grads_fake(x, weight, need_x, need_w, need_b)


def _linear_act_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # outputs without a gradient: None, not filled zeros
    x, weight, bias, activation, save_preact = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.has_bias = bias is not None
    ctx.activation = activation
    ctx.saved_preact = save_preact


def _linear_act_bwd(ctx, grad, _grad_z):
    if grad is None:  # only an output without a gradient was used
        return (None,) * 5
    x, weight, z = ctx.saved_tensors
    act = _activation("ferrite.linear_backward", ctx.activation)
    if act != "none" and not ctx.saved_preact:
        raise RuntimeError(
            "ferrite.linear: backward through an activation needs the pre-activation, which was "
            "not kept (save_preact=False: the forward ran without gradients)"
        )
    nx, nw, nb = ctx.needs_input_grad[:3]
    nb = bool(nb) and ctx.has_bias
    dx, dw, db = eager.linear_act_backward(grad, x, weight, z, ctx.activation, nx, nw, nb)
    return (dx if nx else None), (dw if nw else None), (db if nb else None), None, None


_linear_act.register_autograd(_linear_act_bwd, setup_context=_linear_act_setup)
