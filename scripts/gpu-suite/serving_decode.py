"""Paged-KV decode as a serving engine runs it: ragged batches, ferrite's plan/run against PyTorch SDPA.

Batches: B sequences whose lengths are drawn uniformly from [lo, hi] (integers, a fixed seed per
case: torch.Generator().manual_seed(SEED + case index)); q one token per sequence, GQA 32/8 and MHA
32/32, D 128, bf16. Cases (B, lo, hi): (32, 512, 8192), (128, 128, 4096), (8, 1024, 32768); page
(block) size 16 for every case, and 1, 32, 64, 128 for the first. The paged caches hold each
sequence's tokens in shuffled blocks (a random block table, unused entries −1).

Contestants, timed in alternating rounds (the order rotated each round), each call between two
CUDA events behind a 5 ms GPU sleep kernel (so the host's launch cost is hidden and the events time
the GPU's work, as in a CUDA-graph replay), median of ROUNDS (≥ 50) calls after a warm-up; the
host time of each call (its Python and native launch cost, what an eager caller also pays) is
recorded beside it, and a warning is printed where it exceeded the sleep:
- ferrite_planned_mma: the same with the tensor-core kernel (variant="pipelined_mma").
- ferrite_planned:   `ferrite.paged_decode(..., plan=plan)` on a plan made once (what every layer
                     after the first of a decode step costs);
- ferrite_plan_run:  `ferrite.paged_decode_plan` + the run (one layer with its own plan);
- ferrite_unplanned: `ferrite.paged_decode` without a plan (it plans for itself and reads its
                     error flag back: the 4-byte copy and the stream sync are in its time);
- sdpa_masked:       `F.scaled_dot_product_attention(enable_gqa=True)` on a padded contiguous cache
                     [B, Hkv, max_len, D] with a boolean mask of the ragged lengths (the same result);
- sdpa_nomask:       the same padded cache without the mask (reads the same bytes; the result
                     attends over the padding, so it is a bandwidth peer, not a correct one).
Before timing, ferrite's outputs (all three) are checked against sdpa_masked (max abs diff < 2e-2)
and the plan's error flag is read: any failure stops the script with a non-zero exit.

Reported per case and contestant: ms; GB/s of the K+V bytes the batch actually needs
(2·Σlen·Hkv·D·2 bytes, the same count for every contestant); % of the device copy rate (a large
`Tensor.copy_`, GB/s = 2·bytes/time, measured at the start); ratio_to_peer = sdpa_masked ms / the
row's ms (> 1: faster than SDPA), ratio_to_unmasked_peer likewise against sdpa_nomask; host µs
per call. Decode only reads, so its GB/s can pass the copy rate (which counts a read and a write).

    python3 scripts/gpu-suite/serving_decode.py OUT.json [--quick] [--rounds N]

OUT.json: {"device", "torch", "ferrite", "copy_gbps", "rounds", "seed", "rows": [{"op": "decode",
"variant", "dtype": "bf16", "shape": "B32 Hq32 Hkv8 D128 ragged 512..8192 bs16", "ms", "gbps",
"pct_of_ceiling", "ratio_to_peer", "ratio_to_unmasked_peer", "is_peer", "device", "host_us", ...}]}.
--quick: the first case at page 16 only (both head layouts). About 30 s on an H200 in full.
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SEED = 1234
CASES = [(32, 512, 8192), (128, 128, 4096), (8, 1024, 32768)]
HEADS = [(32, 8), (32, 32)]
HEAD_DIM = 128
PAGE_SIZES_FIRST = [1, 16, 32, 64, 128]
PAGE_SIZE = 16
TOL = 2e-2
SLEEP_MS = 5.0  # GPU sleep ahead of each timed call: longer than any contestant's host time
FERRITE = ["ferrite_planned", "ferrite_planned_mma", "ferrite_plan_run", "ferrite_unplanned"]
PEERS = ["sdpa_masked", "sdpa_nomask"]


def copy_rate_gbps(nbytes=2 << 30, reps=20):
    """The device copy rate: a `nbytes` copy_, GB/s = 2·bytes (read + write) / median time."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (statistics.median(times) * 1e-3) / 1e9


def sleep_cycles(ms):
    """Cycles of torch.cuda._sleep that keep the GPU busy for about `ms` (calibrated)."""
    cycles = 1_000_000
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return max(1, int(cycles * ms / max(a.elapsed_time(b), 1e-3)))


def time_rounds(fns, rounds, cycles, sleep_ms, syncing=(), warmup=5):
    """{name: (median device ms, median host µs per call or None, host-bound share)}: `rounds`
    rounds, each timing every fn once, the order rotated per round. Each call sits between two
    events queued behind a sleep kernel of `sleep_ms`, so the host has queued the call before the
    GPU reaches it and the events time the GPU's work alone; a call whose host time exceeds the
    sleep (host-bound: its events then include host time) is counted in the share. The host time
    of a call in `syncing` (it waits for the GPU) is not reported."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    torch.cuda.synchronize()
    dev = {n: [] for n in names}
    host = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)
            a.record()
            t = time.perf_counter()
            fns[n]()
            host[n].append((time.perf_counter() - t) * 1e3)
            b.record()
            b.synchronize()
            dev[n].append(a.elapsed_time(b))
    out = {}
    for n in names:
        sync = n in syncing
        bound = 0.0 if sync else sum(h > sleep_ms for h in host[n]) / rounds
        out[n] = (statistics.median(dev[n]), None if sync else 1e3 * statistics.median(host[n]), bound)
    return out


def padded_cache(lens, hkv, d, gen_seed):
    """K, V [B, Hkv, max_len, D] bf16 (random everywhere, the padding included) and the mask."""
    torch.manual_seed(gen_seed)
    b, max_len = len(lens), max(lens)
    k = torch.randn(b, hkv, max_len, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, max_len, d, device="cuda", dtype=torch.bfloat16)
    lens_t = torch.tensor(lens, device="cuda")
    mask = torch.arange(max_len, device="cuda")[None, :] < lens_t[:, None]  # [B, max_len]
    return k, v, mask


def paged_cache(k, v, mask, lens, bs, seed):
    """The padded K, V's valid tokens in paged caches [num_blocks, bs, Hkv, D], each sequence's
    blocks shuffled over the cache; the block table (unused entries −1) and seq_lens."""
    b, hkv, _, d = k.shape
    nb = [math.ceil(n / bs) for n in lens]
    total = sum(nb)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    perm = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
    nb_t = torch.tensor(nb, device="cuda")
    seq = torch.repeat_interleave(torch.arange(b, device="cuda"), nb_t)
    starts = torch.cumsum(nb_t, 0) - nb_t
    pos = torch.arange(total, device="cuda") - starts[seq]
    table = torch.full((b, max(nb)), -1, dtype=torch.int32, device="cuda")
    table[seq, pos] = perm
    i, t = mask.nonzero(as_tuple=True)
    slot = table[i, t // bs].long() * bs + t % bs
    kc = torch.empty(total, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    kc.view(-1, hkv, d)[slot] = k[i, :, t]
    vc.view(-1, hkv, d)[slot] = v[i, :, t]
    return kc, vc, table, torch.tensor(lens, dtype=torch.int32, device="cuda")


def run_case(ferrite, b, lo, hi, case_idx, hq, hkv, page_sizes, rounds, cycles, ceiling, device, rows):
    d = HEAD_DIM
    gen = torch.Generator().manual_seed(SEED + case_idx)
    lens = torch.randint(lo, hi + 1, (b,), generator=gen).tolist()
    k, v, mask = padded_cache(lens, hkv, d, SEED + 100 * case_idx + hkv)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    q4 = q.view(b, hq, 1, d)
    mask4 = mask.view(b, 1, 1, -1)
    needed = 2 * sum(lens) * hkv * d * 2  # K + V bytes the batch needs, bf16
    sdpa_masked = lambda: F.scaled_dot_product_attention(q4, k, v, attn_mask=mask4, enable_gqa=True)
    sdpa_nomask = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    want = sdpa_masked().view(b, hq, d).float()
    for bs in page_sizes:
        kc, vc, table, seq_lens = paged_cache(k, v, mask, lens, bs, SEED + bs)
        shape = f"B{b} Hq{hq} Hkv{hkv} D{d} ragged {lo}..{hi} bs{bs}"
        plan = ferrite.paged_decode_plan(seq_lens, hq, hkv, d, torch.bfloat16)
        mma = "pipelined_mma"
        plan_mma = ferrite.paged_decode_plan(seq_lens, hq, hkv, d, torch.bfloat16, variant=mma)
        fns = {
            "ferrite_planned": lambda: ferrite.paged_decode(q, kc, vc, table, seq_lens, plan=plan),
            "ferrite_planned_mma": lambda: ferrite.paged_decode(
                q, kc, vc, table, seq_lens, plan=plan_mma, variant=mma
            ),
            "ferrite_plan_run": lambda: ferrite.paged_decode(
                q, kc, vc, table, seq_lens, plan=ferrite.paged_decode_plan(seq_lens, hq, hkv, d, torch.bfloat16)
            ),
            "ferrite_unplanned": lambda: ferrite.paged_decode(q, kc, vc, table, seq_lens),
            "sdpa_masked": sdpa_masked,
            "sdpa_nomask": sdpa_nomask,
        }
        errs = {}
        for name in FERRITE:
            errs[name] = (fns[name]().float() - want).abs().max().item()
            if not errs[name] < TOL:  # NaN fails too
                sys.exit(f"serving_decode: {shape}: {name} differs from SDPA (masked) by {errs[name]:.3e} (limit {TOL})")
        torch.cuda.synchronize()
        ferrite.paged_decode_errors(plan)  # raises if a run flagged a bad length or block entry
        timed = time_rounds(fns, rounds, cycles, SLEEP_MS, syncing=("ferrite_unplanned",))
        ferrite.paged_decode_errors(plan)
        ms = {n: t[0] for n, t in timed.items()}
        for name in FERRITE + PEERS:
            _, host_us, bound = timed[name]
            if bound > 0.1:
                print(f"warning: {shape} {name}: host time above the {SLEEP_MS} ms sleep in {100 * bound:.0f}% "
                      "of calls (its ms include host time)", flush=True)
            gbps = needed / (ms[name] * 1e-3) / 1e9
            peer = name in PEERS
            rows.append(dict(
                op="decode", variant=name, dtype="bf16", shape=shape, ms=ms[name], gbps=gbps,
                pct_of_ceiling=100 * gbps / ceiling,
                ratio_to_peer=None if peer else ms["sdpa_masked"] / ms[name],
                ratio_to_unmasked_peer=None if peer else ms["sdpa_nomask"] / ms[name],
                is_peer=peer, device=device, max_abs_diff=errs.get(name), host_us=host_us, host_bound_share=bound,
                kv_bytes_needed=needed, kv_bytes_padded=2 * b * hkv * max(lens) * d * 2,
                lens_sum=sum(lens), lens_max=max(lens), page_size=bs,
            ))
            r = rows[-1]
            ratios = "" if peer else f"  ×{r['ratio_to_peer']:.2f} masked  ×{r['ratio_to_unmasked_peer']:.2f} nomask"
            hs = "   (syncs)" if host_us is None else f"{host_us:7.0f} µs"
            print(f"{shape:48s} {name:18s} {ms[name]:8.4f} ms {gbps:7.0f} GB/s {r['pct_of_ceiling']:5.1f}%  host {hs}{ratios}",
                  flush=True)
        del kc, vc, table, seq_lens, plan, fns
    del k, v, mask, q, q4, mask4, want
    torch.cuda.empty_cache()


def markdown(rows, ceiling, device):
    out = [f"Paged decode, ragged batches, bf16, D{HEAD_DIM} on {device}; copy rate {ceiling:.0f} GB/s. "
           "GB/s: K+V bytes needed (2·Σlen·Hkv·D·2) / time; × SDPA: SDPA's time / this row's (> 1: faster).", "",
           "| shape | variant | ms | GB/s | % of copy | × SDPA masked | × SDPA no mask | host µs/call |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rm = "—" if r["ratio_to_peer"] is None else f"{r['ratio_to_peer']:.2f}"
        rn = "—" if r["ratio_to_unmasked_peer"] is None else f"{r['ratio_to_unmasked_peer']:.2f}"
        hu = "syncs" if r["host_us"] is None else f"{r['host_us']:.0f}"
        out.append(f"| {r['shape']} | {r['variant']} | {r['ms']:.4f} | {r['gbps']:.0f} | {r['pct_of_ceiling']:.1f} | {rm} | {rn} | {hu} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the JSON file to write")
    ap.add_argument("--quick", action="store_true", help="the first case at page 16 only")
    ap.add_argument("--rounds", type=int, default=60, help="timed calls per contestant (≥ 50)")
    a = ap.parse_args()
    if a.rounds < 50:
        ap.error("--rounds: at least 50")
    if not torch.cuda.is_available():
        sys.exit("serving_decode: needs a CUDA GPU")
    import ferrite

    n, why = ferrite.cuda_status()
    if n == 0:
        sys.exit(f"serving_decode: ferrite sees no CUDA device ({why})")
    t0 = time.time()
    device = torch.cuda.get_device_name()
    ceiling = copy_rate_gbps()
    cycles = sleep_cycles(SLEEP_MS)
    print(f"{device}, torch {torch.__version__}, ferrite {ferrite.__version__}: copy rate {ceiling:.0f} GB/s", flush=True)
    rows = []
    cases = CASES[:1] if a.quick else CASES
    for ci, (b, lo, hi) in enumerate(cases):
        for hq, hkv in HEADS:
            pages = PAGE_SIZES_FIRST if ci == 0 and not a.quick else [PAGE_SIZE]
            run_case(ferrite, b, lo, hi, ci, hq, hkv, pages, a.rounds, cycles, ceiling, device, rows)
    md = markdown(rows, ceiling, device)
    print()
    print(md)
    with open(a.out, "w") as fh:
        json.dump(dict(device=device, torch=torch.__version__, ferrite=ferrite.__version__, copy_gbps=ceiling,
                       rounds=a.rounds, seed=SEED, cases=cases, rows=rows), fh, indent=1)
    print(f"\nwrote {len(rows)} rows to {a.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
