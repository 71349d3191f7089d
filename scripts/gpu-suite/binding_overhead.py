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

The Rust bench ran in another process, minutes earlier: clocks and temperature drift between
the two (a hot GPU runs slower), which a ratio near 1.05 cannot tell from binding cost. So each
case also times the same kernel through the native module directly (`ferrite._native`, outputs
allocated once: no torch op, no dispatcher, no allocation), queued the same way and interleaved
with the torch op rep by rep, in this process: `op/native` is the binding's own overhead.
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


def interleaved(fns, calls=20, reps=15, warmup=5):
    """GPU ms per call of each fn, queued as in bench_back_to_back, the fns alternating rep by rep
    (order flipped every rep) so clock and temperature drift hit them alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for r in range(reps):
        order = list(range(len(fns)))
        if r % 2:
            order.reverse()
        for i in order:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(calls):
                fns[i]()
            b.record()
            b.synchronize()
            times[i].append(a.elapsed_time(b) / calls)
    return [statistics.median(t) for t in times]


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


def native(fn, *args, **kwargs):
    """The native function with its arguments turned into descriptors once (outputs preallocated):
    the kernel as the Rust API runs it, without the torch op around it."""
    from ferrite._ops import _desc

    conv = lambda v: _desc(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
    a = [conv(x) for x in args]
    kw = {k: conv(v) for k, v in kwargs.items()}
    keep = (args, kwargs)  # the descriptors do not own their tensors

    def call():
        fn(*a, **kw)
        return keep

    return call


def cases():
    """(op, shape, dtype, torch op call, native call of the same kernel or None)."""
    from ferrite._ops import _native, _raw_stream

    bf = torch.bfloat16
    dev = "cuda"
    sd = dict(device=0, stream=_raw_stream(0) if _raw_stream else torch.cuda.current_stream().cuda_stream)
    out = []

    x = torch.randn(32768, 4096, device=dev, dtype=bf)
    w = torch.rand(4096, device=dev, dtype=bf) + 0.5
    y = torch.empty_like(x)
    rstd = torch.empty(32768, device=dev, dtype=torch.float32)
    out.append(
        (
            "norm",
            "rms_norm 32768×4096 fwd",
            "bf16",
            lambda: ferrite.rms_norm(x, [4096], w, 1e-5),
            native(_native.norm_forward, "rms_norm", x, y, weight=w, bias=None, mean=None, rstd=rstd, eps=1e-5, **sd),
        )
    )
    out.append(
        (
            "softmax",
            "32768×4096 fwd",
            "bf16",
            lambda: ferrite.softmax(x),
            native(_native.softmax_forward, x, y, 1.0, **sd),
        )
    )

    a = torch.randn(4096, 4096, device=dev, dtype=bf)
    b = torch.randn(4096, 4096, device=dev, dtype=bf)
    c = torch.empty(4096, 4096, device=dev, dtype=bf)
    out.append(
        (
            "matmul",
            "4096×4096×4096 NN",
            "bf16",
            lambda: ferrite.matmul(a, b),
            native(_native.matmul, a, b, c, 1.0, 0.0, False, sd["device"], sd["stream"]),
        )
    )

    q, k, v = (torch.randn(4, 4096, 16, 128, device=dev, dtype=bf) for _ in range(3))
    o = torch.empty_like(q)
    lse = torch.empty(4, 16, 4096, device=dev, dtype=torch.float32)
    for causal in (False, True):
        kw = dict(
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, layout="bshd", scale=None,
            causal=causal, window_left=-1, window_right=-1, softcap=0.0,
        )
        out.append(
            (
                "attention",
                "B4 H16 S4096 D128 causal fwd" if causal else "B4 H16 S4096 D128 fwd",
                "bf16",
                (lambda c=causal: ferrite.flash_attn_func(q, k, v, causal=c)),
                native(_native.attention_forward, q, k, v, o, lse, **kw, **sd),
            )
        )

    logits = torch.randn(8192, 50257, device=dev, dtype=bf)
    t = torch.randint(0, 50257, (8192,), device=dev)
    rows = torch.empty(8192, device=dev, dtype=torch.float32)
    total = torch.empty(1, device=dev, dtype=torch.float32)
    grad = torch.empty_like(logits)
    # loss and dlogits in one kernel, as `ferrite bench cross_entropy` times it (fwd+bwd)
    out.append(
        (
            "cross_entropy",
            "8192×50257 fwd+bwd",
            "bf16",
            lambda: torch.ops.ferrite.cross_entropy(logits, t, -100, 0.0, "mean", True),
            native(
                _native.cross_entropy, logits, t, rows, loss=total, grad=grad, ignore_index=-100,
                label_smoothing=0.0, reduction="mean", dloss=1.0, check_targets=False, **sd,
            ),
        )
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
    print("queued: 20 calls between two events (the host runs ahead, as in a model); host: µs to issue one call;")
    print("native: the same kernel through ferrite._native, queued, interleaved with the op in this process")
    print(
        f"{'op':<14} {'shape':<30} {'rust variant':<14} {'rust ms':>9} {'single ms':>10} {'queued ms':>10} "
        f"{'native ms':>10} {'host µs':>8} {'queued/rust':>12} {'op/native':>10}"
    )
    for op, shape, dtype, fn, raw in cases():
        r = rust_best(records, op, shape, dtype)
        ms = bench(fn)
        q = bench_back_to_back(fn)
        qi, nat = interleaved([fn, raw]) if raw else (q, None)
        h = host_us(fn)
        ratio = q / r["median_ms"] if r else None
        own = qi / nat if nat else None
        rows.append(dict(op=op, shape=shape, dtype=dtype, rust_variant=r and r["variant"], rust_ms=r and r["median_ms"],
                         python_single_ms=ms, python_queued_ms=q, python_queued_interleaved_ms=qi, native_queued_ms=nat,
                         host_us_per_call=h, ratio=ratio, op_over_native=own))
        rv = r["variant"] if r else "(not benched)"
        rm = f"{r['median_ms']:.4f}" if r else "-"
        rt = f"{ratio:.3f}" if ratio else "-"
        nm = f"{nat:.4f}" if nat else "-"
        ot = f"{own:.3f}" if own else "-"
        print(f"{op:<14} {shape:<30} {rv:<14} {rm:>9} {ms:>10.4f} {q:>10.4f} {nm:>10} {h:>8.1f} {rt:>12} {ot:>10}")
    if "--profile" in sys.argv:
        import cProfile
        import pstats

        for op, shape, dtype, fn, _raw in cases()[:2]:
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
