"""Rotary position embeddings as custom ops: flash-attn's ``apply_rotary_emb``.

- ``rotary(x, cos, sin, seqlen_offsets, offset, cu_seqlens, interleaved, conjugate) -> out``:
  x ``[B, S, H, D]`` (or ``[T, H, D]`` packed by ``cu_seqlens``), cos/sin ``[S_ro, R/2]`` in x's
  dtype; the first R dims of every head rotated, the rest copied. Autograd: the backward is the
  inverse rotation of the gradient (``conjugate``), one kernel.
- ``rotary_`` (mutates x): the same in place, for calls that need no gradient.
"""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _native
from ._eager import eager
from ._ops import _check_tensors, _describe, _fail, _native_call, _where


def _rotary_check(op, x, cos, sin, seqlen_offsets, cu_seqlens):
    _check_tensors(op, [("x", x), ("cos", cos), ("sin", sin)])
    rank = 3 if cu_seqlens is not None else 4
    if x.dim() != rank:
        want = "[total, H, D] (packed by cu_seqlens)" if rank == 3 else "a 4-D tensor [B, S, H, D]"
        _fail(op, "x", want, _describe(x))
    for name, t in (("seqlen_offsets", seqlen_offsets), ("cu_seqlens", cu_seqlens)):
        if t is not None and (not isinstance(t, Tensor) or t.dtype != torch.int32 or t.dim() != 1):
            got = _describe(t) if isinstance(t, Tensor) else type(t).__name__
            _fail(op, name, "an int32 tensor of rank 1", got)
        if t is not None and t.device != x.device:
            _fail(op, name, f"a tensor on {x.device} (like `x`)", _describe(t))


def _run(x, cos, sin, out, seqlen_offsets, offset, cu_seqlens, interleaved, conjugate):
    if out.numel() == 0:
        return
    dev, stream = _where(x)
    _native_call(
        _native.rotary,
        x if x.stride(-1) == 1 else x.contiguous(),
        cos.contiguous(),
        sin.contiguous(),
        out,
        offset=int(offset),
        offsets=None if seqlen_offsets is None else seqlen_offsets.contiguous(),
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.contiguous(),
        interleaved=bool(interleaved),
        conjugate=bool(conjugate),
        device=dev,
        stream=stream,
    )


@torch.library.custom_op("ferrite::rotary", mutates_args=())
def _rotary(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    seqlen_offsets: Optional[Tensor],
    offset: int,
    cu_seqlens: Optional[Tensor],
    interleaved: bool,
    conjugate: bool,
) -> Tensor:
    _rotary_check("ferrite.apply_rotary_emb", x, cos, sin, seqlen_offsets, cu_seqlens)
    out = x.new_empty(x.shape)
    _run(x, cos, sin, out, seqlen_offsets, offset, cu_seqlens, interleaved, conjugate)
    return out


@_rotary.register_fake
def _(x, cos, sin, seqlen_offsets, offset, cu_seqlens, interleaved, conjugate):
    _rotary_check("ferrite.apply_rotary_emb", x, cos, sin, seqlen_offsets, cu_seqlens)
    return x.new_empty(x.shape)


def _rotary_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2], inputs[3], inputs[5])
    ctx.offset, ctx.interleaved, ctx.conjugate = inputs[4], inputs[6], inputs[7]


def _rotary_bwd(ctx, grad):
    cos, sin, offs, cu = ctx.saved_tensors
    # A rotation's transpose is its inverse: the gradient rotated the other way.
    dx = eager.rotary(grad, cos, sin, offs, ctx.offset, cu, ctx.interleaved, not ctx.conjugate)
    return dx, None, None, None, None, None, None, None


_rotary.register_autograd(_rotary_bwd, setup_context=_rotary_setup)


@torch.library.custom_op("ferrite::rotary_", mutates_args=("x",))
def _rotary_(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    seqlen_offsets: Optional[Tensor],
    offset: int,
    cu_seqlens: Optional[Tensor],
    interleaved: bool,
    conjugate: bool,
) -> None:
    _rotary_check("ferrite.apply_rotary_emb", x, cos, sin, seqlen_offsets, cu_seqlens)
    if x.stride(-1) != 1:
        _fail("ferrite.apply_rotary_emb", "x", "a contiguous last dim (inplace=True)", _describe(x))
    _run(x, cos, sin, x, seqlen_offsets, offset, cu_seqlens, interleaved, conjugate)


@_rotary_.register_fake
def _(x, cos, sin, seqlen_offsets, offset, cu_seqlens, interleaved, conjugate):
    return None


def _offsets(op: str, seqlen_offsets) -> Tuple[Optional[Tensor], int]:
    if isinstance(seqlen_offsets, Tensor):
        return seqlen_offsets, 0
    if isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, int) or seqlen_offsets < 0:
        _fail(op, "seqlen_offsets", "a non-negative int or an int32 tensor [B]", repr(seqlen_offsets))
    return None, seqlen_offsets


def apply_rotary_emb(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: Union[int, Tensor] = 0,
    cu_seqlens: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
) -> Tensor:
    """flash-attn's ``apply_rotary_emb``: x ``[B, S, H, D]`` (or ``[total, H, D]`` with
    ``cu_seqlens`` int32 ``[B+1]``), cos/sin ``[S_ro, R/2]`` in x's dtype with R ≤ D. The first R
    dims of every head are rotated — pairs ``(i, i + R/2)``, or ``(2i, 2i+1)`` with
    ``interleaved`` — at position ``s + seqlen_offsets`` (an int, or int32 ``[B]`` per sequence);
    the other dims pass through. ``inplace`` writes into x (when no gradient is needed; with one,
    the rotated tensor is copied into x so autograd sees an ordinary in-place op).

    Positions past the tables: an error on the CPU and for an int offset; on CUDA with an offsets
    tensor or ``cu_seqlens`` (read on the device, no sync) that token's rotated dims are NaN."""
    op = "ferrite.apply_rotary_emb"
    offs, offset = _offsets(op, seqlen_offsets)
    del max_seqlen  # the kernel walks the packed rows; the longest sequence is not needed
    if inplace:
        needs_grad = torch.is_grad_enabled() and x.requires_grad
        if not needs_grad:
            torch.ops.ferrite.rotary_(x, cos, sin, offs, offset, cu_seqlens, interleaved, False)
            return x
        return x.copy_(eager.rotary(x, cos, sin, offs, offset, cu_seqlens, interleaved, False))
    return eager.rotary(x, cos, sin, offs, offset, cu_seqlens, interleaved, False)
