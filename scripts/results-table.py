"""Summarises a bench JSON (from `ferrite bench --json`) as a markdown table: per (device, op,
dtype, shape) the best ferrite variant, its rate, % of the ceiling and ratio to the peer measured in
the same run; and, when given, the PyTorch peers of the GPU suite.
    python3 scripts/results-table.py bench.json [torch_peers.json] > table.md
"""
import json
import sys


def rate(r):
    if r["flops"] > 0:
        t = r["tflops"]
        return f"{t:.1f} TFLOP/s" if t >= 1 else f"{t * 1e3:.1f} GFLOP/s"
    return f"{r['gbps']:.0f} GB/s"


def main():
    bench = json.load(open(sys.argv[1]))
    recs = bench["records"]
    groups = {}
    for r in recs:
        groups.setdefault((r["device"], r["op"], r["dtype"], r["shape"]), []).append(r)
    print("| device | op | dtype | shape | best ferrite variant | rate | % of ceiling | × peer (peer) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (dev, op, dtype, shape), rs in groups.items():
        mine = [r for r in rs if not r["is_peer"]]
        if not mine:
            continue
        best = min(mine, key=lambda r: r["median_ms"])
        pct = f"{best['pct_of_ceiling']:.0f}% {best['ceiling']}" if best.get("pct_of_ceiling") else "-"
        peer = f"{best['ratio_to_peer']:.2f} ({best['peer']})" if best.get("ratio_to_peer") else "-"
        print(f"| {dev.split(' (')[0]} | {op} | {dtype} | {shape} | {best['variant']} | {rate(best)} | {pct} | {peer} |")
    if len(sys.argv) > 2:
        peers = json.load(open(sys.argv[2]))["peers"]
        print()
        print("| op | dtype | shape | PyTorch peer | peer GB/s | ferrite best | ferrite GB/s | × peer |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for p in peers:
            if "ferrite_variant" in p:
                mine_gbps = p["gbps"] * p["ratio_ferrite_to_peer"]
                print(f"| {p['op']} | {p['dtype']} | {p['shape']} | {p['variant']} | {p['gbps']:.0f} | {p['ferrite_variant']} | {mine_gbps:.0f} | {p['ratio_ferrite_to_peer']:.2f} |")


if __name__ == "__main__":
    main()
