"""Binding overhead of the PyTorch front: each op called through ``ferrite`` (torch custom op,
outputs allocated by torch, kernels on torch's stream) against the same kernel timed by
``ferrite bench`` from Rust in the same suite run, on the same shapes.

    python3 binding_overhead.py BENCH_JSON[,BENCH_JSON...] OUT_JSON

For each case the Rust side is the best non-peer variant of that op/shape/dtype in the bench
JSON (the variant ferrite's default selection picks); the Python side calls the public function
with default selection, timed three ways: one call between two CUDA events (host issue time
included), 20 calls queued between two events (the host runs ahead, as in a model: the kernel's
own time unless the host cannot keep up), and the host's µs to issue one call. Target (issue:
the PyTorch front): queued time ≤ 1.05 × Rust time.
"""

import json
import statistics
import sys

import torch

import ferrite
from torch_peers import bench  # median of CUDA-event timings of single calls after warm-up


def bench_back_to_back(fn, calls=20, reps=15, warmup=5):
    """GPU ms per call with `calls` calls queued between the two events: the host runs ahead
    (as in a model), so this is the kernel time unless the host cannot keep up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def host_us(fn, calls=200):
    """Host µs per call (the GPU may still be busy: this is the cost of issuing the call)."""
    import time

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / calls * 1e6


def rust_best(records, op, shape, dtype):
    rows = [
        r
        for r in records
        if r["op"] == op and r["shape"] == shape and r["dtype"] == dtype and not r.get("is_peer") and r.get("median_ms")
    ]
    if not rows:
        return None
    return min(rows, key=lambda r: r["median_ms"])


def cases():
    bf = torch.bfloat16
    dev = "cuda"
    out = []

    x = torch.randn(32768, 4096, device=dev, dtype=bf)
    w = torch.rand(4096, device=dev, dtype=bf) + 0.5
    out.append(("norm", "rms_norm 32768×4096 fwd", "bf16", lambda: ferrite.rms_norm(x, [4096], w, 1e-5)))
    out.append(("softmax", "32768×4096 fwd", "bf16", lambda: ferrite.softmax(x)))

    a = torch.randn(4096, 4096, device=dev, dtype=bf)
    b = torch.randn(4096, 4096, device=dev, dtype=bf)
    out.append(("matmul", "4096×4096×4096 NN", "bf16", lambda: ferrite.matmul(a, b)))

    q, k, v = (torch.randn(4, 4096, 16, 128, device=dev, dtype=bf) for _ in range(3))
    out.append(("attention", "B4 H16 S4096 D128 fwd", "bf16", lambda: ferrite.flash_attn_func(q, k, v)))
    out.append(("attention", "B4 H16 S4096 D128 causal fwd", "bf16", lambda: ferrite.flash_attn_func(q, k, v, causal=True)))

    logits = torch.randn(8192, 50257, device=dev, dtype=bf)
    t = torch.randint(0, 50257, (8192,), device=dev)
    # loss and dlogits in one kernel, as `ferrite bench cross_entropy` times it (fwd+bwd)
    out.append(
        ("cross_entropy", "8192×50257 fwd+bwd", "bf16", lambda: torch.ops.ferrite.cross_entropy(logits, t, -100, 0.0, "mean", True))
    )
    return out


def main():
    paths, out_path = sys.argv[1], sys.argv[2]
    records = []
    for p in paths.split(","):
        try:
            with open(p) as fh:
                records += json.load(fh)["records"]
        except (OSError, ValueError, KeyError) as e:
            print(f"binding_overhead: skipping {p}: {e}", file=sys.stderr)
    rows = []
    print("single: one call between two events (includes the host's time to issue it);")
    print("queued: 20 calls between two events (the host runs ahead, as in a model); host: µs to issue one call")
    print(f"{'op':<14} {'shape':<30} {'rust variant':<14} {'rust ms':>9} {'single ms':>10} {'queued ms':>10} {'host µs':>8} {'queued/rust':>12}")
    for op, shape, dtype, fn in cases():
        r = rust_best(records, op, shape, dtype)
        ms = bench(fn)
        q = bench_back_to_back(fn)
        h = host_us(fn)
        ratio = q / r["median_ms"] if r else None
        rows.append(dict(op=op, shape=shape, dtype=dtype, rust_variant=r and r["variant"], rust_ms=r and r["median_ms"],
                         python_single_ms=ms, python_queued_ms=q, host_us_per_call=h, ratio=ratio))
        rv = r["variant"] if r else "(not benched)"
        rm = f"{r['median_ms']:.4f}" if r else "-"
        rt = f"{ratio:.3f}" if ratio else "-"
        print(f"{op:<14} {shape:<30} {rv:<14} {rm:>9} {ms:>10.4f} {q:>10.4f} {h:>8.1f} {rt:>12}")
    if "--profile" in sys.argv:
        import cProfile
        import pstats

        for op, shape, dtype, fn in cases()[:2]:
            print(f"\n== cProfile of 300 calls: {op} {shape} (host side; tottime = own time)")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(300):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(14)
    with open(out_path, "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, ferrite=ferrite.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
