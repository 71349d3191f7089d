"""The data-parallel table from a dist.sh results folder: tokens/s of ferrite's trainer on one and
two GPUs and of torch.compile / DDP + torch.compile, the scaling and the ratios, and a result
record (dist.json) in the issue's format.

usage: python3 dist_table.py RESULTS_DIR
"""
import json
import os
import sys


def load(d, name):
    p = os.path.join(d, name)
    return json.load(open(p)) if os.path.exists(p) else None


def main():
    d = sys.argv[1]
    f1, f2, fn, fz = (load(d, f"ferrite-{n}.json") for n in ["1gpu", "2gpu", "2gpu-no-overlap", "2gpu-zero"])
    t1, t2 = load(d, "torch-compile-1gpu.json"), load(d, "torch-ddp-compile-2gpu.json")
    tf = load(d, "torch-fsdp2-compile-2gpu.json")
    tps = lambda r, k="summary": (r[k]["tokens_per_s"] if k else r["tokens_per_s"]) if r else None
    rows = [
        ("ferrite, 1 GPU", tps(f1), f1 and f1["summary"]["peak_gib"]),
        ("ferrite, 2 GPUs (data parallel)", tps(f2), f2 and f2["summary"]["peak_gib"]),
        ("ferrite, 2 GPUs (all-reduce after)", tps(fn), fn and fn["summary"]["peak_gib"]),
        ("ferrite, 2 GPUs (ZeRO-1)", tps(fz), fz and fz["summary"]["peak_gib"]),
        ("torch.compile, 1 GPU", tps(t1, None), t1 and t1["peak_gib"]),
        ("DDP + torch.compile, 2 GPUs", tps(t2, None), t2 and t2["peak_gib"]),
        ("FSDP2 + torch.compile, 2 GPUs", tps(tf, None), tf and tf["peak_gib"]),
    ]
    print(f"{'run':<34} {'tokens/s':>10} {'peak GiB/GPU':>13}")
    for name, v, g in rows:
        if v:
            print(f"{name:<34} {v:>10.0f} {g:>13.2f}")
    for name, r in [("", f2), (" (all-reduce after the backward)", fn), (" (ZeRO-1)", fz)]:
        if f1 and r:
            print(f"ferrite scaling{name}, 2 GPUs / 1: {tps(r) / tps(f1):.3f}x")
    if f2 and t2:
        print(f"ferrite 2 GPUs / DDP + torch.compile 2 GPUs: {tps(f2) / tps(t2, None):.3f}x")
    if fz and tf:
        print(f"ferrite ZeRO-1 2 GPUs / FSDP2 + torch.compile 2 GPUs: {tps(fz) / tps(tf, None):.3f}x")
    if t1 and t2:
        print(f"torch scaling, 2 GPUs / 1: {tps(t2, None) / tps(t1, None):.3f}x")
    rec = {
        "model": (f2 or f1 or {}).get("model", {}).get("name"),
        "device": (f2 or f1 or {}).get("summary", {}).get("device"),
        "world_size": 2,
        "tokens_per_s": {"ferrite": tps(f2), "ferrite_no_overlap": tps(fn), "ferrite_zero1": tps(fz),
                         "torch_ddp_compile": tps(t2, None), "torch_fsdp2_compile": tps(tf, None)},
        "tokens_per_s_1gpu": {"ferrite": tps(f1), "torch_compile": tps(t1, None)},
    }
    json.dump(rec, open(os.path.join(d, "dist.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
