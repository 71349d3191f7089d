"""ferrite.quantize_fp8 (current scaling to e4m3, bf16 input) against the same quantisation written
in PyTorch, eager and torch.compile, in one process: CUDA-event medians of 30 calls.

    python3 scripts/gpu-suite/fp8_quantize_bench.py OUT.json
"""
import sys, json, statistics, torch, ferrite
def t(f, n=30):
    for _ in range(3): f()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record(); f(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
def torch_q(x, rowwise):
    fmax = 448.0
    amax = x.float().abs().amax(dim=1, keepdim=True) if rowwise else x.float().abs().amax()
    s = fmax / amax
    return (x.float() * s).clamp(-fmax, fmax).to(torch.float8_e4m3fn), 1 / s
rows = []
for (m, k) in [(8192, 8192), (16384, 4096), (4096, 14336)]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    tc = torch.compile(torch_q)
    for rowwise in [False, True]:
        r = {"shape": f"{m}x{k}", "rowwise": rowwise}
        r["ferrite_ms"] = t(lambda: ferrite.quantize_fp8(x, rowwise=rowwise))
        r["torch_eager_ms"] = t(lambda: torch_q(x, rowwise))
        r["torch_compile_ms"] = t(lambda: tc(x, rowwise))
        gb = m * k * (2 + 2 + 1) / 1e9  # x read twice (amax, codes), codes written
        r["ferrite_gbps"] = gb / r["ferrite_ms"] * 1e3
        rows.append(r); print(r)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
