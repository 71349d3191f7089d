"""PyTorch peers for ferrite's attention and decode, measured on the GPU in the same suite run.

Times torch.nn.functional.scaled_dot_product_attention with its cuDNN and flash backends
(forward, and forward+backward minus forward for the backward) on the shapes `ferrite bench
attention` uses, and SDPA decoding one query per sequence from a contiguous KV cache on the shapes
of `ferrite bench decode`. FLOP convention: forward 4·B·H·Sq·Sk·D (halved when causal), backward
2.5× forward. Records whose (op, dtype, shape) match a ferrite bench record get the ratio of
ferrite's best variant to the peer. Usage:
    python3 attention_peers.py BENCH_JSON OUT_JSON [--quick]
"""
import argparse
import json
import re
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def bench(fn, reps=30, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def label(b, h, s, d, causal):
    return f"B{b} H{h} S{s} D{d}" + (" causal" if causal else "")


def bench_shapes(records):
    """(B, H, S, D) of every attention record of ferrite's bench, in its order."""
    shapes = []
    for r in records:
        m = re.match(r"B(\d+) H(\d+) S(\d+) D(\d+)", r.get("shape", "")) if r.get("op") == "attention" else None
        if m and tuple(map(int, m.groups())) not in shapes:
            shapes.append(tuple(map(int, m.groups())))
    return shapes


def attention_cases(quick, shapes=None):
    """The shapes of ferrite's bench when given (every ratio then has its peer), else a fixed set."""
    if not shapes:
        shapes = [(4, 16, 4096, 128), (4, 16, 4096, 64)]
        if not quick:
            shapes += [(16, 16, 1024, 128), (1, 16, 16384, 128)]
    out = []
    for (b, h, s, d) in shapes:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        do = torch.randn_like(q)
        for causal in (False, True):
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            for name, backend in [("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)]:
                try:
                    with sdpa_kernel(backend):
                        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        ms_f = bench(fwd)
                        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))

                        def fb():
                            y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                            torch.autograd.grad(y, (qq, kk, vv), do)

                        ms_fb = bench(fb)
                except RuntimeError as e:
                    print(f"{name} {label(b, h, s, d, causal)}: not available ({str(e).splitlines()[0]})")
                    continue
                ms_b = max(ms_fb - ms_f, 1e-6)
                out.append(dict(op="attention", variant=name, dtype="bf16", shape=label(b, h, s, d, causal) + " fwd",
                                median_ms=ms_f, tflops=flops / ms_f / 1e9))
                out.append(dict(op="attention", variant=name, dtype="bf16", shape=label(b, h, s, d, causal) + " bwd",
                                median_ms=ms_b, tflops=2.5 * flops / ms_b / 1e9))
    return out


def decode_cases(quick):
    shapes = [(16, 32, 8, 128, 4096), (64, 32, 8, 128, 2048)]
    if not quick:
        shapes += [(1, 32, 8, 128, 32768)]
    out = []
    for (b, hq, hkv, d, ctx) in shapes:
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        ms = bench(fn, reps=100, warmup=10)
        kv_bytes = 2 * b * hkv * ctx * d * 2
        out.append(dict(op="decode", variant="sdpa_contiguous", dtype="bf16",
                        shape=f"B{b} Hq{hq} Hkv{hkv} D{d} ctx{ctx}", median_ms=ms, gbps=kv_bytes / ms / 1e6))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_json")
    ap.add_argument("out_json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["attention", "decode"], default=None, help="one of the two peer sets")
    a = ap.parse_args()
    torch.manual_seed(0)
    ours = []
    for path in a.bench_json.split(","):  # several bench JSONs may be given, comma-separated
        try:
            ours += json.load(open(path))["records"]
        except (OSError, ValueError, KeyError):
            pass
    peers = (attention_cases(a.quick, bench_shapes(ours)) if a.only != "decode" else []) + (
        decode_cases(a.quick) if a.only != "attention" else [])
    print(f"{'op':9} {'shape':40} {'peer':16} {'peer ms':>8} {'rate':>10} {'ferrite best':>24} {'× peer':>7}")
    for p in peers:
        rate = f"{p['tflops']:.0f} TF/s" if "tflops" in p else f"{p['gbps']:.0f} GB/s"
        mine = [r for r in ours if r["op"] == p["op"] and r["dtype"] == p["dtype"]
                and r["shape"].startswith(p["shape"]) and not r.get("is_peer")]
        line = f"{p['op']:9} {p['shape']:40} {p['variant']:16} {p['median_ms']:8.3f} {rate:>10}"
        if mine:
            best = min(mine, key=lambda r: r["median_ms"])
            p["ferrite_variant"], p["ferrite_ms"] = best["variant"], best["median_ms"]
            p["ratio_ferrite_to_peer"] = p["median_ms"] / best["median_ms"]
            line += f" {best['variant']:>14} {best['median_ms']:8.3f} {p['ratio_ferrite_to_peer']:7.2f}"
        print(line)
    json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name(), peers=peers), open(a.out_json, "w"), indent=1)


if __name__ == "__main__":
    main()
