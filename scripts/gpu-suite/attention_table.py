"""Per shape: ferrite's `hopper` and `flash` next to SDPA's cuDNN and FA2 backends of the same run.

The README's and docs/attention.md's attention tables come from this (ratios > 1: ferrite faster):
`hopper` against cuDNN (the issue's ≥ 0.8× forward / ≥ 0.7× backward targets) and `flash` (the
sm_80 rung) against FA2. Usage:
    python3 attention_table.py BENCH_JSON PEERS_JSON > attention_table.md
"""
import json
import sys


def main():
    ours = json.load(open(sys.argv[1]))["records"]
    peers = json.load(open(sys.argv[2]))["peers"]
    mine = {(r["variant"], r["shape"]): r for r in ours
            if r["op"] == "attention" and r["dtype"] == "bf16" and not r.get("is_peer")}
    theirs = {(p["variant"], p["shape"]): p for p in peers if p["op"] == "attention"}
    shapes = list(dict.fromkeys(r["shape"] for r in ours if r["op"] == "attention"))
    print("| shape | pass | `hopper` TFLOP/s | × cuDNN | `flash` TFLOP/s | × FA2 | cuDNN TFLOP/s | FA2 TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in shapes:
        h, f = mine.get(("hopper", s)), mine.get(("flash", s))
        c, a = theirs.get(("sdpa_cudnn", s)), theirs.get(("sdpa_flash", s))
        if not (h or f):
            continue
        base, _, pas = s.rpartition(" ")

        def rate(x):
            return f"{x['tflops']:.0f}" if x else "–"

        def ratio(x, peer):
            return f"{peer['median_ms'] / x['median_ms']:.2f}" if x and peer else "–"

        print(f"| {base} | {pas} | {rate(h)} | {ratio(h, c)} | {rate(f)} | {ratio(f, a)} | {rate(c)} | {rate(a)} |")


if __name__ == "__main__":
    main()
