"""PyTorch peers of `ferrite bench moe`, timed in the same call: the MoE layer a PyTorch user
builds (softmax top-k router, renormalised; permutation by a stable sort; SwiGLU experts; weighted
scatter-add combine) with the expert GEMMs as (a) `torch._grouped_mm` and (b) a loop over
experts, the `_grouped_mm` layer under `torch.compile` too, plus the expert GEMMs alone through
`torch._grouped_mm` and a dense same-FLOP chain — and, when
the ferrite wheel is importable, `ferrite.moe` itself through its custom op (what a PyTorch user
of ferrite runs), so the ratio is measured in one process.
Forward and forward+backward (autograd), bf16, CUDA-event medians; peak memory per call.
TFLOP/s count the expert GEMMs of the T·k routed rows (forward 6·T·k·H·I, backward 2× that).

    python3 moe_peers.py --out moe_peers.json [--shape T,H,I,E,k ...] [--quick] [--layers A,B]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = {
    "mixtral": (8192, 4096, 14336, 8, 2),
    "qwen3-moe": (32768, 2048, 768, 128, 8),
    "deepseek-v3-slice": (8192, 7168, 2048, 32, 8),
}


def timed(fn, reps=20, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def peak(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def route(x, router, k):
    logits = x @ router.t()
    probs = logits.float().softmax(-1)
    w, idx = probs.topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    return w, idx


def layer_grouped(x, router, w_up, w_down, k):
    t, h = x.shape
    e, _, i2 = w_up.shape
    i = i2 // 2
    w, idx = route(x, router, k)
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=e)
    offs = counts.cumsum(0).to(torch.int32)
    tok = order // k
    xs = x[tok]
    hp = torch._grouped_mm(xs, w_up, offs=offs)
    hh = F.silu(hp[:, :i]) * hp[:, i:]
    y = torch._grouped_mm(hh, w_down, offs=offs)
    y = y * w.flatten()[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)


def layer_loop(x, router, w_up, w_down, k):
    t, h = x.shape
    e, _, i2 = w_up.shape
    i = i2 // 2
    w, idx = route(x, router, k)
    out = torch.zeros_like(x)
    for ex in range(e):
        tok, slot = torch.where(idx == ex)
        if tok.numel() == 0:
            continue
        hp = x[tok] @ w_up[ex]
        hh = F.silu(hp[:, :i]) * hp[:, i:]
        y = (hh @ w_down[ex]) * w[tok, slot].unsqueeze(1).to(x.dtype)
        out.index_add_(0, tok, y)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", action="append", default=[])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", default=None, help="only these layers (comma list of variant names)")
    a = ap.parse_args()
    shapes = {"custom" + str(n): tuple(int(v) for v in s.split(",")) for n, s in enumerate(a.shape)}
    if not shapes:
        shapes = {"small": (4096, 1024, 512, 16, 4)} if a.quick else SHAPES
    dev, dt = "cuda", torch.bfloat16
    rows = []
    for label, (t, h, i, e, k) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.rand(t, h, device=dev, dtype=dt, generator=g) * 2 - 1
        router = (torch.rand(e, h, device=dev, dtype=dt, generator=g) * 2 - 1) * 0.05
        w_up = (torch.rand(e, h, 2 * i, device=dev, dtype=dt, generator=g) * 2 - 1) / h**0.5
        w_down = (torch.rand(e, i, h, device=dev, dtype=dt, generator=g) * 2 - 1) / i**0.5
        dout = torch.rand(t, h, device=dev, dtype=dt, generator=g) * 2 - 1
        fwd_flops = 6.0 * t * k * h * i
        shape = f"{label} T{t} H{h} I{i} E{e} k{k}"
        layers = [("torch_grouped_mm_layer", layer_grouped),
                  ("torch_grouped_mm_layer_compiled", torch.compile(layer_grouped)),
                  ("torch_loop_layer", layer_loop)]
        try:
            import ferrite

            layers.insert(0, ("ferrite_moe_python", lambda x, r, u, d, k: ferrite.moe(x, r, u, d, k)[0]))
        except ImportError:
            pass
        if a.layers:
            layers = [(n, f) for n, f in layers if n in a.layers.split(",")]
        for name, fn in layers:
            for backward in (False, True):
                ps = [p.requires_grad_(backward) for p in (x, router, w_up, w_down)]

                def call():
                    o = fn(*ps, k)
                    if backward:
                        o.backward(dout)
                        for p in ps:
                            p.grad = None

                try:
                    with torch.set_grad_enabled(backward):
                        ms = timed(call)
                        pk = peak(call)
                except Exception as err:  # noqa: BLE001 (report, do not stop the peers)
                    rows.append({"variant": name, "shape": shape, "error": str(err)[:300]})
                    continue
                flops = fwd_flops * (3 if backward else 1)
                rows.append({
                    "op": "moe", "variant": name, "is_peer": not name.startswith("ferrite"), "dtype": "bf16",
                    "shape": shape + (" fwd+bwd" if backward else " fwd"), "median_ms": ms,
                    "tflops": flops / ms / 1e9, "peak_device_bytes": pk,
                })
        # The expert GEMMs alone through torch._grouped_mm (balanced counts), and dense.
        with torch.no_grad():
            rows_n = t * k
            counts = torch.full((e,), rows_n // e, device=dev, dtype=torch.int64)
            counts[: rows_n % e] += 1
            offs = counts.cumsum(0).to(torch.int32)
            xs = torch.rand(rows_n, h, device=dev, dtype=dt)
            hh = torch.rand(rows_n, i, device=dev, dtype=dt)
            ms = timed(lambda: (torch._grouped_mm(xs, w_up, offs=offs), torch._grouped_mm(hh, w_down, offs=offs)))
            rows.append({"op": "moe", "variant": "torch_grouped_mm_gemms", "is_peer": True, "dtype": "bf16",
                         "shape": shape + " fwd", "median_ms": ms, "tflops": fwd_flops / ms / 1e9})
            wu, wd = w_up[0].detach().clone(), w_down[0].detach().clone()
            wu = torch.rand(h, 2 * i, device=dev, dtype=dt)
            wd = torch.rand(i, h, device=dev, dtype=dt)
            ms = timed(lambda: (xs @ wu, hh @ wd))
            rows.append({"op": "moe", "variant": "torch_dense_chain", "is_peer": True, "dtype": "bf16",
                         "shape": shape + " fwd", "median_ms": ms, "tflops": fwd_flops / ms / 1e9})
        del x, router, w_up, w_down, dout
        torch.cuda.empty_cache()
    for r in rows:
        print(json.dumps(r))
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
