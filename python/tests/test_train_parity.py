"""The Rust trainer's GPT-2 and Llama against plain-PyTorch references of the same models.

ferrite's model (`ferrite::train::Model`, through `ferrite._native.gpt2_train_steps`) and a float64
PyTorch model built from the same initial weights train on the same token batches: the losses, every
parameter tensor's gradient at step 0, and the weights after 10 AdamW steps must agree. On the CPU
ferrite runs in f32; on a GPU in bf16 with f32 master weights (looser bounds).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from ferrite import _native

from conftest import requires_cuda

CFG = dict(vocab=203, max_seq=40, layers=2, heads=4, dim=64)
LLAMA = dict(kv_heads=2, ffn=96, theta=10000.0)
B, T, STEPS = 3, 33, 10
LR, WD, CLIP = 2e-3, 0.1, 1.0


def batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG["vocab"], (B * (T + 1),), generator=g, dtype=torch.int32).tolist()
            for _ in range(STEPS)]


def unflatten(flat, layout):
    flat = torch.tensor(flat, dtype=torch.float64)
    return {name: flat[off:off + math.prod(shape)].view(*shape).clone() for name, off, shape in layout}


def flatten_like(p, layout, total):
    out = torch.zeros(total, dtype=torch.float64)
    for name, off, shape in layout:
        out[off:off + math.prod(shape)] = p[name].detach().reshape(-1)
    return out


def rope(x, theta):
    """Llama's rotary embedding on [B, T, H, D] (element i pairs with i + D/2)."""
    d = x.shape[-1]
    pos = torch.arange(x.shape[1], dtype=torch.float64)
    inv = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def llama_loss_of(p, tok):
    """Llama as ferrite computes it: RMSNorm, rotary q/k, grouped-query attention, SwiGLU, untied
    classifier over the padded table, no biases."""
    C, H, L, V = CFG["dim"], CFG["heads"], CFG["layers"], CFG["vocab"]
    Hk, D, f = LLAMA["kv_heads"], CFG["dim"] // CFG["heads"], LLAMA["ffn"]
    x_ids, y = tok[:, :-1], tok[:, 1:]
    x = p["wte"][x_ids]
    for i in range(L):
        q = lambda n: p[f"h{i}.{n}"]  # noqa: E731
        h = F.rms_norm(x, (C,), q("ln1_w"), 1e-5)
        qkv = h @ q("qkv_w").T
        qq, kk, vv = qkv.split([H * D, Hk * D, Hk * D], -1)
        qq = rope(qq.view(B, T, H, D), LLAMA["theta"]).transpose(1, 2)
        kk = rope(kk.view(B, T, Hk, D), LLAMA["theta"]).transpose(1, 2)
        vv = vv.view(B, T, Hk, D).transpose(1, 2)
        att = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        x = x + att.transpose(1, 2).reshape(B, T, C) @ q("proj_w").T
        h = F.rms_norm(x, (C,), q("ln2_w"), 1e-5)
        gate, up = (h @ q("fc_w").T).split(f, -1)
        x = x + (F.silu(gate) * up) @ q("fcproj_w").T
    x = F.rms_norm(x, (C,), p["lnf_w"], 1e-5)
    logits = (x @ p["head"].T)[..., :V]
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1).long())


def loss_of(p, tok):
    """GPT-2 as ferrite computes it: pre-norm blocks, tanh GELU, tied classifier over the padded
    embedding table with the logits cut to the vocabulary."""
    C, H, L, V = CFG["dim"], CFG["heads"], CFG["layers"], CFG["vocab"]
    x_ids, y = tok[:, :-1], tok[:, 1:]
    x = p["wte"][x_ids] + p["wpe"][:T]
    for i in range(L):
        q = lambda n: p[f"h{i}.{n}"]  # noqa: E731
        h = F.layer_norm(x, (C,), q("ln1_w"), q("ln1_b"), 1e-5)
        qkv = h @ q("qkv_w").T + q("qkv_b")
        a, b_, c = (z.view(B, T, H, C // H).transpose(1, 2) for z in qkv.split(C, -1))
        att = F.scaled_dot_product_attention(a, b_, c, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + att @ q("proj_w").T + q("proj_b")
        h = F.layer_norm(x, (C,), q("ln2_w"), q("ln2_b"), 1e-5)
        h = F.gelu(h @ q("fc_w").T + q("fc_b"), approximate="tanh")
        x = x + h @ q("fcproj_w").T + q("fcproj_b")
    x = F.layer_norm(x, (C,), p["lnf_w"], p["lnf_b"], 1e-5)
    logits = (x @ p["wte"].T)[..., :V]
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1).long())


def reference(layout, init, toks, family="gpt2"):
    loss_fn = llama_loss_of if family == "llama" else loss_of
    p = unflatten(init, layout)
    for t in p.values():
        t.requires_grad_(True)
    decay = [p[n] for n, _, s in layout if len(s) == 2]
    other = [p[n] for n, _, s in layout if len(s) != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": other, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses, norms, grads0 = [], [], None
    for step, flat in enumerate(toks):
        tok = torch.tensor(flat).view(B, T + 1)
        opt.zero_grad()
        loss = loss_fn(p, tok)
        loss.backward()
        norm = math.sqrt(sum(float((t.grad ** 2).sum()) for t in p.values()))
        if step == 0:
            grads0 = {n: t.grad.clone() for n, t in p.items()}
        if norm > CLIP:  # ferrite scales by clip / norm (torch's clip_grad_norm_ adds 1e-6)
            for t in p.values():
                t.grad.mul_(CLIP / norm)
        opt.step()
        losses.append(float(loss.detach()))
        norms.append(norm)
    return losses, norms, grads0, p


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("device", [-1, pytest.param(0, marks=requires_cuda)], ids=["cpu", "cuda"])
def test_trainer_matches_pytorch(device, family):
    toks = batches()
    extra = dict(family="llama", kv_heads=LLAMA["kv_heads"], ffn=LLAMA["ffn"]) if family == "llama" else {}
    layout, init, losses, norms, grads0, final = _native.gpt2_train_steps(
        CFG["vocab"], CFG["max_seq"], CFG["layers"], CFG["heads"], CFG["dim"], B, T, toks,
        lr=LR, weight_decay=WD, clip=CLIP, seed=7, device=device, **extra)
    r_losses, r_norms, r_grads0, r_p = reference(layout, init, toks, family)
    cpu = device < 0
    # logits and loss: f32 against f64 (CPU); bf16 activations (GPU)
    loss_tol, grad_tol, final_tol = (2e-5, 2e-4, 2e-4) if cpu else (2e-2, 5e-2, 2e-2)
    for s, (a, b) in enumerate(zip(losses, r_losses)):
        assert abs(a - b) <= loss_tol * abs(b), f"step {s}: loss {a} vs reference {b}"
    for s, (a, b) in enumerate(zip(norms, r_norms)):
        assert abs(a - b) <= grad_tol * abs(b) + 1e-6, f"step {s}: gradient norm {a} vs {b}"
    g = unflatten(grads0, layout)
    for name, _, _ in layout:
        ref = r_grads0[name]
        if name in ("wte", "head"):  # the padded rows get no gradient on either side
            ref = ref[:CFG["vocab"]]
            got = g[name][:CFG["vocab"]]
        else:
            got = g[name]
        e = rel(got, ref)
        assert e <= grad_tol, f"step-0 gradient of {name}: relative error {e:.2e}"
    total = len(final)
    e = rel(torch.tensor(final, dtype=torch.float64), flatten_like(r_p, layout, total))
    assert e <= final_tol, f"weights after {STEPS} steps: relative error {e:.2e}"
    assert rel(torch.tensor(final, dtype=torch.float64), torch.tensor(init, dtype=torch.float64)) > 1e-3


def test_bad_batch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"batches.*B·\(T\+1\) = 8 token ids.*batch 1 with 5"):
        _native.gpt2_train_steps(50, 8, 1, 2, 16, 2, 3, [[1] * 8, [1] * 5])
