"""PyTorch's int8 weight-only matmul on the shapes `ferrite bench w8a16` runs, for comparison:
`torch._weight_int8pack_mm(a, w_int8, scales)` (bf16 activations, int8 weights with one scale
per output channel) and `F.linear(a, w_bf16)` (cuBLAS, the bf16 weight), and ferrite.w8a16 when importable, timed with CUDA events
(median of 200 calls after 20 warm-up calls; weights larger than L2 where the shape allows).
Prints one JSON object per shape.
    python3 w8a16_torch.py > w8a16_torch.json
"""
import json
import statistics

import torch
import torch.nn.functional as F

try:  # with the wheel on the path, ferrite.w8a16 is timed too (its PyTorch custom op, host included)
    import ferrite
except ImportError:
    ferrite = None

SHAPES = [(1, 4096, 4096), (1, 14336, 4096), (1, 4096, 14336), (1, 128256, 4096),
          (8, 14336, 4096), (16, 14336, 4096), (64, 14336, 4096)]


def median_ms(fn, reps=200, warm=20):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for m, n, k in SHAPES:
        a = torch.rand(m, k, device=dev, dtype=torch.bfloat16) * 2 - 1
        wf = (torch.rand(n, k, device=dev) * 2 - 1) * 0.05
        s = wf.abs().amax(dim=1) / 127.0
        w8 = torch.round(wf / s[:, None]).clamp(-127, 127).to(torch.int8)
        wb = (w8.float() * s[:, None]).to(torch.bfloat16)
        s16 = s.to(torch.bfloat16)
        row = {"shape": f"{m}×{n}×{k}", "device": torch.cuda.get_device_name()}
        try:
            y = torch._weight_int8pack_mm(a, w8, s16)
            ref = a.float() @ wb.float().t()
            row["int8pack_rel_err"] = float((y.float() - ref).abs().max() / ref.abs().max())
            row["int8pack_ms"] = median_ms(lambda: torch._weight_int8pack_mm(a, w8, s16))
        except Exception as e:  # noqa: BLE001 — report what torch refused
            row["int8pack_error"] = str(e).splitlines()[0]
        row["linear_bf16_ms"] = median_ms(lambda: F.linear(a, wb))
        if ferrite is not None:  # the same weight through ferrite's PyTorch op
            s32 = s.float()
            y = ferrite.w8a16(a, w8, s32)
            ref = a.float() @ wb.float().t()
            row["ferrite_rel_err"] = float((y.float() - ref).abs().max() / ref.abs().max())
            row["ferrite_ms"] = median_ms(lambda: ferrite.w8a16(a, w8, s32))
            row["ferrite_x_linear"] = row["linear_bf16_ms"] / row["ferrite_ms"]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
