"""Whole models: Hugging Face GPT-2 124M and a Llama-style ~1B, built from configs (no download),
timed as a user would run them — eager PyTorch, ``torch.compile``, ``ferrite.optimize``, and
``ferrite.optimize`` + ``torch.compile`` — in one process; with ``--variants`` also both compiled with
``mode="reduce-overhead"`` (CUDA graphs: ``torch_compile_graphs``, ``ferrite_compile_graphs``).

    python -m ferrite.bench_model --json out.json              # CUDA; all models and modes
    python -m ferrite.bench_model --models gpt2-124m --modes train --steps 20

Modes: ``train`` (forward + backward + fused AdamW step on bf16 weights, the model's own
causal-LM loss; ``use_cache=False``, as a training loop passes it), ``prefill`` (a forward under ``no_grad`` over B×T tokens), ``decode`` (greedy
generation with the model's KV cache, eager only: tokens generated per second). Each variant
starts from the same weights and sees the same batches; reported: tokens/s (median over timed
steps), peak memory (``max_memory_allocated``) and, for ``train``, the loss after the timed steps.
One JSON object per (model, mode): ``{"model", "mode", "device", "tokens_per_s": {...},
"peak_gib": {...}, "loss": {...}, "config": {...}}``.
"""

import argparse
import copy
import json
import statistics
import sys
import time

import torch

import ferrite

VARIANTS = ["torch_eager", "torch_compile", "ferrite", "ferrite_compile"]
# torch.compile modes by variant suffix: "_compile" the default, "_compile_graphs" CUDA graphs.
_MODES = {"compile": "default", "graphs": "reduce-overhead"}


def compiled(fn, variant):
    """fn, or fn under torch.compile in the variant's mode."""
    mode = _MODES.get(variant.rsplit("_", 1)[-1])
    return fn if mode is None else torch.compile(fn, mode=mode)


def build(name):
    import transformers

    if name == "gpt2-124m":
        cfg = transformers.GPT2Config(
            vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(cfg), dict(train=(16, 1024), prefill=(16, 1024), decode=(8, 128, 128))
    if name == "llama-1b":  # Llama-3.2-1B's shape: 16 layers, 2048 wide, GQA 32/8, vocab 128256
        cfg = transformers.LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
            rope_theta=500000.0, tie_word_embeddings=True,
        )
        return transformers.LlamaForCausalLM(cfg), dict(train=(4, 2048), prefill=(4, 2048), decode=(8, 128, 128))
    raise SystemExit(f"unknown model {name!r} (gpt2-124m, llama-1b)")


def variant_model(base, variant):
    m = copy.deepcopy(base)
    m.config._attn_implementation = "sdpa"
    report = []
    if variant.startswith("ferrite"):
        report = ferrite.optimize(m)
    return m, report


def sync_time(fn, steps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_train(base, variant, b, t, steps, warmup, batches):
    m, report = variant_model(base, variant)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    fwd = compiled(lambda ids: m(input_ids=ids, labels=ids, use_cache=False).loss, variant)
    graphs = variant.endswith("_graphs")
    it = iter(range(10**9))
    loss_box = []

    def step():
        ids = batches[next(it) % len(batches)]
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss = fwd(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        # a copy: a CUDA-graph replay writes over its previous outputs
        loss_box.append(loss.detach().clone())

    torch.cuda.reset_peak_memory_stats()
    s = sync_time(step, steps, warmup)
    peak = torch.cuda.max_memory_allocated() / 2**30
    loss = loss_box[-1].float().item()
    del m, opt
    return b * t / s, peak, loss, report


def run_prefill(base, variant, b, t, steps, warmup, batches):
    m, report = variant_model(base, variant)
    m.eval()
    fwd = compiled(lambda ids: m(input_ids=ids, logits_to_keep=1, use_cache=False).logits, variant)

    def step():
        with torch.no_grad():
            fwd(batches[0])

    torch.cuda.reset_peak_memory_stats()
    s = sync_time(step, steps, warmup)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del m
    return b * t / s, peak, None, report


def run_decode(base, variant, b, prompt, new, steps, warmup, batches):
    if "_compile" in variant:
        return None, None, None, []
    m, report = variant_model(base, variant)
    m.eval()
    ids = batches[0][:b, :prompt]

    def step():
        with torch.no_grad():
            m.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    torch.cuda.reset_peak_memory_stats()
    s = sync_time(step, max(1, steps // 4), 1)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del m
    return b * new / s, peak, None, report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2-124m,llama-1b")
    ap.add_argument("--modes", default="train,prefill,decode")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_model needs a CUDA GPU")
    dev = torch.cuda.get_device_name()
    rows = []
    for name in a.models.split(","):
        torch.manual_seed(0)
        base, shapes = build(name)
        base = base.to(device="cuda", dtype=torch.bfloat16)
        for mode in a.modes.split(","):
            shape = shapes[mode]
            b, t = shape[0], shape[1]
            g = torch.Generator(device="cuda").manual_seed(1)
            batches = [torch.randint(0, base.config.vocab_size, (b, t), device="cuda", generator=g) for _ in range(4)]
            rec = {"model": name, "mode": mode, "device": dev, "tokens_per_s": {}, "peak_gib": {}, "loss": {},
                   "config": {"batch": b, "seq": t, "steps": a.steps, "warmup": a.warmup, "dtype": "bfloat16",
                              "torch": torch.__version__}}
            if mode == "decode":
                rec["config"].update(prompt=shape[1], new_tokens=shape[2])
            for v in a.variants.split(","):
                fn = {"train": run_train, "prefill": run_prefill, "decode": run_decode}[mode]
                args = (b, t) if mode != "decode" else (b, shape[1], shape[2])
                try:
                    tps, peak, loss, report = fn(base, v, *args, a.steps, a.warmup, batches)
                except Exception as e:  # a variant that fails is reported, the others still run
                    print(f"{name} {mode} {v}: FAILED {type(e).__name__}: {e}", file=sys.stderr)
                    tps, peak, loss, report = None, None, None, []
                    rec.setdefault("errors", {})[v] = f"{type(e).__name__}: {e}"[:500]
                rec["tokens_per_s"][v] = tps
                rec["peak_gib"][v] = peak
                if loss is not None:
                    rec["loss"][v] = loss
                if report and "swapped" not in rec:
                    rec["swapped"] = sorted({new for _, _, new in report})
                torch._dynamo.reset()
                torch.cuda.empty_cache()
                fmt = "—" if tps is None else f"{tps:,.0f} tok/s, peak {peak:.2f} GiB" + (f", loss {loss:.4f}" if loss is not None else "")
                print(f"{name:10s} {mode:8s} {v:16s} {fmt}", flush=True)
            tc = rec["tokens_per_s"].get("torch_compile")
            for v in ("ferrite", "ferrite_compile", "ferrite_compile_graphs"):
                if tc and rec["tokens_per_s"].get(v):
                    rec.setdefault("ratio_to_torch_compile", {})[v] = rec["tokens_per_s"][v] / tc
            rows.append(rec)
        del base
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
