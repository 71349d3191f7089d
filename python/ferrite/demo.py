"""Naive PyTorch vs optimized PyTorch vs torch.compile vs ferrite, for a transformer block and
its parts.

    python -m ferrite.demo                      # CUDA if present (realistic sizes), else CPU (small)
    python -m ferrite.demo --device cpu --json out.json
    python -m ferrite.demo --mode training      # forward + backward

Components: RMSNorm and LayerNorm over [tokens, dim], the MLP up-projection Linear
[tokens, dim] -> [tokens, 4·dim] (plain, and with its GELU), causal self-attention
[batch, heads, seq, dim/heads], softmax cross-entropy over [tokens, vocab], and a pre-norm block
(RMSNorm, causal self-attention, RMSNorm, GELU MLP). Variants:

- ``naive``: PyTorch written out op by op (norm formulas, ``x @ w.T + b``, attention as
  matmul / masked softmax / matmul, cross-entropy as log-softmax and gather);
- ``torch``: PyTorch's fused ops (``F.rms_norm``, ``F.layer_norm``, ``F.linear``, SDPA,
  ``F.cross_entropy``);
- ``torch.compile``: the ``torch`` variant under ``torch.compile``;
- ``ferrite``: ferrite's ops (the block: ferrite's RMSNorm, linear, flash attention and
  ``ferrite.mlp`` (GELU in the up-projection's epilogue; backward in the chain form), with the
  ``torch`` block's parameters);
- ``ferrite+compile``: the ``ferrite`` variant under ``torch.compile(fullgraph=True)``.

For each: median time, throughput (GB/s for the norms, TFLOP/s for the linear and the block,
tokens/s for all), speedup over ``naive``, peak memory above the inputs (CUDA only), and the
largest difference from the ``torch`` variant's output. The table is printed and written as JSON.
"""

import argparse
import copy
import json
import math
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import ferrite

VARIANTS = ["naive", "torch", "torch.compile", "ferrite", "ferrite+compile"]


# ----------------------------------------------------------------------------------------------
# the models


class NaiveBlock(torch.nn.Module):
    """Pre-norm transformer block written out op by op (reads the parameters of `p`)."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def rms(self, x, w, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def lin(self, x, m):
        y = x @ m.weight.t()
        return y + m.bias if m.bias is not None else y

    def forward(self, x):
        p = self.p
        b, s, d = x.shape
        h = self.rms(x, p.norm1.weight, p.norm1.eps)
        q, k, v = self.lin(h, p.qkv).view(b, s, 3, p.heads, d // p.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // p.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.lin(o, p.proj)
        h = self.rms(x, p.norm2.weight, p.norm2.eps)
        return x + self.lin(F.gelu(self.lin(h, p.up)), p.down)


class Block(torch.nn.Module):
    """The same block with PyTorch's fused ops (F.rms_norm, F.linear, SDPA flash/cuDNN)."""

    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.RMSNorm(dim, eps=1e-6)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.RMSNorm(dim, eps=1e-6)
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class FerriteBlock(torch.nn.Module):
    """The same block on ferrite's ops (reads the parameters of `p`, a ``Block``)."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        p = self.p
        b, s, d = x.shape
        h = ferrite.rms_norm(x, [d], p.norm1.weight, p.norm1.eps)
        q, k, v = ferrite.linear(h, p.qkv.weight, p.qkv.bias).view(b, s, 3, p.heads, d // p.heads).unbind(2)
        o = ferrite.flash_attn_func(q, k, v, causal=True)
        x = x + ferrite.linear(o.reshape(b, s, d), p.proj.weight, p.proj.bias)
        h = ferrite.rms_norm(x, [d], p.norm2.weight, p.norm2.eps)
        # the MLP as one op: its backward forms GELU' and the up-projection's db inside the
        # down-projection's dX GEMM (the chain form)
        return x + ferrite.mlp(h, p.up.weight, p.up.bias, p.down.weight, p.down.bias, activation="gelu")


# ----------------------------------------------------------------------------------------------
# timing


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(fn, dev, warmup, iters, training, params):
    """(median ms, peak MiB above the live memory before, compile+warm-up seconds, output)."""

    def step():
        out = fn()
        if training:
            out.backward(torch.ones_like(out))
            for p in params:
                p.grad = None
        return out

    t0 = time.perf_counter()
    for _ in range(warmup):
        out = step()
    _sync(dev)
    warm_s = time.perf_counter() - t0
    base = 0
    if dev.type == "cuda":
        out = None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = step()
            e1.record()
            times.append((e0, e1))
        else:
            t = time.perf_counter()
            out = step()
            times.append((time.perf_counter() - t) * 1e3)
    _sync(dev)
    if dev.type == "cuda":
        times = [a.elapsed_time(b) for a, b in times]
        peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
    else:
        peak = None
    return statistics.median(times), peak, warm_s, out.detach()


# ----------------------------------------------------------------------------------------------
# the cases


def build_cases(args, dev, dtype):
    b, s, d, hid = args.batch, args.seq, args.dim, args.hidden
    tokens = b * s
    es = torch.finfo(dtype).bits // 8
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

    x2 = rnd(tokens, d).requires_grad_(args.mode == "training")
    w = rnd(d, scale=0.1).add_(1).requires_grad_(args.mode == "training")
    bias = rnd(d, scale=0.1).requires_grad_(args.mode == "training")
    lw = rnd(hid, d, scale=d**-0.5).requires_grad_(args.mode == "training")
    lb = rnd(hid, scale=0.1).requires_grad_(args.mode == "training")
    eps = 1e-6

    def naive_rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def naive_ln(x):
        m = x.mean(-1, keepdim=True)
        v = (x - m).pow(2).mean(-1, keepdim=True)
        return (x - m) * torch.rsqrt(v + eps) * w + bias

    def torch_rms(x):
        return F.rms_norm(x, [d], w, eps)

    def torch_ln(x):
        return F.layer_norm(x, [d], w, bias, eps)

    def naive_lin(x):
        return x @ lw.t() + lb

    def torch_lin(x):
        return F.linear(x, lw, lb)

    def fer_rms(x):
        return ferrite.rms_norm(x, [d], w, eps)

    def fer_ln(x):
        return ferrite.layer_norm(x, [d], w, bias, eps)

    def fer_lin(x):
        return ferrite.linear(x, lw, lb)

    def naive_mlp(x):
        return F.gelu(x @ lw.t() + lb)

    def torch_mlp(x):
        return F.gelu(F.linear(x, lw, lb))

    def fer_mlp(x):
        return ferrite.linear(x, lw, lb, activation="gelu")

    # attention [B, H, S, hd], causal
    heads, hd = args.heads, d // args.heads
    qa = rnd(b, heads, s, hd).requires_grad_(args.mode == "training")
    ka = rnd(b, heads, s, hd).requires_grad_(args.mode == "training")
    va = rnd(b, heads, s, hd).requires_grad_(args.mode == "training")
    causal_mask = torch.ones(s, s, dtype=torch.bool, device=dev).triu(1)

    def naive_attn(q):
        att = (q @ ka.transpose(-1, -2)) / math.sqrt(hd)
        return att.masked_fill(causal_mask, float("-inf")).softmax(-1) @ va

    def torch_attn(q):
        return F.scaled_dot_product_attention(q, ka, va, is_causal=True)

    def fer_attn(q):
        return ferrite.scaled_dot_product_attention(q, ka, va, is_causal=True)

    # cross-entropy over [tokens, vocab]
    vocab = args.vocab
    logits = rnd(tokens, vocab, scale=2.0).requires_grad_(args.mode == "training")
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(dev)

    def naive_ce(z):
        return -(z.float().log_softmax(-1).gather(1, targets[:, None])).mean()

    def torch_ce(z):
        return F.cross_entropy(z, targets)

    def fer_ce(z):
        return ferrite.cross_entropy(z, targets)

    norm_bytes = 2 * tokens * d * es * (3 if args.mode == "training" else 1)
    lin_flops = 2 * tokens * d * hid * (3 if args.mode == "training" else 1)
    params_small = [w, bias, lw, lb]

    torch.manual_seed(0)
    blk = Block(d, args.heads, hid).to(dev, dtype)
    swapped = ferrite.optimize(copy.deepcopy(blk))  # what the patcher would swap in this block
    fblk = FerriteBlock(blk)
    nblk = NaiveBlock(blk)
    x3 = rnd(b, s, d).requires_grad_(args.mode == "training")
    hd = d // args.heads
    attn_flops = 4 * b * args.heads * s * s * hd / 2  # causal
    block_flops = 2 * tokens * (3 * d * d + d * d + 2 * d * hid) + attn_flops
    if args.mode == "training":
        block_flops *= 3

    def compiled(f):
        return torch.compile(f, fullgraph=True)

    cases = [
        ("rms_norm", x2, {"naive": naive_rms, "torch": torch_rms, "torch.compile": compiled(torch_rms),
                          "ferrite": fer_rms, "ferrite+compile": compiled(fer_rms)},
         params_small, ("GB/s", norm_bytes)),
        ("layer_norm", x2, {"naive": naive_ln, "torch": torch_ln, "torch.compile": compiled(torch_ln),
                            "ferrite": fer_ln, "ferrite+compile": compiled(fer_ln)},
         params_small, ("GB/s", norm_bytes)),
        ("mlp_linear", x2, {"naive": naive_lin, "torch": torch_lin, "torch.compile": compiled(torch_lin),
                            "ferrite": fer_lin, "ferrite+compile": compiled(fer_lin)},
         params_small, ("TFLOP/s", lin_flops)),
        ("mlp_gelu", x2, {"naive": naive_mlp, "torch": torch_mlp, "torch.compile": compiled(torch_mlp),
                          "ferrite": fer_mlp, "ferrite+compile": compiled(fer_mlp)},
         params_small, ("TFLOP/s", lin_flops)),
        ("attention", qa, {"naive": naive_attn, "torch": torch_attn, "torch.compile": compiled(torch_attn),
                           "ferrite": fer_attn, "ferrite+compile": compiled(fer_attn)},
         [qa, ka, va], ("TFLOP/s", attn_flops * (3.5 if args.mode == "training" else 1))),
        ("cross_entropy", logits, {"naive": naive_ce, "torch": torch_ce, "torch.compile": compiled(torch_ce),
                                   "ferrite": fer_ce, "ferrite+compile": compiled(fer_ce)},
         [logits], ("GB/s", tokens * vocab * es * (2 if args.mode == "training" else 1))),
        ("block", x3, {"naive": nblk, "torch": blk, "torch.compile": compiled(blk),
                       "ferrite": fblk, "ferrite+compile": compiled(fblk)},
         list(blk.parameters()), ("TFLOP/s", block_flops)),
    ]
    return cases, tokens, swapped


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ferrite.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default=None, help="float32 / float16 / bfloat16 (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--mode", choices=["inference", "training"], default="inference")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None, help="MLP width (default 4·dim)")
    ap.add_argument("--vocab", type=int, default=None, help="cross-entropy classes (default 32768 on CUDA, 1000 on CPU)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated components (rms_norm,layer_norm,mlp_linear,mlp_gelu,attention,cross_entropy,block)")
    ap.add_argument("--skip", default="", help="comma-separated variants to skip (e.g. naive,torch.compile)")
    ap.add_argument("--json", default=None, help="where to write the results (default ferrite-demo-<device>.json)")
    args = ap.parse_args(argv)

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    cuda = dev.type == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    big = dict(batch=8, seq=2048, dim=2048, heads=16, iters=30, vocab=32768)
    small = dict(batch=2, seq=128, dim=256, heads=4, iters=10, vocab=1000)
    for k, v in (big if cuda else small).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.hidden = args.hidden or 4 * args.dim
    if args.mode == "training":
        torch.set_grad_enabled(True)
    else:
        torch.set_grad_enabled(False)

    cases, tokens, swapped = build_cases(args, dev, dtype)
    only = set(args.only.split(",")) if args.only else None
    skip = set(filter(None, args.skip.split(",")))
    devname = torch.cuda.get_device_name(dev) if cuda else (platform.processor() or platform.machine())
    print(f"ferrite {ferrite.__version__} | torch {torch.__version__} | {dev} ({devname}) | {dtype} | {args.mode}")
    print(f"batch {args.batch} × seq {args.seq} = {tokens} tokens, dim {args.dim}, heads {args.heads}, hidden {args.hidden}")
    print(f"ferrite.optimize(block) would swap: {', '.join(n for n, _, _ in swapped)}; the ferrite block runs ferrite ops only\n")

    rows = []
    for name, x, fns, params, (unit, work) in cases:
        if only and name not in only:
            continue
        ref = None
        naive_ms = None
        for variant in VARIANTS:
            if variant in skip:
                continue
            f = fns[variant]
            try:
                ms, peak, warm_s, out = measure(lambda: f(x), dev, args.warmup, args.iters, args.mode == "training", params)
            except Exception as e:  # report and go on: one failing variant should not hide the rest
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                rows.append(dict(component=name, variant=variant, error=msg))
                print(f"{name:<11} {variant:<16} FAILED {msg}", file=sys.stderr)
                continue
            if variant == "torch":
                ref = out
            if variant == "naive":
                naive_ms = ms
            rows.append(dict(
                component=name, variant=variant, ms=ms, unit=unit,
                throughput=work / (ms * 1e-3) / (1e9 if unit == "GB/s" else 1e12),
                tokens_per_s=tokens / (ms * 1e-3),
                speedup_vs_naive=(naive_ms / ms) if naive_ms else None,
                peak_mem_mib=peak, warmup_s=warm_s, _out=out,
            ))
        for row in rows:
            if row.get("component") == name and "_out" in row:
                out = row.pop("_out")
                row["max_abs_diff_vs_torch"] = (out.float() - ref.float()).abs().max().item() if ref is not None else None
        del x

    hdr = f"{'component':<11} {'variant':<16} {'time ms':>9} {'throughput':>16} {'tokens/s':>10} {'speedup':>8} {'peak MiB':>9} {'max|Δ|':>9}"
    print(hdr)
    print("-" * len(hdr))
    last = None
    for row in rows:
        if last and row["component"] != last:
            print()
        last = row["component"]
        if "error" in row:
            print(f"{row['component']:<11} {row['variant']:<16} FAILED: {row['error'][:80]}")
            continue
        sp = f"{row['speedup_vs_naive']:.2f}×" if row["speedup_vs_naive"] else "-"
        pk = f"{row['peak_mem_mib']:.1f}" if row["peak_mem_mib"] is not None else "n/a"
        d = row["max_abs_diff_vs_torch"]
        print(f"{row['component']:<11} {row['variant']:<16} {row['ms']:>9.3f} {row['throughput']:>9.3g} {row['unit']:<6} "
              f"{row['tokens_per_s']:>10.3g} {sp:>8} {pk:>9} {d if d is None else format(d, '.2e'):>9}")

    path = args.json or f"ferrite-demo-{dev.type}.json"
    meta = dict(
        ferrite=ferrite.__version__, torch=torch.__version__, python=platform.python_version(),
        device=str(dev), device_name=devname, dtype=str(dtype).replace("torch.", ""), mode=args.mode,
        batch=args.batch, seq=args.seq, dim=args.dim, heads=args.heads, hidden=args.hidden,
        vocab=args.vocab, iters=args.iters, warmup=args.warmup, swapped=[n for n, _, _ in swapped],
        notes="time: median over iters (CUDA events on CUDA); peak memory above the live memory before "
              "the timed runs (CUDA only); max|Δ|: largest difference from the `torch` variant's output; "
              "attention FLOPs 4·B·H·S²·hd/2 (causal; training ×3.5); cross-entropy GB/s counts the logits "
              "read (and the gradient written in training)",
    )
    with open(path, "w") as fh:
        json.dump(dict(meta=meta, results=rows), fh, indent=1)
    print(f"\nwrote {path}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
