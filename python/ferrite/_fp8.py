"""FP8 GEMM with scales as a custom op: ``scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)``.

``D = (scale_a * a.float()) @ (scale_b * b.float()).T + bias`` with ``a`` ``[m, k]`` and ``b``
``[n, k]`` in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (k contiguous: a linear layer's
weight as stored; ``torch._scaled_mm(a, w.t(), ...)`` is ``scaled_mm(a, w, ...)``), float32
scales of one element (per tensor) or ``[m]`` / ``[m, 1]`` for ``a`` and ``[n]`` / ``[1, n]``
for ``b`` (row-wise), ``bias`` ``[n]`` in ``out_dtype`` (bfloat16, float16 or float32). Forward
only, like ``torch._scaled_mm``. On Hopper the default is ferrite's FP8 ``wgmma`` with fp32
promotion of every 128-deep partial sum (``variant="wgmma_fast"``: the tensor core accumulates
all of k, like ``use_fast_accum=True``).
"""

from typing import Optional

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
