"""ferrite's CPU paths against PyTorch's CPU ops, every family, in one process.

Each row times one op at a representative shape (float32; the forward, and the forward +
backward where the op has one) through ferrite's Python front and the same computation in
PyTorch (eager, all of this machine's cores for both: rayon's threads, torch's intra-op pool),
in alternating rounds: median milliseconds of each, and ferrite ÷ torch as "× torch" (> 1: ferrite
faster). Writes JSON rows and prints a Markdown table.

    python3 scripts/cpu_peers.py OUT.json [--rounds 15] [--only name,...]
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

import ferrite


def timed(fn):
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def fwd_bwd(fn, inputs, grad):
    """A closure running fn forward and backward (fresh leaves each call)."""

    def run():
        leaves = [t.detach().requires_grad_() for t in inputs]
        fn(*leaves).backward(grad)

    return run


def cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    c = []

    a, b = r(512, 512), r(512, 512)
    c.append(("matmul", "512×512×512", lambda: ferrite.matmul(a, b), lambda: a @ b))

    xl, w, bias = r(1024, 768), r(3072, 768) * 0.05, r(3072)
    dy = r(1024, 3072)
    fl = lambda x_, w_, b_: ferrite.linear(x_, w_, b_, activation="gelu_tanh")
    tl = lambda x_, w_, b_: F.gelu(F.linear(x_, w_, b_), approximate="tanh")
    c.append(("linear + gelu_tanh", "1024×768 → 3072", lambda: fl(xl, w, bias), lambda: tl(xl, w, bias)))
    c.append(("linear + gelu_tanh fwd+bwd", "1024×768 → 3072", fwd_bwd(fl, [xl, w, bias], dy), fwd_bwd(tl, [xl, w, bias], dy)))

    x, wn, bn, dx = r(4096, 1024), r(1024), r(1024), r(4096, 1024)
    fr = lambda t, w_: ferrite.rms_norm(t, [1024], w_, 1e-5)
    tr = lambda t, w_: F.rms_norm(t, [1024], w_, 1e-5)
    c.append(("rms_norm", "4096×1024", lambda: fr(x, wn), lambda: tr(x, wn)))
    c.append(("rms_norm fwd+bwd", "4096×1024", fwd_bwd(fr, [x, wn], dx), fwd_bwd(tr, [x, wn], dx)))
    c.append(("layer_norm", "4096×1024", lambda: ferrite.layer_norm(x, [1024], wn, bn), lambda: F.layer_norm(x, [1024], wn, bn)))
    c.append(("softmax", "4096×1024", lambda: ferrite.softmax(x, -1), lambda: torch.softmax(x, -1)))

    uv = r(4096, 4096)
    c.append(("swiglu", "4096×(2×2048)", lambda: ferrite.swiglu(uv), lambda: F.silu(uv[:, :2048]) * uv[:, 2048:]))

    logits, tgt = r(1024, 8192), torch.randint(0, 8192, (1024,), generator=g)
    fce = lambda z: ferrite.cross_entropy(z, tgt)
    tce = lambda z: F.cross_entropy(z, tgt)
    c.append(("cross_entropy", "1024×8192", lambda: fce(logits), lambda: tce(logits)))
    c.append(("cross_entropy fwd+bwd", "1024×8192", fwd_bwd(fce, [logits], torch.tensor(1.0)), fwd_bwd(tce, [logits], torch.tensor(1.0))))

    q, k, vv = r(1, 512, 8, 64), r(1, 512, 8, 64), r(1, 512, 8, 64)
    do = r(1, 512, 8, 64)
    fa = lambda q_, k_, v_: ferrite.flash_attn_func(q_, k_, v_, causal=True)
    ta = lambda q_, k_, v_: F.scaled_dot_product_attention(q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), is_causal=True).transpose(1, 2)
    c.append(("attention causal", "B1 S512 H8 D64", lambda: fa(q, k, vv), lambda: ta(q, k, vv)))
    c.append(("attention causal fwd+bwd", "B1 S512 H8 D64", fwd_bwd(fa, [q, k, vv], do), fwd_bwd(ta, [q, k, vv], do)))

    xr = r(1, 2048, 16, 64)
    ang = torch.outer(torch.arange(2048.0), 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64))
    cos, sin = ang.cos(), ang.sin()

    def t_rot(t):
        x1, x2 = t[..., :32], t[..., 32:]
        cc, ss = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([x1 * cc - x2 * ss, x2 * cc + x1 * ss], -1)

    c.append(("rotary", "1×2048×16×64", lambda: ferrite.apply_rotary_emb(xr, cos, sin), lambda: t_rot(xr)))

    params = [r(4096, 1024) for _ in range(4)]
    grads = [r(4096, 1024) for _ in range(4)]
    pf = [p.clone().requires_grad_() for p in params]
    pt = [p.clone().requires_grad_() for p in params]
    for p, gg in zip(pf + pt, grads + grads):
        p.grad = gg.clone()
    of, ot = ferrite.optim.AdamW(pf, lr=1e-3), torch.optim.AdamW(pt, lr=1e-3, foreach=True)
    c.append(("adamw step", "4 × 4096×1024", of.step, ot.step))

    xm, router = r(512, 256), r(8, 256) * 0.1
    w_up, w_down = r(8, 256, 1024) * 0.05, r(8, 512, 256) * 0.05

    def t_moe(x_):
        probs = torch.softmax(x_ @ router.T, -1)
        wts, idx = probs.topk(2, -1)
        wts = wts / wts.sum(-1, keepdim=True)
        out = torch.zeros_like(x_)
        for e in range(8):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                h = x_[tok] @ w_up[e]
                y = (F.silu(h[:, :512]) * h[:, 512:]) @ w_down[e]
                out.index_add_(0, tok, y * wts[tok, slot, None])
        return out

    c.append(("moe (top-2 of 8, SwiGLU)", "T512 H256 I512", lambda: ferrite.moe(xm, router, w_up, w_down, 2)[0], lambda: t_moe(xm)))

    xq = r(2048, 2048)
    fmax = torch.finfo(torch.float8_e4m3fn).max

    def t_quant(t):
        amax = t.abs().amax(1, keepdim=True)
        s = fmax / amax
        return (t * s).clamp(-fmax, fmax).to(torch.float8_e4m3fn), 1 / s

    c.append(("quantize_fp8 (per row)", "2048×2048", lambda: ferrite.quantize_fp8(xq, rowwise=True), lambda: t_quant(xq)))
    qa = r(512, 512).to(torch.float8_e4m3fn)
    qb = r(512, 512).to(torch.float8_e4m3fn)
    one = torch.ones(1)
    c.append(("scaled_mm e4m3 → f32", "512×512×512", lambda: ferrite.scaled_mm(qa, qb, one, one, out_dtype=torch.float32),
              lambda: torch._scaled_mm(qa, qb.t(), one, one, out_dtype=torch.float32)))
    w8, s8 = ferrite.quantize_int8(r(4096, 4096))
    xw = r(1, 4096).to(torch.bfloat16)
    s8b = s8.to(torch.bfloat16)
    c.append(("w8a16 (int8 weight, bf16)", "1×4096×4096", lambda: ferrite.w8a16(xw, w8, s8),
              lambda: torch._weight_int8pack_mm(xw, w8, s8b)))
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    only = [s for s in a.only.split(",") if s]
    rows = []
    for name, shape, f, t in cases():
        if only and not any(o in name for o in only):
            continue
        row = dict(op=name, shape=shape, dtype="float32")
        try:
            for _ in range(3):
                f()
                t()
            fs, ts = [], []
            for _ in range(a.rounds):
                fs.append(timed(f))
                ts.append(timed(t))
            row.update(ferrite_ms=statistics.median(fs), torch_ms=statistics.median(ts))
            row["x_torch"] = row["torch_ms"] / row["ferrite_ms"]
        except Exception as e:  # a peer torch does not offer on the CPU
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        rows.append(row)
        print(row, flush=True)
    meta = dict(torch=torch.__version__, threads=torch.get_num_threads(), cpus=os.cpu_count(), ferrite=ferrite.__version__)
    json.dump(dict(meta=meta, rows=rows), open(a.out, "w"), indent=1)
    print(f"\nPyTorch {meta['torch']}, {meta['threads']} threads\n")
    print("| op | shape | ferrite ms | torch ms | × torch |")
    print("| --- | --- | --- | --- | --- |")
    for r_ in rows:
        if "error" in r_:
            print(f"| {r_['op']} | {r_['shape']} | — | — | {r_['error']} |")
        else:
            print(f"| {r_['op']} | {r_['shape']} | {r_['ferrite_ms']:.3f} | {r_['torch_ms']:.3f} | {r_['x_torch']:.2f} |")


if __name__ == "__main__":
    main()
