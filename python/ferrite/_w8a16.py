"""int8 weights with bf16/f16 activations, as decoding uses them: ``w8a16(x, w, scale, bias)``
and the quantiser that makes ``w`` and ``scale``, ``quantize_int8(weight)``.

``y = x @ (scale[:, None] * w.float()).T + bias`` with ``x`` ``[..., k]`` in bfloat16 or float16,
``w`` ``[n, k]`` int8 (a linear layer's weight as stored), ``scale`` ``[n]`` float32, ``bias``
``[n]`` in x's dtype, fp32 accumulation, ``y`` ``[..., n]`` in x's dtype — the semantics of
``torch._weight_int8pack_mm`` plus a bias. Forward only (a frozen quantised weight; like torch's
op). On a GPU the default is ferrite's ``mma`` kernel: at a few rows the product is a stream
over the weight, and int8 halves its bytes.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _native
from ._eager import eager
from ._ops_common import _describe, _fail, _native_call, _where

_ACT = (torch.bfloat16, torch.float16)
_OP = "ferrite.w8a16"


def _check(x: Tensor, w: Tensor, scale: Tensor, bias: Optional[Tensor]):
    if not isinstance(x, Tensor) or x.dtype not in _ACT or x.dim() < 1:
        got = _describe(x) if isinstance(x, Tensor) else type(x).__name__
        _fail(_OP, "x", "a bfloat16 or float16 tensor [..., k]", got)
    if not isinstance(w, Tensor) or w.dtype != torch.int8 or w.dim() != 2 or w.shape[1] != x.shape[-1]:
        got = _describe(w) if isinstance(w, Tensor) else type(w).__name__
        _fail(_OP, "w", f"an int8 tensor [n, {x.shape[-1]}] (quantize_int8 makes one)", got)
    n = w.shape[0]
    if not isinstance(scale, Tensor) or scale.dtype != torch.float32 or scale.numel() != n:
        got = _describe(scale) if isinstance(scale, Tensor) else type(scale).__name__
        _fail(_OP, "scale", f"a float32 tensor of {n} elements (one per row of w)", got)
    if bias is not None and (not isinstance(bias, Tensor) or bias.dtype != x.dtype or bias.shape != (n,)):
        got = _describe(bias) if isinstance(bias, Tensor) else type(bias).__name__
        _fail(_OP, "bias", f"a {x.dtype} tensor [{n}] (x's dtype)", got)
    for name, t in (("w", w), ("scale", scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            _fail(_OP, name, f"a tensor on {x.device} (x's device)", str(t.device))


@torch.library.custom_op("ferrite::w8a16", mutates_args=())
def _w8a16(
    x: Tensor, w: Tensor, scale: Tensor, bias: Optional[Tensor], variant: Optional[str]
) -> Tensor:
    _check(x, w, scale, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = x2.new_empty((x2.shape[0], w.shape[0]))
    if out.numel() > 0:
        dev, stream = _where(x2)
        _native_call(
            _native.w8a16,
            x2,
            w if w.stride(-1) == 1 else w.contiguous(),
            scale.reshape(-1).contiguous(),
            bias,
            out,
            device=dev,
            stream=stream,
            variant=variant,
        )
    return out.reshape(*x.shape[:-1], w.shape[0])


@_w8a16.register_fake
def _(x, w, scale, bias, variant):
    _check(x, w, scale, bias)
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def w8a16(
    x: Tensor,
    w: Tensor,
    scale: Tensor,
    bias: Optional[Tensor] = None,
    variant: Optional[str] = None,
) -> Tensor:
    """``x @ (scale[:, None] * w).T + bias`` for int8 ``w`` ``[n, k]`` (see the module docs)."""
    return eager.w8a16(x, w, scale, bias, variant)


def quantize_int8(weight: Tensor) -> Tuple[Tensor, Tensor]:
    """Symmetric per-row int8 codes of a float ``weight`` ``[n, k]`` on its own device:
    ``scale = amax(|row|) / 127`` (1 for a row of zeros) and ``w = round(weight / scale)``
    (half away from zero) in −127…127 — ferrite's Rust ``quantize_int8``, bit for bit. Returns
    ``(w int8 [n, k], scale float32 [n])``; a non-finite weight is an error."""
    if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        got = _describe(weight) if isinstance(weight, Tensor) else type(weight).__name__
        _fail("ferrite.quantize_int8", "weight", "a 2-D float tensor [n, k]", got)
    w = weight.float()
    if not bool(torch.isfinite(w).all()):
        _fail("ferrite.quantize_int8", "weight", "finite values", "NaN or inf")
    amax = w.abs().amax(dim=1) if w.shape[1] > 0 else w.new_zeros(w.shape[0])
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    v = w / scale[:, None]
    # Half away from zero, exactly (|v| + 0.5 would round up values just below a half).
    t = torch.trunc(v)
    q = torch.where((v - t).abs() >= 0.5, t + torch.sign(v), t).clamp(-127, 127).to(torch.int8)
    return q, scale
