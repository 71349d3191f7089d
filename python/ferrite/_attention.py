"""Attention as custom ops: flash forward/backward (causal, sliding window, GQA/MQA, variable
length, soft-capping, both layouts) and paged-KV decode with its cache append.

- ``attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, scale,
  causal, window_left, window_right, softcap, deterministic) -> (out, lse)``. Layouts ``"bshd"``
  (q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``: flash-attn's) and ``"bhsd"`` (``[B, H, S, D]``:
  SDPA's); with ``cu_seqlens_*`` (int32 ``[B+1]``) the batch is packed: q ``[total_q, Hq, D]``.
  lse is float32 ``[B, Hq, Sq]`` (``[Hq, total_q]`` packed). Causal masks are bottom-right aligned
  when Sq ≠ Sk (flash-attn's convention). Backward: ``attention_backward`` (recomputes the
  probabilities from lse; ``deterministic`` gives the same bits every run).
- ``paged_decode(q, key_cache, value_cache, block_table, seq_lens, scale, softcap, window_left,
  variant) -> (out, lse)``: one decode step for q ``[B, Hq, D]`` over a paged cache
  ``[num_blocks, block_size, Hkv, D]`` read through ``block_table`` (int32 ``[B, max_blocks]``)
  with ``seq_lens`` (int32 ``[B]``). Inference only (no autograd).
- ``paged_decode_planned(q, key_cache, value_cache, block_table, seq_lens, plan, scale, softcap,
  window_left, variant) -> (out, lse)``: the same on a plan (mutated: the run writes its split
  partials and error flag there); the kernels only launch, with no host sync.
- ``paged_decode_plan(seq_lens, numel, num_q_heads, num_kv_heads, head_dim, dtype, window_left,
  variant) -> plan``: the int32 plan tensor (``numel`` elements, computed by the public wrapper)
  of a decode batch, planned on the device from ``seq_lens``.
- ``append_kv(k, v, key_cache, value_cache, slot_mapping)``: writes k, v ``[T, Hkv, D]`` into
  the caches in place at ``slot_mapping`` (int32 ``[T]``; −1 skips a token).

Public functions: :func:`flash_attn_func`, :func:`flash_attn_varlen_func` (flash-attn's
signatures), :func:`scaled_dot_product_attention` (SDPA's), :func:`paged_decode`,
:func:`paged_decode_plan`, :func:`paged_decode_errors`, :func:`append_kv`.

CUDA runs float16/bfloat16 through the ``flash`` / ``hopper`` kernels (head dims 32/64/96/128;
other head dims and float32 fall back to the ``naive`` kernel, which materialises the scores); the
CPU runs float32/float16/bfloat16. A varlen call reads cu_seqlens on the host (one sync), so it is
not CUDA-graph capturable; the padded layouts are.
"""

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _native
from . import _rotary as _rotary_mod
from ._eager import eager
from ._ops import _DTYPE_NAMES, _FLOATS, _check_tensors, _describe, _fail, _native_call, _raw_stream, _where

_LAYOUTS = ("bshd", "bhsd")


def _last_contig(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_index(op: str, name: str, t: Optional[Tensor], like: Tensor, rank: int) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor) or t.dtype != torch.int32 or t.dim() != rank:
        got = _describe(t) if isinstance(t, Tensor) else type(t).__name__
        _fail(op, name, f"an int32 tensor of rank {rank}", got)
    if t.device != like.device:
        _fail(op, name, f"a tensor on {like.device} (like `q`)", _describe(t))


def _attn_check(op, q, k, v, cu_q, cu_k, layout):
    _check_tensors(op, [("q", q), ("k", k), ("v", v)])
    if layout not in _LAYOUTS:
        _fail(op, "layout", "'bshd' or 'bhsd'", repr(layout))
    varlen = cu_q is not None or cu_k is not None
    if varlen and (cu_q is None or cu_k is None):
        _fail(op, "cu_seqlens_k" if cu_k is None else "cu_seqlens_q", "a tensor (both or neither)", "None")
    _check_index(op, "cu_seqlens_q", cu_q, q, 1)
    _check_index(op, "cu_seqlens_k", cu_k, q, 1)
    rank = 3 if varlen else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            want = "[total, H, D] (packed by cu_seqlens)" if varlen else f"a 4-D [{', '.join(layout.upper())}] tensor"
            _fail(op, name, want, _describe(t))
    if varlen:
        hq = q.shape[1]
        lse_shape = [hq, q.shape[0]]
    elif layout == "bshd":
        lse_shape = [q.shape[0], q.shape[2], q.shape[1]]
    else:
        lse_shape = [q.shape[0], q.shape[1], q.shape[2]]
    return lse_shape


def _attn_kwargs(cu_q, cu_k, max_q, max_k, layout, scale, causal, wl, wr, softcap) -> dict:
    """The native call's keyword arguments shared by the forward and the backward."""
    return dict(
        cu_seqlens_q=None if cu_q is None else cu_q.contiguous(),
        cu_seqlens_k=None if cu_k is None else cu_k.contiguous(),
        max_seqlen_q=int(max_q),
        max_seqlen_k=int(max_k),
        layout=layout,
        scale=scale,
        causal=causal,
        window_left=int(wl),
        window_right=int(wr),
        softcap=float(softcap),
    )


@torch.library.custom_op("ferrite::attention", mutates_args=())
def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    layout: str,
    scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> Tuple[Tensor, Tensor]:
    op = "ferrite.attention"
    lse_shape = _attn_check(op, q, k, v, cu_seqlens_q, cu_seqlens_k, layout)
    kw = _attn_kwargs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left, window_right, softcap)
    return _forward(_last_contig(q), _last_contig(k), _last_contig(v), lse_shape, kw)


def _forward(q: Tensor, k: Tensor, v: Tensor, lse_shape, kw: dict) -> Tuple[Tensor, Tensor]:
    """(out, lse) of the native forward into new buffers; `kw` from _attn_kwargs."""
    o = q.new_empty(q.shape)
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    if q.numel() == 0:
        return o, lse  # no query row (S = 0, a batch or a head count of 0): nothing to compute
    dev, stream = _where(q)
    _native_call(_native.attention_forward, q, k, v, o, lse, **kw, device=dev, stream=stream)
    return o, lse


@_attention.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left, window_right, softcap, deterministic):
    lse_shape = _attn_check("ferrite.attention", q, k, v, cu_seqlens_q, cu_seqlens_k, layout)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("ferrite::attention_backward", mutates_args=())
def _attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    layout: str,
    scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    op = "ferrite.attention_backward"
    _attn_check(op, q, k, v, cu_seqlens_q, cu_seqlens_k, layout)
    _check_tensors(op, [("q", q), ("dout", dout), ("out", o)])
    # The kernels want each gradient with its partner's strides and dout with out's: everything
    # contiguous is the simple way to get that (copies only where the caller's views are strided).
    q, k, v, o, dout = (t.contiguous() for t in (q, k, v, o, dout))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:
        # No query, or no key: nothing attends, every gradient is zero (and dq, dk, dv may be empty).
        return dq.zero_(), dk.zero_(), dv.zero_()
    dev, stream = _where(q)
    _native_call(
        _native.attention_backward,
        dout,
        q,
        k,
        v,
        o,
        lse.contiguous(),
        dq,
        dk,
        dv,
        **_attn_kwargs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left, window_right, softcap),
        deterministic=deterministic,
        device=dev,
        stream=stream,
    )
    return dq, dk, dv


@_attention_backward.register_fake
def _(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, scale, causal, window_left, window_right, softcap, deterministic):
    _attn_check("ferrite.attention_backward", q, k, v, cu_seqlens_q, cu_seqlens_k, layout)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attn_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # outputs without a gradient: None, not filled zeros
    q, k, v, cu_q, cu_k = inputs[:5]
    ctx.args = inputs[5:]
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)


def _attn_bwd(ctx, dout, _dlse):
    if dout is None:  # only an output without a gradient was used
        return (None,) * 14
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = eager.attention_backward(dout, q, k, v, o, lse, cu_q, cu_k, *ctx.args)
    return (dq, dk, dv) + (None,) * 11


_attention.register_autograd(_attn_bwd, setup_context=_attn_setup)


def _window(op: str, window_size: Sequence[int]) -> Tuple[int, int]:
    try:
        wl, wr = (int(w) for w in window_size)
    except (TypeError, ValueError):
        _fail(op, "window_size", "a pair (left, right)", repr(window_size))
    if wl < -1 or wr < -1:
        _fail(op, "window_size", "(left, right) each ≥ 0, or −1 for unbounded", repr(tuple(window_size)))
    return wl, wr


def _no_dropout(op: str, dropout_p: float) -> None:
    if dropout_p != 0.0:
        _fail(op, "dropout_p", "0.0 (attention dropout is not implemented)", repr(dropout_p))


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """flash-attn's ``flash_attn_func``: q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]`` (Hkv divides
    Hq: GQA/MQA); returns out ``[B, Sq, Hq, D]`` (and lse ``[B, Hq, Sq]`` with ``return_lse``)."""
    op = "ferrite.flash_attn_func"
    _no_dropout(op, dropout_p)
    wl, wr = _window(op, window_size)
    o, lse = eager.attention(
        q, k, v, None, None, 0, 0, "bshd", softmax_scale, bool(causal), wl, wr, float(softcap), bool(deterministic)
    )
    return (o, lse) if return_lse else o


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """flash-attn's ``flash_attn_varlen_func``: sequences packed along dim 0 (q ``[total_q, Hq,
    D]``), ``cu_seqlens_*`` int32 ``[B+1]`` on q's device."""
    op = "ferrite.flash_attn_varlen_func"
    _no_dropout(op, dropout_p)
    wl, wr = _window(op, window_size)
    if cu_seqlens_q is None or cu_seqlens_k is None:
        _fail(op, "cu_seqlens_q" if cu_seqlens_q is None else "cu_seqlens_k", "an int32 tensor [B+1]", "None")
    o, lse = eager.attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        "bshd",
        softmax_scale,
        bool(causal),
        wl,
        wr,
        float(softcap),
        bool(deterministic),
    )
    return (o, lse) if return_lse else o


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` for 4-D ``[B, H, S, D]`` inputs
    without an explicit mask or dropout. ``is_causal`` is top-left aligned as in torch; ferrite
    supports it when Sq == Sk (where both alignments agree)."""
    op = "ferrite.scaled_dot_product_attention"
    if attn_mask is not None:
        _fail(op, "attn_mask", "None (use is_causal; explicit masks are not supported)", _describe(attn_mask))
    _no_dropout(op, dropout_p)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            _fail(op, name, "a 4-D tensor [B, H, S, D]", _describe(t) if isinstance(t, Tensor) else type(t).__name__)
    if is_causal and query.shape[2] != key.shape[2]:
        _fail(
            op,
            "is_causal",
            "equal query and key lengths (torch's top-left causal mask; ferrite's is bottom-right: "
            "use flash_attn_func for Sq ≠ Sk)",
            f"Sq = {query.shape[2]}, Sk = {key.shape[2]}",
        )
    if key.shape[1] != query.shape[1] and not enable_gqa:
        _fail(op, "key", f"{query.shape[1]} heads like query (or enable_gqa=True)", _describe(key))
    return eager.attention(
        query, key, value, None, None, 0, 0, "bhsd", scale, bool(is_causal), -1, -1, 0.0, False
    )[0]


# ----------------------------------------------------------------------------------------------
# packed q/k/v: the gradient written into one packed buffer


def _native_forward(q, k, v, scale, causal, wl, wr, softcap):
    """The bshd forward of q, k, v views (the packed ops)."""
    kw = _attn_kwargs(None, None, 0, 0, "bshd", scale, causal, wl, wr, softcap)
    return _forward(q, k, v, (q.shape[0], q.shape[2], q.shape[1]), kw)


def _native_backward(dout, q, k, v, o, lse, dq, dk, dv, scale, causal, wl, wr, softcap, deterministic):
    """dq, dk, dv: views with q's, k's and v's strides (into packed gradient buffers)."""
    if q.numel() == 0 or k.numel() == 0:
        for t in (dq, dk, dv):
            t.zero_()
        return
    dev, stream = _where(q)
    _native_call(
        _native.attention_backward,
        dout.contiguous(),
        q,
        k,
        v,
        o,
        lse,
        dq,
        dk,
        dv,
        **_attn_kwargs(None, None, 0, 0, "bshd", scale, causal, wl, wr, softcap),
        deterministic=deterministic,
        device=dev,
        stream=stream,
    )


def _packed_check(op: str, name: str, t: Tensor, n: int) -> None:
    _check_tensors(op, [(name, t)])
    if t.dim() != 5 or t.shape[2] != n:
        want = "[B, S, 3, H, D]" if n == 3 else "[B, S, 2, H_kv, D]"
        _fail(op, name, f"a 5-D tensor {want}", _describe(t))


def _rotary_tables(op, q, cos, sin):
    if (cos is None) != (sin is None):
        _fail(op, "rotary_sin" if sin is None else "rotary_cos", "a tensor (both or neither)", "None")


@torch.library.custom_op("ferrite::attention_qkvpacked", mutates_args=())
def _attention_qkvpacked(
    qkv: Tensor,
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    rotary_offset: int,
    rotary_interleaved: bool,
    scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    op = "ferrite.flash_attn_qkvpacked_func"
    _packed_check(op, "qkv", qkv, 3)
    _rotary_tables(op, qkv, rotary_cos, rotary_sin)
    qkv = qkv.contiguous()
    q, k, v = qkv.unbind(2)
    qk = qkv.new_empty((0,))
    if rotary_cos is not None:
        # q and k rotated into a packed buffer of their own (the backward attends over them too).
        b, s, _, h, d = qkv.shape
        qk = qkv.new_empty((b, s, 2, h, d))
        for i, t in enumerate((q, k)):
            _rotary_mod._run(t, rotary_cos, rotary_sin, qk[:, :, i], None, rotary_offset, None, rotary_interleaved, False)
        q, k = qk.unbind(2)
    o, lse = _native_forward(q, k, v, scale, causal, window_left, window_right, softcap)
    return o, lse, qk


@_attention_qkvpacked.register_fake
def _(qkv, rotary_cos, rotary_sin, rotary_offset, rotary_interleaved, scale, causal, window_left, window_right, softcap, deterministic):
    _packed_check("ferrite.flash_attn_qkvpacked_func", "qkv", qkv, 3)
    b, s, _, h, d = qkv.shape
    qk = qkv.new_empty((b, s, 2, h, d)) if rotary_cos is not None else qkv.new_empty((0,))
    return qkv.new_empty((b, s, h, d)), qkv.new_empty((b, h, s), dtype=torch.float32), qk


def _qkvpacked_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    qkv, cos, sin = inputs[:3]
    ctx.rot = inputs[3:5]
    ctx.args = inputs[5:]
    ctx.save_for_backward(qkv, cos, sin, output[0], output[1], output[2])


@torch.library.custom_op("ferrite::attention_qkvpacked_backward", mutates_args=())
def _attention_qkvpacked_backward(
    dout: Tensor,
    qkv: Tensor,
    rotary_cos: Optional[Tensor],
    rotary_sin: Optional[Tensor],
    o: Tensor,
    lse: Tensor,
    qk: Tensor,
    rotary_offset: int,
    rotary_interleaved: bool,
    scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> Tensor:
    args = (scale, causal, window_left, window_right, softcap, deterministic)
    qkv = qkv.contiguous()
    q, k, v = qkv.unbind(2)
    dqkv = torch.empty_like(qkv)
    dq, dk, dv = dqkv.unbind(2)
    if rotary_cos is None:
        _native_backward(dout, q, k, v, o, lse, dq, dk, dv, *args)
        return dqkv
    # Attention's gradient of the rotated q and k, then the rotation's gradient (the inverse
    # rotation) written into their packed slots.
    q, k = qk.unbind(2)
    dqk = torch.empty_like(qk)
    _native_backward(dout, q, k, v, o, lse, dqk[:, :, 0], dqk[:, :, 1], dv, *args)
    for i in range(2):
        _rotary_mod._run(dqk[:, :, i], rotary_cos, rotary_sin, dqkv[:, :, i], None, rotary_offset, None, rotary_interleaved, True)
    return dqkv


@_attention_qkvpacked_backward.register_fake
def _(dout, qkv, rotary_cos, rotary_sin, o, lse, qk, rotary_offset, rotary_interleaved, scale, causal, window_left, window_right, softcap, deterministic):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _qkvpacked_bwd(ctx, dout, _dlse, _dqk):
    if dout is None:
        return (None,) * 11
    qkv, cos, sin, o, lse, qk = ctx.saved_tensors
    dqkv = eager.attention_qkvpacked_backward(dout, qkv, cos, sin, o, lse, qk, *ctx.rot, *ctx.args)
    return (dqkv,) + (None,) * 10


_attention_qkvpacked.register_autograd(_qkvpacked_bwd, setup_context=_qkvpacked_setup)


@torch.library.custom_op("ferrite::attention_kvpacked", mutates_args=())
def _attention_kvpacked(
    q: Tensor,
    kv: Tensor,
    scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> Tuple[Tensor, Tensor]:
    op = "ferrite.flash_attn_kvpacked_func"
    _check_tensors(op, [("q", q)])
    if q.dim() != 4:
        _fail(op, "q", "a 4-D tensor [B, S, H, D]", _describe(q))
    _packed_check(op, "kv", kv, 2)
    k, v = kv.contiguous().unbind(2)
    return _native_forward(_last_contig(q), k, v, scale, causal, window_left, window_right, softcap)


@_attention_kvpacked.register_fake
def _(q, kv, scale, causal, window_left, window_right, softcap, deterministic):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32)


def _kvpacked_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.args = inputs[2:]
    ctx.save_for_backward(inputs[0], inputs[1], output[0], output[1])


@torch.library.custom_op("ferrite::attention_kvpacked_backward", mutates_args=())
def _attention_kvpacked_backward(
    dout: Tensor,
    q: Tensor,
    kv: Tensor,
    o: Tensor,
    lse: Tensor,
    scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool,
) -> Tuple[Tensor, Tensor]:
    q, kv = q.contiguous(), kv.contiguous()
    k, v = kv.unbind(2)
    dq, dkv = torch.empty_like(q), torch.empty_like(kv)
    _native_backward(dout, q, k, v, o, lse, dq, dkv[:, :, 0], dkv[:, :, 1], scale, causal, window_left, window_right, softcap, deterministic)
    return dq, dkv


@_attention_kvpacked_backward.register_fake
def _(dout, q, kv, o, lse, scale, causal, window_left, window_right, softcap, deterministic):
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(kv, memory_format=torch.contiguous_format),
    )


def _kvpacked_bwd(ctx, dout, _dlse):
    if dout is None:
        return (None,) * 8
    q, kv, o, lse = ctx.saved_tensors
    dq, dkv = eager.attention_kvpacked_backward(dout, q, kv, o, lse, *ctx.args)
    return (dq, dkv) + (None,) * 6


_attention_kvpacked.register_autograd(_kvpacked_bwd, setup_context=_kvpacked_setup)


def _packed_args(op: str, dropout_p: float, alibi_slopes, window_size) -> Tuple[int, int]:
    """The packed functions' checks of flash-attn's arguments ferrite does not implement; the window."""
    _no_dropout(op, dropout_p)
    if alibi_slopes is not None:
        _fail(op, "alibi_slopes", "None (ALiBi is not implemented)", _describe(alibi_slopes))
    return _window(op, window_size)


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    rotary_interleaved: bool = False,
    rotary_offset: int = 0,
):
    """flash-attn's ``flash_attn_qkvpacked_func``: qkv ``[B, S, 3, H, D]`` (a fused QKV projection
    viewed as such) → out ``[B, S, H, D]``. The backward writes one packed ``dqkv`` (no slicing
    of q/k/v, no concatenation of their gradients). With ``rotary_cos``/``rotary_sin``
    (``[S_ro, R/2]``, as for :func:`apply_rotary_emb`) q and k are rotated inside the op — the
    Llama/GPT-NeoX attention's prologue — and the gradient rotated back into ``dqkv``.
    ``return_attn_probs`` returns ``(out, lse)`` (the probabilities are never formed)."""
    wl, wr = _packed_args("ferrite.flash_attn_qkvpacked_func", dropout_p, alibi_slopes, window_size)
    o, lse, _ = eager.attention_qkvpacked(
        qkv, rotary_cos, rotary_sin, int(rotary_offset), bool(rotary_interleaved), softmax_scale, bool(causal), wl, wr, float(softcap), bool(deterministic)
    )
    return (o, lse) if return_attn_probs else o


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """flash-attn's ``flash_attn_kvpacked_func``: q ``[B, Sq, Hq, D]``, kv ``[B, Sk, 2, Hkv, D]``
    (GQA/MQA when Hkv < Hq); the backward writes one packed ``dkv``."""
    wl, wr = _packed_args("ferrite.flash_attn_kvpacked_func", dropout_p, alibi_slopes, window_size)
    o, lse = eager.attention_kvpacked(q, kv, softmax_scale, bool(causal), wl, wr, float(softcap), bool(deterministic))
    return (o, lse) if return_attn_probs else o


# ----------------------------------------------------------------------------------------------
# paged decode


def _decode_check(op, q, key_cache, value_cache, block_table, seq_lens):
    _check_tensors(op, [("q", q), ("key_cache", key_cache), ("value_cache", value_cache)])
    if q.dim() != 3:
        _fail(op, "q", "a 3-D tensor [B, Hq, D] (one new token per sequence)", _describe(q))
    _check_index(op, "block_table", block_table, q, 2)
    _check_index(op, "seq_lens", seq_lens, q, 1)


def _check_plan(op: str, plan: Optional[Tensor], like: Tensor) -> None:
    if plan is None:
        return
    if not isinstance(plan, Tensor) or plan.dtype != torch.int32 or plan.dim() != 1:
        got = _describe(plan) if isinstance(plan, Tensor) else type(plan).__name__
        _fail(op, "plan", "the int32 plan tensor made by paged_decode_plan", got)
    if plan.device != like.device:
        _fail(op, "plan", f"a plan on {like.device} (like `q`)", _describe(plan))


def _decode_run(op, q, key_cache, value_cache, block_table, seq_lens, plan, scale, softcap, window_left, variant):
    _decode_check(op, q, key_cache, value_cache, block_table, seq_lens)
    _check_plan(op, plan, q)
    o = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:2], dtype=torch.float32)
    dev, stream = _where(q)
    _native_call(
        _native.paged_decode,
        q.contiguous(),
        key_cache,
        value_cache,
        block_table.contiguous(),
        seq_lens.contiguous(),
        o,
        lse=lse,
        scale=scale,
        softcap=float(softcap),
        window_left=int(window_left),
        device=dev,
        stream=stream,
        variant=variant,
        plan=plan,
    )
    return o, lse


@torch.library.custom_op("ferrite::paged_decode", mutates_args=())
def _paged_decode(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: Optional[float],
    softcap: float,
    window_left: int,
    variant: Optional[str] = None,
) -> Tuple[Tensor, Tensor]:
    op = "ferrite.paged_decode"
    return _decode_run(op, q, key_cache, value_cache, block_table, seq_lens, None, scale, softcap, window_left, variant)


@_paged_decode.register_fake
def _(q, key_cache, value_cache, block_table, seq_lens, scale, softcap, window_left, variant=None):
    _decode_check("ferrite.paged_decode", q, key_cache, value_cache, block_table, seq_lens)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


# The planned run is an op of its own rather than an optional `plan` of ferrite::paged_decode:
# torch (2.11) drops a trailing argument equal to its default before the ADInplaceOrView kernel
# of a mutating custom op indexes the mutated arguments, so an optional mutated `plan=None` fails
# with an IndexError; and a mutating op never takes the eager fast path (_eager.py), which the
# unplanned decode keeps this way.
@torch.library.custom_op("ferrite::paged_decode_planned", mutates_args=("plan",))
def _paged_decode_planned(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    plan: Tensor,
    scale: Optional[float],
    softcap: float,
    window_left: int,
    variant: Optional[str] = None,
) -> Tuple[Tensor, Tensor]:
    op = "ferrite.paged_decode"
    if plan is None:
        _fail(op, "plan", "the int32 plan tensor made by paged_decode_plan", "None")
    return _decode_run(op, q, key_cache, value_cache, block_table, seq_lens, plan, scale, softcap, window_left, variant)


@_paged_decode_planned.register_fake
def _(q, key_cache, value_cache, block_table, seq_lens, plan, scale, softcap, window_left, variant=None):
    _decode_check("ferrite.paged_decode", q, key_cache, value_cache, block_table, seq_lens)
    _check_plan("ferrite.paged_decode", plan, q)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


def paged_decode(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    window_left: int = -1,
    return_lse: bool = False,
    plan: Optional[Tensor] = None,
    variant: Optional[str] = None,
):
    """Attention of one new query token per sequence over a paged KV cache (vLLM's layout):
    q ``[B, Hq, D]``, caches ``[num_blocks, block_size, Hkv, D]``, ``block_table`` int32
    ``[B, max_blocks]``, ``seq_lens`` int32 ``[B]`` (tokens in the cache, the new one included).
    Block-table entries and lengths are checked (on the GPU through a device flag: a bad entry is
    an error, never an out-of-bounds read). Returns out ``[B, Hq, D]`` (and lse ``[B, Hq]``).

    ``plan``: a plan from :func:`paged_decode_plan` for this batch shape, made with the same
    ``window_left`` and ``variant``. The call then only launches the kernels — no host sync, so a
    whole decode step (plan included) can be captured in a CUDA graph — and a bad entry or length
    sets the plan's error flag instead of raising: :func:`paged_decode_errors` reports it.
    Without a plan every call plans for itself and reads the flag back (one sync per call).
    ``variant``: a named decode variant (``ferrite.variants("decode")``), else the best."""
    args = (q, key_cache, value_cache, block_table, seq_lens)
    opts = (softmax_scale, float(softcap), int(window_left), None if variant is None else str(variant))
    if plan is None:
        o, lse = eager.paged_decode(*args, *opts)
    else:
        o, lse = eager.paged_decode_planned(*args, plan, *opts)
    return (o, lse) if return_lse else o


def _check_plan_lens(op: str, seq_lens: Tensor) -> None:
    if not isinstance(seq_lens, Tensor) or seq_lens.dtype != torch.int32 or seq_lens.dim() != 1:
        got = _describe(seq_lens) if isinstance(seq_lens, Tensor) else type(seq_lens).__name__
        _fail(op, "seq_lens", "an int32 tensor [B]", got)
    if seq_lens.device.type not in ("cpu", "cuda"):
        _fail(op, "seq_lens", "a CPU or CUDA tensor", _describe(seq_lens))


_PLAN_NUMEL = {}


def _plan_numel(batch: int, hq: int, hkv: int, d: int, dtype: str, window_left: int, variant: Optional[str], device: int) -> int:
    """Elements of the plan tensor: a pure function of its arguments (and the device's SM count),
    so cached (the native call prepares the kernels) and traced as a constant."""
    key = (batch, hq, hkv, d, dtype, window_left, variant, device)
    n = _PLAN_NUMEL.get(key)
    if n is not None:
        return n
    stream = 0
    if device >= 0:
        stream = _raw_stream(device) if _raw_stream is not None else torch.cuda.current_stream(device).cuda_stream
    n = _native.paged_decode_plan_numel(
        batch, hq, hkv, d, dtype, window_left=window_left, device=device, stream=stream, variant=variant
    )
    if len(_PLAN_NUMEL) < 4096:
        _PLAN_NUMEL[key] = n
    return n


_assume_constant = getattr(getattr(torch, "_dynamo", None), "assume_constant_result", None)
if _assume_constant is not None:
    _plan_numel = _assume_constant(_plan_numel)


@torch.library.custom_op("ferrite::paged_decode_plan", mutates_args=())
def _paged_decode_plan(
    seq_lens: Tensor,
    numel: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str,
    window_left: int,
    variant: Optional[str],
) -> Tensor:
    op = "ferrite.paged_decode_plan"
    _check_plan_lens(op, seq_lens)
    plan = seq_lens.new_empty((numel,))
    dev, stream = _where(seq_lens)
    if dev < 0:
        plan.zero_()  # the CPU keeps no schedule (every run checks on the host): defined contents
    _native_call(
        _native.paged_decode_plan,
        seq_lens.contiguous(),
        plan,
        num_q_heads,
        num_kv_heads,
        head_dim,
        dtype,
        window_left=window_left,
        device=dev,
        stream=stream,
        variant=variant,
    )
    return plan


@_paged_decode_plan.register_fake
def _(seq_lens, numel, num_q_heads, num_kv_heads, head_dim, dtype, window_left, variant):
    _check_plan_lens("ferrite.paged_decode_plan", seq_lens)
    return seq_lens.new_empty((numel,), dtype=torch.int32)


def paged_decode_plan(
    seq_lens: Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    window_left: int = -1,
    variant: Optional[str] = None,
) -> Tensor:
    """Plans the decode of a batch for :func:`paged_decode` (FlashInfer-style plan/run): returns
    the int32 plan tensor, on ``seq_lens``' device, holding the key-split schedule of the batch
    whose lengths are ``seq_lens`` (int32 ``[B]``) for q ``[B, num_q_heads, head_dim]`` and caches
    of ``num_kv_heads`` heads, all of ``dtype``.

    Plan once per batch composition (once per decode step), then run every layer on it:
    ``paged_decode(..., plan=plan)`` with the same ``window_left`` and ``variant``. Planning reads
    the lengths on the device and neither planning nor running syncs with the host, so the whole
    step (plan and runs) can be captured in a CUDA graph. The lengths may change after planning
    (e.g. updated in place before a graph replay): every key is still covered, only the balance
    of the split suffers. A plan for another batch shape (B, heads, head dim, dtype, device,
    variant) is refused. Errors of the runs (a bad length or block-table entry) accumulate in the
    plan until :func:`paged_decode_errors` reads them; planning again clears them."""
    op = "ferrite.paged_decode_plan"
    _check_plan_lens(op, seq_lens)
    if dtype not in _DTYPE_NAMES:
        _fail(op, "dtype", f"{_FLOATS} (q's and the caches' dtype)", repr(dtype))
    hq, hkv, d, wl = int(num_q_heads), int(num_kv_heads), int(head_dim), int(window_left)
    name = _DTYPE_NAMES[dtype]
    variant = None if variant is None else str(variant)
    device = seq_lens.device.index if seq_lens.device.type == "cuda" else -1
    numel = _plan_numel(int(seq_lens.shape[0]), hq, hkv, d, name, wl, variant, device)
    return eager.paged_decode_plan(seq_lens, numel, hq, hkv, d, name, wl, variant)


def paged_decode_errors(plan: Tensor) -> None:
    """Raises the error that the :func:`paged_decode` runs on ``plan`` flagged since it was
    planned (a length or block-table entry out of range: ``ValueError``, as an unplanned call
    raises), and clears the flag. Waits for the current stream (one host sync); call it where a
    sync is acceptable, e.g. once per step after the graph replay. A no-op on the CPU, where every
    run checks on the host and raises at once."""
    op = "ferrite.paged_decode_errors"
    if not isinstance(plan, Tensor) or plan.dtype != torch.int32 or plan.dim() != 1:
        got = _describe(plan) if isinstance(plan, Tensor) else type(plan).__name__
        _fail(op, "plan", "the int32 plan tensor made by paged_decode_plan", got)
    dev, stream = _where(plan)
    _native_call(_native.paged_decode_plan_errors, plan, device=dev, stream=stream)


def _append_kv_check(k: Tensor, v: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    """What append_kv can check from the tensors' metadata alone: run by the op and by its fake,
    so a traced or meta call refuses what an eager one would (the slot values are checked by the
    native call)."""
    op = "ferrite.append_kv"
    _check_tensors(op, [("key_cache", key_cache), ("value_cache", value_cache), ("k", k), ("v", v)])
    _check_index(op, "slot_mapping", slot_mapping, key_cache, 1)
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dim() != 4:
            _fail(op, name, "a 4-D [num_blocks, block_size, Hkv, D] tensor", _describe(c))
        if not c.is_contiguous():
            _fail(op, name, "a contiguous cache (written in place)", _describe(c))
    if value_cache.shape != key_cache.shape:
        _fail(op, "value_cache", f"the shape of `key_cache` {list(key_cache.shape)}", _describe(value_cache))
    t = k.shape[0] if k.dim() > 0 else 0
    row = [t, key_cache.shape[2], key_cache.shape[3]]
    for name, x in (("k", k), ("v", v)):
        if list(x.shape) != row:
            _fail(op, name, f"shape [T, Hkv, D] = {row} (Hkv, D of the caches)", _describe(x))
    if list(slot_mapping.shape) != [t]:
        _fail(op, "slot_mapping", f"shape [T] = [{t}] (one slot per token of `k`)", _describe(slot_mapping))


@torch.library.custom_op("ferrite::append_kv", mutates_args=("key_cache", "value_cache"))
def _append_kv(k: Tensor, v: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    _append_kv_check(k, v, key_cache, value_cache, slot_mapping)
    dev, stream = _where(key_cache)
    _native_call(
        _native.append_kv,
        k.contiguous(),
        v.contiguous(),
        key_cache,
        value_cache,
        slot_mapping.contiguous(),
        device=dev,
        stream=stream,
    )


@_append_kv.register_fake
def _(k, v, key_cache, value_cache, slot_mapping):
    _append_kv_check(k, v, key_cache, value_cache, slot_mapping)
    return None


def append_kv(k: Tensor, v: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor) -> None:
    """Writes k, v ``[T, Hkv, D]`` into the paged caches in place at ``slot_mapping`` (int32
    ``[T]``: slot = block · block_size + offset; −1 skips the token)."""
    torch.ops.ferrite.append_kv(k, v, key_cache, value_cache, slot_mapping)
