"""Sustained GEMM throughput, SM clock and board power: cuBLAS (torch.matmul) against ferrite's
matmul (its default pick: `wgmma` on sm_90), each run back to back for a few seconds, alternating,
while nvidia-smi samples clocks and power every 50 ms. Tells a per-clock gap from a clock gap:
under the power limit a kernel that spends more energy per FLOP runs at a lower clock.
    python3 power_clocks.py OUT_JSON [--m 8192 --n 14336 --k 4096 --seconds 3 --rounds 3]
                                     [--configs c2g8,c1g8]
With --configs, ferrite also runs under each named `wgmma` launch configuration (the
FERRITE_WGMMA_CONFIG knob, set before each of its phases) beside its default pick.
"""
import os
import argparse
import json
import statistics
import subprocess
import time

import torch

import ferrite


def sampler():
    return subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=subprocess.PIPE,
        text=True,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--n", type=int, default=14336)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default="")
    a = p.parse_args()
    x = torch.randn(a.m, a.k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(a.k, a.n, device="cuda", dtype=torch.bfloat16)
    ways = {"cublas": lambda: torch.matmul(x, w), "ferrite": lambda: ferrite.matmul(x, w)}
    configs = {"ferrite": None}
    for c in filter(None, a.configs.split(",")):
        ways[f"ferrite {c}"] = ways["ferrite"]
        configs[f"ferrite {c}"] = c
    err = (ways["ferrite"]().float() - ways["cublas"]().float()).abs().max().item()
    flop = 2 * a.m * a.n * a.k
    phases = []
    for r in range(a.rounds):
        for name, f in ways.items():
            if name in configs:
                os.environ.pop("FERRITE_WGMMA_CONFIG", None)
                if configs[name]:
                    os.environ["FERRITE_WGMMA_CONFIG"] = configs[name]
                f()  # plan (and compile) outside the timed phase
            torch.cuda.synchronize()
            smi = sampler()
            time.sleep(0.2)
            t0 = time.time()
            calls = 0
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            while time.time() - t0 < a.seconds:
                for _ in range(10):
                    f()
                calls += 10
                torch.cuda.synchronize()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
            smi.terminate()
            lines = [l.split(", ") for l in smi.communicate()[0].strip().splitlines()]
            # the samples while the loop ran (drop the first 300 ms of ramp-up)
            vals = [(float(c), float(pw), float(tp)) for _, c, pw, tp in lines[6:]] or [(0, 0, 0)]
            phases.append(
                dict(
                    way=name,
                    round=r,
                    calls=calls,
                    ms_per_call=ms / calls,
                    tflops=flop * calls / ms / 1e9,
                    sm_mhz=statistics.median(v[0] for v in vals),
                    power_w=statistics.median(v[1] for v in vals),
                    temp_c=max(v[2] for v in vals),
                )
            )
            q = phases[-1]
            print(
                f"{name:<15} round {r}: {q['ms_per_call']:.3f} ms/call {q['tflops']:.0f} TFLOP/s, "
                f"SM {q['sm_mhz']:.0f} MHz, {q['power_w']:.0f} W, {q['temp_c']:.0f} C"
            )
    summary = {}
    for name in ways:
        ph = [q for q in phases if q["way"] == name]
        summary[name] = {k: statistics.median(q[k] for q in ph) for k in ("ms_per_call", "tflops", "sm_mhz", "power_w")}
        s = summary[name]
        s["tflop_per_ghz"] = s["tflops"] / (s["sm_mhz"] / 1000)
        s["gflop_per_joule"] = s["tflops"] * 1000 / s["power_w"]
    print(f"{a.m}×{a.n}×{a.k} bf16 NN, max |ferrite − cublas| = {err:.3g}")
    for name, s in summary.items():
        print(
            f"{name:<15} median {s['ms_per_call']:.3f} ms, {s['tflops']:.0f} TFLOP/s, {s['sm_mhz']:.0f} MHz, "
            f"{s['power_w']:.0f} W: {s['tflop_per_ghz']:.0f} TFLOP/s per GHz, {s['gflop_per_joule']:.0f} GFLOP/J"
        )
    with open(a.out, "w") as f:
        json.dump(dict(args=vars(a), max_abs_diff=err, phases=phases, summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
