"""NCCL's own rate on this machine, through torch.distributed: all-reduce, reduce-scatter and
all-gather of the buffers the trainer moves (GPT-2 124M's bf16 gradient, 124.5 M elements, and a
few sizes around it), CUDA events around each call, median of 20 after 5 warm-ups. Bus bandwidth
as nccl-tests defines it (all-reduce: 2(n-1)/n · bytes / t; reduce-scatter and all-gather:
(n-1)/n · bytes / t).

usage: torchrun --standalone --nproc_per_node 2 nccl_bw.py [--json out.json]
"""
import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for elems in [1 << 20, 16 << 20, 124_475_904, 256 << 20]:
        elems -= elems % n
        x = torch.randn(elems, device="cuda", dtype=torch.bfloat16)
        part = torch.empty(elems // n, device="cuda", dtype=torch.bfloat16)
        for op in ["all_reduce", "reduce_scatter", "all_gather"]:
            def call():
                if op == "all_reduce":
                    dist.all_reduce(x)
                elif op == "reduce_scatter":
                    dist.reduce_scatter_tensor(part, x)
                else:
                    dist.all_gather_into_tensor(x, part)
            times = []
            for i in range(25):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                call()
                e.record()
                e.synchronize()
                if i >= 5:
                    times.append(s.elapsed_time(e))
            ms = statistics.median(times)
            nbytes = elems * 2
            factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
            rows.append({"op": op, "elements": elems, "bytes": nbytes, "ms": ms,
                         "algbw_gbs": nbytes / ms / 1e6, "busbw_gbs": factor * nbytes / ms / 1e6})
            if rank == 0:
                print(f"{op:>15} {nbytes / 2**20:9.1f} MiB bf16  {ms:8.3f} ms  bus {rows[-1]['busbw_gbs']:7.1f} GB/s", flush=True)
    if rank == 0 and a.json:
        json.dump({"world_size": n, "device": torch.cuda.get_device_name(), "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                   "rows": rows}, open(a.json, "w"), indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
