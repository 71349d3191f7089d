"""ferrite.scaled_mm against torch._scaled_mm in one process (GPU): e4m3 × e4m3 → bf16, tensor-wise
and row-wise scales, default and fast accumulation; CUDA-event medians of alternating rounds,
plus each path's error against the float64 product of the dequantised inputs on a smaller case.

    python3 scripts/gpu-suite/fp8_peers.py OUT.json [M,N,K ...]
"""

import json
import statistics
import sys

import torch

import ferrite

E4 = torch.float8_e4m3fn
SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 14336, 4096), (8192, 4096, 14336), (1008, 1008, 1008), (64, 4096, 4096), (16, 14336, 4096)]


def inputs(m, n, k, rowwise, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.rand(m, k, device="cuda", generator=g) * 12 - 6).to(E4)
    w = (torch.rand(n, k, device="cuda", generator=g) * 12 - 6).to(E4)
    if rowwise:
        sa = torch.rand(m, 1, device="cuda", generator=g) * 0.05 + 0.01
        sb = torch.rand(1, n, device="cuda", generator=g) * 0.05 + 0.01
    else:
        sa = torch.tensor(0.05, device="cuda")
        sb = torch.tensor(0.02, device="cuda")
    return a, w, sa, sb


def runs(a, w, sa, sb, rowwise):
    """(name, closure, is_peer) of every path for these inputs."""
    r = {
        "ferrite wgmma": lambda: ferrite.scaled_mm(a, w, sa, sb.reshape(-1), out_dtype=torch.bfloat16),
        "ferrite wgmma_fast": lambda: ferrite.scaled_mm(a, w, sa, sb.reshape(-1), out_dtype=torch.bfloat16, variant="wgmma_fast"),
        "torch _scaled_mm": lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16),
    }
    if not rowwise:
        r["torch _scaled_mm fast_accum"] = lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)
    return r


def supported(fns):
    """The paths that run these inputs (torch._scaled_mm needs dims divisible by 16)."""
    ok = {}
    for k, f in fns.items():
        try:
            f()
            ok[k] = f
        except RuntimeError as e:
            print(f"  {k}: not run ({str(e).splitlines()[0]})")
    return ok


def time_rounds(fns, rounds=7, reps=20):
    for f in fns.values():
        for _ in range(5):
            f()
    torch.cuda.synchronize()
    ms = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(list(fns)))
        for k in order:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                fns[k]()
            e.record()
            e.synchronize()
            ms[k].append(s.elapsed_time(e) / reps)
    return {k: statistics.median(v) for k, v in ms.items()}


def errors(rowwise):
    m, n, k = 512, 768, 4096
    a, w, sa, sb = inputs(m, n, k, rowwise, seed=1)
    ref = (a.double() * sa.double().reshape(-1, 1) if rowwise else a.double() * sa.double()) @ (
        w.double() * sb.double().reshape(-1, 1) if rowwise else w.double() * sb.double()
    ).T
    out = {}
    for name, f in supported(runs(a, w, sa, sb, rowwise)).items():
        d = f().double()
        out[name] = ((d - ref).norm() / ref.norm()).item()
    # The same with an f32 output: the accumulation's error without bf16's rounding.
    d32 = ferrite.scaled_mm(a, w, sa, sb.reshape(-1), out_dtype=torch.float32).double()
    out["ferrite wgmma (f32 out)"] = ((d32 - ref).norm() / ref.norm()).item()
    d32 = ferrite.scaled_mm(a, w, sa, sb.reshape(-1), out_dtype=torch.float32, variant="wgmma_fast").double()
    out["ferrite wgmma_fast (f32 out)"] = ((d32 - ref).norm() / ref.norm()).item()
    return out


def main():
    path = sys.argv[1]
    shapes = [tuple(int(x) for x in s.split(",")) for s in sys.argv[2:]] or SHAPES
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rows = []
    for rowwise in (False, True):
        for m, n, k in shapes:
            a, w, sa, sb = inputs(m, n, k, rowwise)
            fns = supported(runs(a, w, sa, sb, rowwise))
            t = time_rounds(fns)
            peer = t.get("torch _scaled_mm", float("nan"))
            for name, ms in t.items():
                tf = 2 * m * n * k / ms / 1e9
                rows.append(dict(shape=f"{m}x{n}x{k}", scales="row-wise" if rowwise else "tensor-wise", path=name, median_ms=ms, tflops=tf, ratio_to_torch=peer / ms))
                print(f"{m}x{n}x{k:<6} {'row' if rowwise else 'tensor':6} {name:28} {ms:8.4f} ms {tf:7.1f} TFLOP/s  x torch {peer / ms:5.2f}")
    errs = {"tensor-wise": errors(False), "row-wise": errors(True)}
    for kind, e in errs.items():
        for name, v in e.items():
            print(f"error 512x768x4096 {kind:11} {name:30} {v:.2e}")
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows, errors=errs), f, indent=1)


if __name__ == "__main__":
    main()
