"""FP8 GEMM with scales as a custom op: ``scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)``,
and the quantisation that feeds it: ``quantize_fp8(x, dtype, rowwise, scale)``.

``D = (scale_a * a.float()) @ (scale_b * b.float()).T + bias`` with ``a`` ``[m, k]`` and ``b``
``[n, k]`` in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (k contiguous: a linear layer's
weight as stored; ``torch._scaled_mm(a, w.t(), ...)`` is ``scaled_mm(a, w, ...)``), float32
scales of one element (per tensor) or ``[m]`` / ``[m, 1]`` for ``a`` and ``[n]`` / ``[1, n]``
for ``b`` (row-wise), ``bias`` ``[n]`` in ``out_dtype`` (bfloat16, float16 or float32). Forward
only, like ``torch._scaled_mm``. On Hopper the default is ferrite's FP8 ``wgmma`` with fp32
promotion of every 128-deep partial sum (``variant="wgmma_fast"``: the tensor core accumulates
all of k, like ``use_fast_accum=True``).
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _native
from ._eager import eager
from ._ops_common import _describe, _fail, _native_call, _where

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)
_OP = "ferrite.scaled_mm"


def _check(a: Tensor, b: Tensor, out_dtype: torch.dtype):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Tensor):
            _fail(_OP, name, "a 2-D float8_e4m3fn or float8_e5m2 tensor", type(t).__name__)
        if t.dtype not in _FP8 or t.dim() != 2:
            _fail(_OP, name, "a 2-D float8_e4m3fn or float8_e5m2 tensor", _describe(t))
    if out_dtype not in _OUT:
        _fail(_OP, "out_dtype", "torch.bfloat16, torch.float16 or torch.float32", str(out_dtype))


@torch.library.custom_op("ferrite::scaled_mm", mutates_args=())
def _scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    bias: Optional[Tensor],
    out_dtype: torch.dtype,
    variant: Optional[str],
) -> Tensor:
    _check(a, b, out_dtype)
    out = a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
    if out.numel() > 0:
        dev, stream = _where(a)
        _native_call(
            _native.scaled_mm,
            a,
            b,
            scale_a.reshape(-1),
            scale_b.reshape(-1),
            bias,
            out,
            device=dev,
            stream=stream,
            variant=variant,
        )
    return out


@_scaled_mm.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype, variant):
    _check(a, b, out_dtype)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    bias: Optional[Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
    variant: Optional[str] = None,
) -> Tensor:
    """``(scale_a * a) @ (scale_b * b).T + bias`` for float8 ``a`` ``[m, k]`` and ``b``
    ``[n, k]`` (see the module docs)."""
    # Every argument positional: the eager fast path (no dispatcher) takes the call when nothing
    # but plain eager PyTorch runs.
    return eager.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, variant)


# ----------------------------------------------------------------------------------------------
# quantize_fp8

_QOP = "ferrite.quantize_fp8"
_QIN = (torch.float32, torch.float16, torch.bfloat16)


def _qshapes(x: Tensor, dtype: torch.dtype, rowwise: bool, scale: Optional[Tensor]):
    """The scale tensors' shape ([rows, 1] row-wise, [1] per tensor), after the checks."""
    if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype not in _QIN:
        got = _describe(x) if isinstance(x, Tensor) else type(x).__name__
        _fail(_QOP, "x", "a 2-D float32, float16 or bfloat16 tensor [rows, cols]", got)
    if dtype not in _FP8:
        _fail(_QOP, "dtype", "torch.float8_e4m3fn or torch.float8_e5m2", str(dtype))
    shape = (x.shape[0], 1) if rowwise else (1,)
    if scale is not None:
        n = x.shape[0] if rowwise else 1
        if not isinstance(scale, Tensor) or scale.dtype != torch.float32 or scale.numel() != n or scale.device != x.device:
            got = _describe(scale) if isinstance(scale, Tensor) else type(scale).__name__
            _fail(_QOP, "scale", f"a float32 tensor of {n} element(s) on {x.device}", got)
    return shape


@torch.library.custom_op("ferrite::quantize_fp8", mutates_args=())
def _quantize_fp8(x: Tensor, dtype: torch.dtype, rowwise: bool, scale: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    shape = _qshapes(x, dtype, rowwise, scale)
    q = x.new_empty(x.shape, dtype=dtype)
    amax = x.new_empty(shape, dtype=torch.float32)
    inv = x.new_empty(shape, dtype=torch.float32)
    dev, stream = _where(x)
    _native_call(
        _native.quantize_fp8,
        x.contiguous(),
        None if scale is None else scale.reshape(-1).contiguous(),
        q,
        amax,
        inv,
        device=dev,
        stream=stream,
    )
    return q, inv, amax


@_quantize_fp8.register_fake
def _(x, dtype, rowwise, scale):
    shape = _qshapes(x, dtype, rowwise, scale)
    return (
        x.new_empty(x.shape, dtype=dtype),
        x.new_empty(shape, dtype=torch.float32),
        x.new_empty(shape, dtype=torch.float32),
    )


def quantize_fp8(
    x: Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    rowwise: bool = False,
    scale: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(q, inv_scale, amax)``: ``q = fp8(x * s)`` rounded to nearest-even and saturated, per
    tensor or per row (``rowwise``) of a 2-D ``x``; ``s`` the given ``scale`` (delayed scaling)
    or ``FMAX / amax`` (current scaling: the largest |x| on the format's largest finite value);
    ``amax = max |x|``; ``inv_scale = 1 / s``, ready as :func:`scaled_mm`'s ``scale_a`` /
    ``scale_b`` (shape ``[rows, 1]`` row-wise, ``[1]`` per tensor; ``amax`` the same). An inf or
    NaN in x gives NaN codes for its tensor (row); an all-zero row gets s = 1. Not differentiable.
    """
    return eager.quantize_fp8(x, dtype, rowwise, scale)


# ----------------------------------------------------------------------------------------------
# linear in FP8 (``ferrite.linear(..., fp8=recipe)``)

_RECIPES = ("tensorwise", "rowwise")
_E4, _E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _qmm(a: Tensor, a_fmt, b: Tensor, b_fmt, rowwise: bool, bias: Optional[Tensor], out_dtype) -> Tensor:
    """``a @ b.T`` (+ bias) through FP8: each operand quantised from its high-precision values
    (current scaling, per row of a and of b when ``rowwise``: the dims that are not summed over),
    then ``scaled_mm``."""
    qa, sa, _ = quantize_fp8(a, a_fmt, rowwise)
    qb, sb, _ = quantize_fp8(b, b_fmt, rowwise)
    return scaled_mm(qa, qb, sa, sb, bias, out_dtype)


class _LinearFP8(torch.autograd.Function):
    """y = x·wᵀ + b with all three GEMMs in FP8 (e4m3 for x and w, e5m2 for the gradient dy: the
    "hybrid" formats), every operand quantised with current scaling, transposed where the GEMM
    sums over its rows (dX sums over w's rows, dW over the tokens). Per tensor, a transpose's
    codes are the transposed codes under the same scale: the backward transposes the forward's
    codes (1 byte each) and quantises dy once. Per row, the scaled axis changes with the
    transpose: the backward quantises wᵀ, xᵀ and dyᵀ from the high-precision tensors."""

    @staticmethod
    def forward(ctx, x2: Tensor, w: Tensor, bias: Optional[Tensor], rowwise: bool) -> Tensor:
        qx, sx, _ = quantize_fp8(x2, _E4, rowwise)
        qw, sw, _ = quantize_fp8(w, _E4, rowwise)
        ctx.rowwise, ctx.has_bias, ctx.dtypes = rowwise, bias is not None, (x2.dtype, w.dtype)
        ctx.save_for_backward(*((x2, w) if rowwise else (qx, sx, qw, sw)))
        return scaled_mm(qx, qw, sx, sw, bias, x2.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x_dtype, w_dtype = ctx.dtypes
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.rowwise:
            x2, w = ctx.saved_tensors
            if ctx.needs_input_grad[0]:  # dX [m, k] = dY [m, n] · W [n, k]
                dx = _qmm(dy, _E5, w.t().contiguous(), _E4, True, None, x_dtype)
            if ctx.needs_input_grad[1]:  # dW [n, k] = dYᵀ [n, m] · X [m, k]
                dw = _qmm(dy.t().contiguous(), _E5, x2.t().contiguous(), _E4, True, None, w_dtype)
        else:
            qx, sx, qw, sw = ctx.saved_tensors
            qg, sg, _ = quantize_fp8(dy, _E5, False)
            if ctx.needs_input_grad[0]:
                dx = scaled_mm(qg, qw.t().contiguous(), sg, sw, None, x_dtype)
            if ctx.needs_input_grad[1]:
                dw = scaled_mm(qg.t().contiguous(), qx.t().contiguous(), sg, sx, None, w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.float().sum(0).to(dy.dtype)
        return dx, dw, db, None


def linear_fp8(x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: str) -> Tensor:
    """``ferrite.linear(x, weight, bias, fp8=recipe)``: forward and backward GEMMs in FP8 with
    current scaling — ``"tensorwise"`` (one scale per operand) or ``"rowwise"`` (one per row of
    each operand: a token's, an output feature's). Output and gradients in the input's dtype."""
    op = "ferrite.linear"
    if recipe not in _RECIPES:
        _fail(op, "fp8", "None, 'tensorwise' or 'rowwise'", repr(recipe))
    if not isinstance(x, Tensor) or x.dim() < 1 or x.dtype not in _QIN:
        _fail(op, "input", "a float32, float16 or bfloat16 tensor [..., in_features]", _describe(x) if isinstance(x, Tensor) else type(x).__name__)
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.dtype != x.dtype:
        got = _describe(weight) if isinstance(weight, Tensor) else type(weight).__name__
        _fail(op, "weight", f"[out_features, {x.shape[-1]}] of the input's dtype", got)
    y = _LinearFP8.apply(x.reshape(-1, x.shape[-1]), weight, bias, recipe == "rowwise")
    return y.reshape(*x.shape[:-1], weight.shape[0])