"""GPT-2 trained in plain PyTorch, eager and torch.compile, on the same token shards as
`ferrite train`: the peers of ferrite's trainer, measured in the same call.

The model is ferrite's GPT-2 (pre-norm blocks, LayerNorm, learned positions, GELU-tanh MLP of 4·dim,
tied embeddings, biases, GPT-2's initialisation), trained as nanoGPT does on a GPU: fp32 weights under
bf16 autocast, SDPA (flash) attention, fused AdamW (β 0.9/0.95, weight decay 0.1 on matrices and
embeddings), global-norm clipping at 1.0, linear warm-up then cosine. Batches are B random windows of
T+1 tokens from the shards (the order differs from ferrite's loader; the data are the same).

usage: python3 train_peers.py SHARDS --model gpt2-124m -b 16 -t 1024 --steps 30 --mode eager|compile --json out.json
Under torchrun (WORLD_SIZE > 1) it trains data-parallel with DistributedDataParallel over NCCL, B rows
per rank (`--fsdp`: FSDP2's fully_shard per block instead), and reports global tokens/s from rank 0.
"""
import argparse
import glob
import json
import math
import os
import statistics
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {"gpt2-124m": (12, 12, 768), "gpt2-350m": (24, 16, 1024), "gpt2-774m": (36, 20, 1280), "gpt2-tiny": (2, 4, 64)}
# Llama presets as ferrite's: (layers, heads, kv_heads, dim, ffn, max_seq)
LLAMA = {"llama-1b": (16, 32, 8, 2048, 5632, 2048), "llama-tiny": (2, 4, 2, 64, 176, 256)}


def load_tokens_file(f):
    raw = open(f, "rb").read()
    if f.endswith(".ftok"):
        width = int.from_bytes(raw[12:16], "little")
        return np.frombuffer(raw[4096:], dtype=np.uint16 if width == 2 else np.uint32).astype(np.int64)
    header = np.frombuffer(raw[:1024], dtype=np.int32)
    return np.frombuffer(raw[1024:], dtype=np.uint16 if header[1] == 1 else np.uint32).astype(np.int64)


def load_tokens(path):
    """Every .ftok (4096-byte header) or llm.c .bin (1024-byte header) shard, concatenated."""
    files = sorted(glob.glob(os.path.join(path, "*.ftok")) + glob.glob(os.path.join(path, "*.bin")))
    if not files:
        raise SystemExit(f"no .ftok or .bin shards under {path}")
    parts = []
    for f in files:
        raw = open(f, "rb").read()
        if f.endswith(".ftok"):
            width = int.from_bytes(raw[12:16], "little")
            parts.append(np.frombuffer(raw[4096:], dtype=np.uint16 if width == 2 else np.uint32))
        else:
            header = np.frombuffer(raw[:1024], dtype=np.int32)
            parts.append(np.frombuffer(raw[1024:], dtype=np.uint16 if header[1] == 1 else np.uint32))
    return np.concatenate(parts).astype(np.int64)


class Block(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.fcproj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, max_seq, layers, heads, dim, padded_vocab):
        super().__init__()
        self.vocab = vocab
        self.wte, self.wpe = nn.Embedding(padded_vocab, dim), nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(dim)
        proj_std = 0.02 / math.sqrt(2 * layers)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = proj_std if name.endswith(("proj.weight",)) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        with torch.no_grad():
            self.wte.weight[vocab:].zero_()  # padded rows: never a token, logits sliced off

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.lnf(x), self.wte.weight)[..., : self.vocab]
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), targets.reshape(-1))


def save_hf_gpt2(model, path):
    """The GPT model's weights as a Hugging Face GPT2LMHeadModel checkpoint (unpadded vocab,
    Conv1D weights [in, out]), written as safetensors by hand (header length, JSON header, data)."""
    import json as _json
    import struct

    sd = {"wte.weight": model.wte.weight[: model.vocab], "wpe.weight": model.wpe.weight,
          "ln_f.weight": model.lnf.weight, "ln_f.bias": model.lnf.bias}
    for i, b in enumerate(model.blocks):
        for hf, mod, conv in (("ln_1", b.ln1, False), ("attn.c_attn", b.qkv, True), ("attn.c_proj", b.proj, True),
                              ("ln_2", b.ln2, False), ("mlp.c_fc", b.fc, True), ("mlp.c_proj", b.fcproj, True)):
            sd[f"h.{i}.{hf}.weight"] = mod.weight.t() if conv else mod.weight
            sd[f"h.{i}.{hf}.bias"] = mod.bias
    header, blobs, off = {}, [], 0
    for name, t in sd.items():
        data = t.detach().float().contiguous().cpu().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = _json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for blob in blobs:
            f.write(blob)


def rope_tables(t, d, theta, device):
    inv = theta ** (-torch.arange(0, d // 2, dtype=torch.float32, device=device) * 2 / d)
    ang = torch.arange(t, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]


def rope(x, cos, sin):
    d = x.shape[-1] // 2
    a, b = x[..., :d], x[..., d:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class LlamaBlock(nn.Module):
    def __init__(self, c, h, hk, f):
        super().__init__()
        self.h, self.hk, self.d, self.f = h, hk, c // h, f
        self.ln1, self.ln2 = nn.RMSNorm(c, eps=1e-5), nn.RMSNorm(c, eps=1e-5)
        self.qkv = nn.Linear(c, (h + 2 * hk) * self.d, bias=False)
        self.proj = nn.Linear(h * self.d, c, bias=False)
        self.fc = nn.Linear(c, 2 * f, bias=False)
        self.fcproj = nn.Linear(f, c, bias=False)

    def forward(self, x, cos, sin):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split([self.h * self.d, self.hk * self.d, self.hk * self.d], dim=2)
        q = rope(q.view(b, t, self.h, self.d), cos, sin).transpose(1, 2)
        k = rope(k.view(b, t, self.hk, self.d), cos, sin).transpose(1, 2)
        v = v.view(b, t, self.hk, self.d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        gate, up = self.fc(self.ln2(x)).split(self.f, dim=2)
        return x + self.fcproj(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, vocab, max_seq, layers, heads, kv_heads, dim, ffn, padded_vocab):
        super().__init__()
        self.vocab, self.d = vocab, dim // heads
        self.wte = nn.Embedding(padded_vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.lnf = nn.RMSNorm(dim, eps=1e-5)
        self.head = nn.Linear(dim, padded_vocab, bias=False)
        proj_std = 0.02 / math.sqrt(2 * layers)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, proj_std if name.endswith("proj.weight") else 0.02)
        with torch.no_grad():
            self.wte.weight[vocab:].zero_()
            self.head.weight[vocab:].zero_()

    def forward(self, idx, targets):
        cos, sin = rope_tables(idx.shape[1], self.d, 10000.0, idx.device)
        x = self.wte(idx)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = self.head(self.lnf(x))[..., : self.vocab]
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shards")
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("-b", "--batch", type=int, default=16)
    ap.add_argument("-t", "--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--params", choices=["fp32", "bf16"], default="fp32",
                    help="fp32: fp32 weights under bf16 autocast (master weights, as ferrite); bf16: bf16 weights, no autocast")
    ap.add_argument("--pad-vocab", type=int, default=50304,
                    help="rows of the embedding/classifier (50257 = unpadded); logits are sliced to 50257")
    ap.add_argument("--json")
    ap.add_argument("--val", help="a shard file: after training, the mean loss over its first --val-batches "
                    "batches of consecutive (T+1)-token rows, as `ferrite train --val-data`")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--save-init", help="write the initial weights (GPT-2, Hugging Face names and Conv1D "
                    "layout, f32 safetensors) to this file and exit: `ferrite train --init-hf` starts from them")
    ap.add_argument("--batches", help="train on these batches (i32 [steps, B, T+1], from `ferrite train "
                    "--dump-batches`) instead of random windows: the same data in the same order")
    ap.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP2 (fully_shard) instead of DDP")
    a = ap.parse_args()

    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    dev = "cuda"
    if world > 1:
        import torch.distributed as dist
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        rank = dist.get_rank()
        dev = f"cuda:{local}"
    tokens = torch.from_numpy(load_tokens(a.shards))
    if a.model in LLAMA:
        layers, heads, kv, dim, ffn, max_seq = LLAMA[a.model]
        model = Llama(50257, max_seq, layers, heads, kv, dim, ffn, max(a.pad_vocab, 50257)).to(dev)
    else:
        layers, heads, dim = PRESETS[a.model]
        model = GPT(50257, 1024, layers, heads, dim, max(a.pad_vocab, 50257)).to(dev)
    if a.save_init:
        save_hf_gpt2(model, a.save_init)
        return
    if a.params == "bf16":
        model = model.to(torch.bfloat16)
    if world > 1 and a.fsdp:
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if a.params == "fp32" else None
        for blk in model.blocks:
            fully_shard(blk, **({"mp_policy": mp} if mp else {}))
        fully_shard(model, **({"mp_policy": mp} if mp else {}))
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )

    def step_fn(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.params == "fp32"):
            loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss, norm

    fn = torch.compile(step_fn) if a.mode == "compile" else step_fn
    gen = torch.Generator().manual_seed(a.seed + rank)
    n = tokens.numel() - a.seq - 1

    fixed = None
    if a.batches:
        fixed = torch.from_numpy(np.fromfile(a.batches, dtype=np.int32).astype(np.int64)).view(-1, a.batch, a.seq + 1)
        if fixed.shape[0] < a.steps:
            raise SystemExit(f"{a.batches} holds {fixed.shape[0]} batches, fewer than --steps {a.steps}")
    step_no = [0]

    def batch():
        if fixed is not None:
            rows = fixed[step_no[0]].pin_memory().to(dev, non_blocking=True)
            step_no[0] += 1
            return rows[:, :-1], rows[:, 1:]
        starts = torch.randint(0, n, (a.batch,), generator=gen)
        rows = torch.stack([tokens[s : s + a.seq + 1] for s in starts.tolist()])
        rows = rows.pin_memory().to(dev, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    torch.cuda.reset_peak_memory_stats()
    log = []
    for step in range(a.steps):
        lr = a.lr * (step + 1) / a.warmup if step < a.warmup else 0.1 * a.lr + 0.45 * a.lr * (
            1 + math.cos(math.pi * (step - a.warmup) / max(1, a.steps - a.warmup)))
        for g in opt.param_groups:
            g["lr"] = lr
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x, y = batch()
        loss, norm = fn(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = loss.item()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        log.append({"step": step, "loss": loss_v, "grad_norm": float(norm), "ms": dt * 1e3,
                    "tokens_per_s": world * a.batch * a.seq / dt})
        if rank == 0 and (step % 10 == 0 or step + 1 == a.steps):
            print(f"[torch {a.mode} {a.params}] step {step + 1}/{a.steps} loss {loss_v:.4f} {dt * 1e3:.1f} ms "
                  f"{world * a.batch * a.seq / dt:.0f} tok/s", flush=True)
    val_loss = None
    if a.val and world > 1:
        a.val = None  # the validation pass compares single-GPU runs only
    if a.val:
        v = torch.from_numpy(load_tokens_file(a.val))
        rows = v[: (v.numel() // (a.seq + 1)) * (a.seq + 1)].view(-1, a.seq + 1)
        losses = []
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.params == "fp32"):
            for i in range(a.val_batches):
                r = rows[i * a.batch:(i + 1) * a.batch].to(dev)
                if r.shape[0] < a.batch:
                    break
                losses.append(float(model(r[:, :-1], r[:, 1:])))
        val_loss = sum(losses) / len(losses)
        print(f"[torch {a.mode} {a.params}] validation loss {val_loss:.4f} over {len(losses)} batches")
    warm = 3 if len(log) > 4 else 0
    out = {
        "mode": a.mode, "params": a.params, "pad_vocab": a.pad_vocab, "model": a.model, "device": torch.cuda.get_device_name(), "batch": a.batch,
        "seq": a.seq, "steps": a.steps, "world_size": world, "fsdp": bool(a.fsdp and world > 1),
        "tokens_per_s": statistics.median(l["tokens_per_s"] for l in log[warm:]),
        "step_ms": statistics.median(l["ms"] for l in log[warm:]),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "first_loss": log[0]["loss"], "last_loss": log[-1]["loss"], "val_loss": val_loss, "log": log,
    }
    if rank == 0:
        print(f"[torch {a.mode} {a.params} world {world}] median {out['tokens_per_s']:.0f} tok/s, {out['step_ms']:.1f} ms/step, "
              f"peak {out['peak_gib']:.2f} GiB, loss {out['first_loss']:.4f} -> {out['last_loss']:.4f}")
        if a.json:
            json.dump(out, open(a.json, "w"), indent=1)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
