"""Rotary embeddings (flash-attn's apply_rotary_emb), packed q/k/v attention with the gradient
written into one packed buffer, and cross-entropy's incoming gradient folded in place — on the
CPU, and on CUDA when present."""

import pytest
import torch
import torch.nn.functional as F

import ferrite
from conftest import HAS_CUDA
from helpers import close, grads_vs_torch

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def tables(ro, half, dtype, device, base=10000.0):
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = torch.arange(ro, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)


def rotary_ref(x, cos, sin, interleaved=False, offsets=0):
    """Reference on [B, S, H, D]: offsets an int or a list per sequence."""
    b, s = x.shape[:2]
    half = cos.shape[1]
    offs = offsets if isinstance(offsets, list) else [offsets] * b
    idx = torch.tensor([[o + i for i in range(s)] for o in offs], dtype=torch.long, device=x.device)
    c = cos.to(x.dtype)[idx][:, :, None, :]
    sn = sin.to(x.dtype)[idx][:, :, None, :]
    out = x.clone()
    if interleaved:
        x0, x1 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2] = x0 * c - x1 * sn
        out[..., 1 : 2 * half : 2] = x1 * c + x0 * sn
    else:
        x0, x1 = x[..., :half], x[..., half : 2 * half]
        out[..., :half] = x0 * c - x1 * sn
        out[..., half : 2 * half] = x1 * c + x0 * sn
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 40])
def test_apply_rotary_emb_matches_reference_with_gradients(device, dtype, interleaved, rotary_dim):
    x = torch.randn(2, 13, 3, 64, dtype=dtype, device=device, requires_grad=True)
    cos, sin = tables(20, rotary_dim // 2, dtype, device)
    grads_vs_torch(
        lambda x: ferrite.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=5),
        lambda x: rotary_ref(x, cos.double(), sin.double(), interleaved, 5),
        [x],
    )


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_offsets_per_sequence_packed_and_in_place(device):
    dtype = torch.bfloat16
    cos, sin = tables(40, 32, dtype, device)
    x = torch.randn(3, 9, 2, 64, dtype=dtype, device=device)
    offs = [0, 7, 30]
    want = rotary_ref(x.double(), cos.double(), sin.double(), False, offs)
    t = torch.tensor(offs, dtype=torch.int32, device=device)
    close(ferrite.apply_rotary_emb(x, cos, sin, seqlen_offsets=t), want.to(dtype))
    # Packed by cu_seqlens, ragged with an empty sequence: each sequence restarts at position 0.
    lens = [5, 0, 9, 1]
    seqs = [torch.randn(n, 2, 64, dtype=dtype, device=device) for n in lens]
    packed = torch.cat(seqs)
    cu = torch.tensor([0, 5, 5, 14, 15], dtype=torch.int32, device=device)
    got = ferrite.apply_rotary_emb(packed, cos, sin, cu_seqlens=cu, max_seqlen=9)
    want = torch.cat([rotary_ref(s[None].double(), cos.double(), sin.double())[0] for s in seqs])
    close(got, want.to(dtype))
    # In place on a strided view (k of a packed QKV buffer): only k changes.
    qkv = torch.randn(2, 9, 3, 2, 64, dtype=dtype, device=device)
    before = qkv.clone()
    k = qkv[:, :, 1]
    out = ferrite.apply_rotary_emb(k, cos, sin, inplace=True)
    assert out.data_ptr() == k.data_ptr()
    close(qkv[:, :, 1], rotary_ref(before[:, :, 1].double(), cos.double(), sin.double()).to(dtype))
    assert torch.equal(qkv[:, :, 0], before[:, :, 0]) and torch.equal(qkv[:, :, 2], before[:, :, 2])


def test_rotary_bad_input_names_the_argument():
    cos, sin = tables(8, 4, torch.float32, "cpu")
    x = torch.randn(1, 9, 2, 8)
    with pytest.raises(ValueError, match="cos"):  # 9 positions, 8 rows of tables
        ferrite.apply_rotary_emb(x, cos, sin)
    with pytest.raises(ValueError, match="seqlen_offsets"):
        ferrite.apply_rotary_emb(x[:, :4], cos, sin, seqlen_offsets=-1)
    with pytest.raises(ValueError, match="sin"):
        ferrite.apply_rotary_emb(x[:, :4], cos, sin.double())
    with pytest.raises(ValueError, match="x"):
        ferrite.apply_rotary_emb(x[0], cos, sin)


@pytest.mark.parametrize("device", DEVICES)
def test_qkvpacked_and_kvpacked_match_unpacked_attention(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    qkv = torch.randn(2, 33, 3, 4, 64, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(2, 33, 4, 64, dtype=dtype, device=device)
    o = ferrite.flash_attn_qkvpacked_func(qkv, causal=True)
    (d,) = torch.autograd.grad(o, qkv, g)
    q, k, v = qkv.unbind(2)
    o2 = ferrite.flash_attn_func(q, k, v, causal=True)
    (d2,) = torch.autograd.grad(o2, qkv, g)
    assert torch.equal(o, o2)
    close(d, d2)
    # With the rotation inside the op, and its gradient rotated back into dqkv.
    cos, sin = tables(40, 32, dtype, device)
    o = ferrite.flash_attn_qkvpacked_func(qkv, causal=True, rotary_cos=cos, rotary_sin=sin, rotary_offset=3)
    (d,) = torch.autograd.grad(o, qkv, g)
    rot = lambda t: ferrite.apply_rotary_emb(t, cos, sin, seqlen_offsets=3)  # noqa: E731
    o2 = ferrite.flash_attn_func(rot(q), rot(k), v, causal=True)
    (d2,) = torch.autograd.grad(o2, qkv, g)
    close(o, o2)
    close(d, d2)
    # GQA through kvpacked.
    qq = torch.randn(2, 17, 4, 64, dtype=dtype, device=device, requires_grad=True)
    kv = torch.randn(2, 21, 2, 2, 64, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(2, 17, 4, 64, dtype=dtype, device=device)
    o = ferrite.flash_attn_kvpacked_func(qq, kv, causal=True)
    a = torch.autograd.grad(o, (qq, kv), g)
    o2 = ferrite.flash_attn_func(qq, *kv.unbind(2), causal=True)
    b = torch.autograd.grad(o2, (qq, kv), g)
    assert torch.equal(o, o2)
    for x, y in zip(a, b):
        close(x, y)


def test_packed_ops_pass_opcheck():
    qkv = torch.randn(1, 9, 3, 2, 16, requires_grad=True)
    cos, sin = tables(9, 8, torch.float32, "cpu")
    ops = torch.ops.ferrite
    torch.library.opcheck(ops.attention_qkvpacked.default, (qkv, cos, sin, 0, False, None, True, -1, -1, 0.0, False))
    torch.library.opcheck(ops.attention_qkvpacked.default, (qkv, None, None, 0, False, None, False, -1, -1, 0.0, False))
    q = torch.randn(1, 9, 2, 16, requires_grad=True)
    kv = torch.randn(1, 5, 2, 1, 16, requires_grad=True)
    torch.library.opcheck(ops.attention_kvpacked.default, (q, kv, None, False, -1, -1, 0.0, False))
    x = torch.randn(2, 9, 2, 16, requires_grad=True)
    torch.library.opcheck(ops.rotary.default, (x, cos, sin, None, 0, None, True, False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_folds_the_incoming_gradient(device, reduction):
    x = torch.randn(7, 301, device=device, requires_grad=True)
    t = torch.randint(0, 301, (7,), device=device)
    for scale in (1.0, -0.375):
        loss = ferrite.cross_entropy(x, t, reduction=reduction)
        g = torch.full_like(loss, scale) if reduction != "none" else torch.rand_like(loss) + scale
        (a,) = torch.autograd.grad(loss, x, g)
        (b,) = torch.autograd.grad(F.cross_entropy(x, t, reduction=reduction), x, g)
        close(a, b)
    loss = ferrite.cross_entropy(x, t, reduction=reduction).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
