"""Merges one call's `ferrite train` and PyTorch (eager, compile) runs into the result record the
trainer issue asks for, and prints the three-way table.

usage: python3 train_table.py DIR   (reads DIR/ferrite.json, DIR/torch_eager.json, DIR/torch_compile.json;
                                     writes DIR/train-compare.json)
"""
import json
import os
import sys

d = sys.argv[1]
runs = {}
KEYS = ["ferrite", "torch_eager", "torch_compile", "torch_compile_bf16"]
for key in KEYS:
    name = key + ".json"
    p = os.path.join(d, name)
    if os.path.exists(p):
        runs[key] = json.load(open(p))
if "ferrite" not in runs:
    sys.exit("no ferrite.json")
f = runs["ferrite"]["summary"]
rec = {
    "model": f["model"], "device": f["device"], "batch": f["batch"], "seq": f["seq"], "steps": f["steps"],
    "tokens_per_s": {"ferrite": f["tokens_per_s"]},
    "step_ms": {"ferrite": f["step_ms"]},
    "peak_gib": {"ferrite": f["peak_gib"]},
    "loss_after": {"ferrite": f["last_loss"]},
    "val_loss_after": {"ferrite": f.get("last_val_loss")},
    "mfu_ferrite": f["mfu"],
    "data_wait_ferrite": f["data_wait"],
}
for k in KEYS[1:]:
    if k in runs:
        r = runs[k]
        rec["tokens_per_s"][k] = r["tokens_per_s"]
        rec["step_ms"][k] = r["step_ms"]
        rec["peak_gib"][k] = r["peak_gib"]
        rec["loss_after"][k] = r["last_loss"]
        rec["val_loss_after"][k] = r.get("val_loss")
json.dump([rec], open(os.path.join(d, "train-compare.json"), "w"), indent=1)
base = rec["tokens_per_s"].get("torch_compile")
print(f"\n{rec['model']} on {rec['device']}, B {rec['batch']} T {rec['seq']}, {rec['steps']} steps")
print(f"{'':19} {'tokens/s':>10} {'ms/step':>8} {'peak GiB':>9} {'loss after':>10} {'val loss':>9} {'x compile':>9}")
print("(torch_compile: fp32 weights under bf16 autocast, as ferrite keeps f32 master weights; "
      "torch_compile_bf16: bf16 weights, no master copy)")
for k in KEYS:
    if k in rec["tokens_per_s"]:
        t = rec["tokens_per_s"][k]
        ratio = f"{t / base:.3f}" if base else "-"
        vl = rec["val_loss_after"].get(k)
        vls = f"{vl:>9.4f}" if vl is not None else f"{'-':>9}"
        print(f"{k:19} {t:>10.0f} {rec['step_ms'][k]:>8.1f} {rec['peak_gib'][k]:>9.2f} {rec['loss_after'][k]:>10.4f} {vls} {ratio:>9}")
