"""`ferrite.linear` against `F.linear` (cuBLAS) at decode shapes, as a PyTorch user calls them:
x [M, K] · W[N, K]ᵀ (+ bias), bf16, M ∈ {1, 16, 64}; CUDA-event medians in alternating rounds
of the same call, several weight copies rotated so every call reads W from DRAM (a decode step
never finds its layer's weight in L2). Timed as CUDA-graph replays (the kernels: the weight read
rate in TB/s) and as eager loops (what an eager caller gets, Python launch cost included).

    python3 decode_linear.py --out decode_linear.json
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (50257, 768), (128256, 4096)]
ROWS = [1, 16, 64]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args()
    import ferrite

    dev, dt = "cuda", torch.bfloat16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for n, k in SHAPES:
        wbytes = n * k * 2
        copies = max(2, -(-3 * l2 // wbytes))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * k**-0.5 for _ in range(copies)]
        bias = torch.randn(n, device=dev, dtype=dt)
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = F.linear(x.float(), ws[0].float(), bias.float())
            got = ferrite.linear(x, ws[0], bias).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            fns = {"ferrite": lambda w: ferrite.linear(x, w, bias),
                   "torch": lambda w: F.linear(x, w, bias)}
            # Each side's calls (weights rotated) captured once in a CUDA graph: replays time the
            # kernels without the Python launch cost; eager loops time what an eager user gets.
            reps = 4 * copies
            graphs = {}
            for name, fn in fns.items():
                for w in ws:
                    fn(w)
                torch.cuda.synchronize()
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    for i in range(reps):
                        fn(ws[i % copies])
                graphs[name] = gr

            def run_graph(name):
                graphs[name].replay()

            def run_eager(name):
                for i in range(reps):
                    fns[name](ws[i % copies])

            med = {}
            for mode, run in (("graph", run_graph), ("eager", run_eager)):
                times = {name: [] for name in fns}
                for r in range(a.rounds):
                    order = list(fns) if r % 2 == 0 else list(fns)[::-1]
                    for name in order:
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        run(name)
                        e.record()
                        torch.cuda.synchronize()
                        times[name].append(s.elapsed_time(e) / reps)
                med[mode] = {name: statistics.median(t) for name, t in times.items()}
            g_ = med["graph"]
            row = {"shape": f"{m}×{n}×{k}", "m": m, "n": n, "k": k, "max_rel_err": err,
                   "median_ms": med,
                   "weight_tb_s": {name: wbytes / (t * 1e-3) / 1e12 for name, t in g_.items()},
                   "ratio_to_torch": g_["torch"] / g_["ferrite"],
                   "ratio_to_torch_eager": med["eager"]["torch"] / med["eager"]["ferrite"]}
            rows.append(row)
            print(f"{row['shape']:>18}  graph: ferrite {g_['ferrite'] * 1e3:7.1f} us "
                  f"({row['weight_tb_s']['ferrite']:.2f} TB/s)  torch {g_['torch'] * 1e3:7.1f} us "
                  f"({row['weight_tb_s']['torch']:.2f} TB/s)  ×{row['ratio_to_torch']:.2f}  "
                  f"eager ×{row['ratio_to_torch_eager']:.2f}  err {err:.1e}", flush=True)
    json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows},
              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
