#!/usr/bin/env python3
"""Summarise an Nsight Compute source page (ncu-source.sh's NAME-sass.csv): stall samples by
reason for the whole kernel and per opcode, the instructions with the most samples, and the
shared-memory wavefronts (actual vs ideal) per opcode.

    python3 scripts/gpu-suite/sass_hotspots.py warptile-sass.csv [--top 25]
"""
import csv
import sys
from collections import defaultdict


def num(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def main():
    path = sys.argv[1]
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 25
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = rows[head]
    data = [dict(zip(cols, r)) for r in rows[head + 1:] if len(r) == len(cols)]
    reasons = [c for c in cols if c.startswith("stall_") and "(Not Issued)" not in c]
    total = sum(num(d["Warp Stall Sampling (All Samples)"]) for d in data)
    print(f"{len(data)} instructions, {total:.0f} samples")
    by_reason = {r: sum(num(d[r]) for d in data) for r in reasons}
    print("stall reasons (share of all samples):")
    for r, v in sorted(by_reason.items(), key=lambda kv: -kv[1]):
        if v > 0.005 * total:
            print(f"  {r:24s} {100 * v / total:5.1f}%")
    ops = defaultdict(lambda: defaultdict(float))
    for d in data:
        op = d["Source"].split()[0] if d["Source"].split() else "?"
        if op.startswith("@"):
            op = d["Source"].split()[1]
        base = op.split(".")[0]
        o = ops[base]
        o["samples"] += num(d["Warp Stall Sampling (All Samples)"])
        o["exec"] += num(d["Instructions Executed"])
        o["wf"] += num(d["L1 Wavefronts Shared"])
        o["wf_ideal"] += num(d["L1 Wavefronts Shared Ideal"])
        for r in reasons:
            o[r] += num(d[r])
    print("\nper opcode: samples%, executed, top reasons; shared wavefronts actual/ideal")
    for op, o in sorted(ops.items(), key=lambda kv: -kv[1]["samples"])[:15]:
        rs = sorted(((o[r], r[6:]) for r in reasons), reverse=True)[:3]
        rtxt = ", ".join(f"{n} {100 * v / max(o['samples'], 1):.0f}%" for v, n in rs if v > 0)
        wf = f"  wf {o['wf']:.3g}/{o['wf_ideal']:.3g}" if o["wf"] else ""
        print(f"  {op:10s} {100 * o['samples'] / total:5.1f}%  exec {o['exec']:.3g}  [{rtxt}]{wf}")
    print(f"\ntop {top} instructions by samples:")
    for d in sorted(data, key=lambda d: -num(d["Warp Stall Sampling (All Samples)"]))[:top]:
        s = num(d["Warp Stall Sampling (All Samples)"])
        rs = sorted(((num(d[r]), r[6:]) for r in reasons), reverse=True)[:2]
        rtxt = ", ".join(f"{n} {v:.0f}" for v, n in rs if v > 0)
        print(f"  {d['Address'][-5:]} {100 * s / total:4.1f}%  {d['Source'].strip()[:60]:60s} [{rtxt}]")


if __name__ == "__main__":
    main()
