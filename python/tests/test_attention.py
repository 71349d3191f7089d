"""Attention on the CPU: flash_attn_func / varlen / SDPA signatures against a float64 reference
(bottom-right causal masks, sliding windows, GQA, soft-capping), their gradients, paged decode and
the cache append, and the nn modules built on them."""

import math

import pytest
import torch
import torch.nn.functional as F

import ferrite
from helpers import close, leaf


def reference(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """[B, Sq, H, D] attention in float64 with flash-attn's mask conventions (bottom-right)."""
    q, k, v = q.double(), k.double(), v.double()
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    scale = 1 / math.sqrt(d) if scale is None else scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    off = sk - sq
    wl, wr = window
    if causal:
        wr = 0
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if wr >= 0:
        vis &= j <= i + off + wr
    if wl >= 0:
        vis &= j >= i + off - wl
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows that see nothing: zeros
    return torch.einsum("bhij,bjhd->bihd", p, v)


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_(True)


def check_fwd_bwd(fer, ref, inputs, tol_scale=1.0):
    ins_f = [leaf(t) for t in inputs]
    ins_t = [leaf(t.double()) for t in inputs]
    out_f, out_t = fer(*ins_f), ref(*ins_t)
    close(out_f, out_t.to(out_f.dtype), scale=tol_scale)
    g = torch.randn_like(out_f)
    out_f.backward(g)
    out_t.backward(g.double())
    for a, b in zip(ins_f, ins_t):
        close(a.grad, b.grad.to(a.dtype), scale=tol_scale)


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, causal, window, softcap)
    (2, 17, 17, 4, 4, 32, False, (-1, -1), 0.0),
    (2, 33, 33, 4, 2, 64, True, (-1, -1), 0.0),
    (1, 13, 40, 6, 2, 16, True, (-1, -1), 0.0),  # Sq < Sk: bottom-right causal
    (1, 40, 13, 3, 1, 16, True, (-1, -1), 0.0),  # Sq > Sk: leading rows see nothing
    (2, 29, 29, 4, 1, 32, False, (5, 3), 0.0),  # sliding window, MQA
    (1, 24, 24, 2, 2, 48, True, (7, -1), 30.0),  # causal window + soft-cap
]


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,causal,window,softcap", CASES)
def test_flash_attn_func(b, sq, sk, hq, hkv, d, causal, window, softcap):
    q, k, v = r(b, sq, hq, d), r(b, sk, hkv, d), r(b, sk, hkv, d)
    check_fwd_bwd(
        lambda q, k, v: ferrite.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap),
        lambda q, k, v: reference(q, k, v, causal, window, softcap),
        [q, k, v],
        tol_scale=2,
    )


def test_flash_attn_lse_and_scale():
    q, k, v = r(1, 9, 2, 16), r(1, 11, 2, 16), r(1, 11, 2, 16)
    o, lse = ferrite.flash_attn_func(q, k, v, softmax_scale=0.3, return_lse=True)
    close(o, reference(q, k, v, scale=0.3).float())
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * 0.3
    close(lse, torch.logsumexp(s, -1).float())
    assert lse.shape == (1, 2, 9) and lse.dtype == torch.float32


def test_flash_attn_strided_qkv_views():
    """q, k, v as views of one packed QKV buffer (no copies needed: last dim contiguous)."""
    qkv = r(2, 19, 3, 4, 32)
    check_fwd_bwd(
        lambda t: ferrite.flash_attn_func(t[:, :, 0], t[:, :, 1], t[:, :, 2], causal=True),
        lambda t: reference(t[:, :, 0], t[:, :, 1], t[:, :, 2], causal=True),
        [qkv],
    )


def test_flash_attn_16bit_cpu():
    q, k, v = (torch.randn(1, 21, 2, 32).bfloat16() for _ in range(3))
    close(ferrite.flash_attn_func(q, k, v, causal=True), reference(q, k, v, causal=True).bfloat16())


def test_varlen_matches_per_sequence():
    lens_q, lens_k = [5, 17, 1, 9], [7, 17, 4, 9]
    hq, hkv, d = 4, 2, 32
    q, k, v = r(sum(lens_q), hq, d), r(sum(lens_k), hkv, d), r(sum(lens_k), hkv, d)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)

    def fer(q, k, v):
        return ferrite.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)

    def ref(q, k, v):
        outs = []
        for i in range(len(lens_q)):
            qs = q[cu_q[i] : cu_q[i + 1]].unsqueeze(0)
            ks = k[cu_k[i] : cu_k[i + 1]].unsqueeze(0)
            vs = v[cu_k[i] : cu_k[i + 1]].unsqueeze(0)
            outs.append(reference(qs, ks, vs, causal=True)[0])
        return torch.cat(outs)

    check_fwd_bwd(fer, ref, [q, k, v])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_signature(causal, gqa):
    hkv = 2 if gqa else 4
    q, k, v = r(2, 4, 23, 32), r(2, hkv, 23, 32), r(2, hkv, 23, 32)
    check_fwd_bwd(
        lambda q, k, v: ferrite.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
        [q, k, v],
    )


def test_attention_bad_input():
    q = torch.randn(1, 8, 4, 32)
    with pytest.raises(ValueError, match=r"argument `k`: expected a kv head count dividing the 4 query heads"):
        ferrite.flash_attn_func(q, torch.randn(1, 8, 3, 32), torch.randn(1, 8, 3, 32))
    with pytest.raises(ValueError, match=r"argument `window_size`: expected \(left, right\) each ≥ 0"):
        ferrite.flash_attn_func(q, q, q, window_size=(-3, 0))
    with pytest.raises(ValueError, match=r"argument `dropout_p`: expected 0.0"):
        ferrite.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"argument `attn_mask`"):
        ferrite.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"argument `is_causal`: expected equal query and key lengths"):
        ferrite.scaled_dot_product_attention(q, torch.randn(1, 4, 9, 32), torch.randn(1, 4, 9, 32), is_causal=True)
    with pytest.raises(ValueError, match=r"argument `cu_seqlens_q`: expected an int32 tensor of rank 1"):
        ferrite.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 8]), torch.tensor([0, 8], dtype=torch.int32), 8, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens"):
        cu = torch.tensor([0, 5, 9], dtype=torch.int32)  # ends at 9, but q holds 8 tokens
        ferrite.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 5, 5)


# ---- paged decode --------------------------------------------------------------------------------


def paged_setup(lens, hq=8, hkv=2, d=32, bs=4, dtype=torch.float32):
    torch.manual_seed(5)
    b = len(lens)
    max_blocks = max((n + bs - 1) // bs for n in lens)
    num_blocks = b * max_blocks + 3
    perm = torch.randperm(num_blocks)
    table = torch.full((b, max_blocks), num_blocks + 100, dtype=torch.int32)  # unused: out of range
    k_cache = torch.randn(num_blocks, bs, hkv, d, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, dtype=dtype)
    n = 0
    for i, ln in enumerate(lens):
        for blk in range((ln + bs - 1) // bs):
            table[i, blk] = int(perm[n])
            n += 1
    q = torch.randn(b, hq, d, dtype=dtype)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


def gather(cache, table, ln, bs):
    rows = [cache[table[t // bs], t % bs] for t in range(ln)]
    return torch.stack(rows)  # [ln, Hkv, D]


@pytest.mark.parametrize("window", [-1, 6])
def test_paged_decode(window):
    lens, bs = [1, 9, 23, 16], 4
    q, kc, vc, table, seq_lens = paged_setup(lens, bs=bs)
    o, lse = ferrite.paged_decode(q, kc, vc, table, seq_lens, window_left=window, return_lse=True)
    for i, ln in enumerate(lens):
        k = gather(kc, table[i], ln, bs).unsqueeze(0)
        v = gather(vc, table[i], ln, bs).unsqueeze(0)
        ref = reference(q[i].view(1, 1, *q.shape[1:]), k, v, window=(window, -1))[0, 0]
        close(o[i], ref.float())
    assert lse.shape == (4, 8)


def test_paged_decode_bad_table():
    q, kc, vc, table, seq_lens = paged_setup([5, 9])
    table[1, 1] = 10_000
    with pytest.raises(ValueError, match="block_table"):
        ferrite.paged_decode(q, kc, vc, table, seq_lens)


def test_append_kv_then_decode():
    bs, hkv, d = 4, 2, 16
    kc = torch.randn(6, bs, hkv, d)
    vc = torch.randn(6, bs, hkv, d)
    before_k = kc.clone()
    k, v = torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    slots = torch.tensor([5, -1, 22], dtype=torch.int32)
    ferrite.append_kv(k, v, kc, vc, slots)
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(vc[5, 2], v[2]) and torch.equal(kc[5, 2], k[2])
    untouched = torch.ones(6, bs, dtype=torch.bool)
    untouched[1, 1] = untouched[5, 2] = False
    assert torch.equal(kc[untouched], before_k[untouched])
    with pytest.raises(ValueError, match="slot_mapping"):
        ferrite.append_kv(k, v, kc, vc, torch.tensor([0, 1, 24], dtype=torch.int32))


# ---- modules --------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_swap(batch_first):
    torch.manual_seed(2)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=batch_first)
    x = torch.randn(2, 15, 64) if batch_first else torch.randn(15, 2, 64)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(15)
    want = mha(x, x, x, need_weights=False, attn_mask=mask, is_causal=True)[0]
    want_full = mha(x, x, x, need_weights=False)[0]
    swapped = ferrite.optimize(mha)
    assert swapped == [("", "torch.nn.modules.activation.MultiheadAttention", "ferrite.nn.MultiheadAttention")]
    close(mha(x, x, x, need_weights=False, attn_mask=mask, is_causal=True)[0], want)
    close(mha(x, x, x, need_weights=False)[0], want_full)
    # need_weights=True runs torch's path and still returns the weights
    out, w = mha(x, x, x)
    assert w is not None


def test_transformer_encoder_layer_optimized_trains():
    torch.manual_seed(4)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    ref = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    ref.load_state_dict(layer.state_dict())
    names = [n for n, _, _ in ferrite.optimize(layer)]
    assert "self_attn" in names and "linear1" in names and "norm1" in names
    x = torch.randn(3, 11, 32)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(11)
    ya = layer(x, src_mask=mask, is_causal=True)
    yb = ref(x, src_mask=mask, is_causal=True)
    close(ya, yb)
    ya.sum().backward()
    yb.sum().backward()
    close(layer.self_attn.in_proj_weight.grad, ref.self_attn.in_proj_weight.grad, scale=5)


def test_swiglu_and_causal_self_attention_modules():
    torch.manual_seed(6)
    mlp = ferrite.nn.SwiGLU(24, 40)
    x = torch.randn(2, 5, 24)
    h = F.linear(x, mlp.gate_up.weight)
    gate, up = h.chunk(2, -1)
    close(mlp(x), F.linear(F.silu(gate) * up, mlp.down.weight))

    attn = ferrite.nn.CausalSelfAttention(32, 4, kv_heads=2, window=5)
    x = torch.randn(2, 13, 32)
    qkv = F.linear(x, attn.qkv.weight)
    q, k, v = qkv.split([32, 16, 16], -1)
    o = reference(q.view(2, 13, 4, 8), k.view(2, 13, 2, 8), v.view(2, 13, 2, 8), causal=True, window=(5, -1))
    close(attn(x), F.linear(o.reshape(2, 13, 32).float(), attn.proj.weight))
    with pytest.raises(ValueError, match="kv_heads dividing heads"):
        ferrite.nn.CausalSelfAttention(32, 4, kv_heads=3)
