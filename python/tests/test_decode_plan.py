"""Paged decode with a plan (plan once per batch composition, run once per layer): planned runs
equal unplanned ones, a stale plan (other lengths) is still correct, a plan for another batch
shape is refused, errors accumulate in the plan until paged_decode_errors, and on the GPU a whole
step (plan + runs) is captured in a CUDA graph and replayed after the lengths and q change."""

import math

import pytest
import torch

import ferrite
from conftest import requires_cuda
from helpers import close

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def build(lens, hq, hkv, d, bs, dtype, device, capacity=None, seed=0):
    """q [B, Hq, D], caches [num_blocks, bs, Hkv, D] with every sequence's blocks shuffled over
    the cache (room for `capacity` tokens each, default its own length), the block table (unused
    entries −1, as vLLM pads) and the lengths."""
    torch.manual_seed(seed)
    b = len(lens)
    per_seq = [math.ceil((capacity or n) / bs) for n in lens]
    max_blocks = max(1, max(per_seq))
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, dtype=torch.int32)
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)
    n = 0
    for i, nb in enumerate(per_seq):
        table[i, :nb] = perm[n : n + nb]
        n += nb
    kc = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype)
    q = torch.randn(b, hq, d, device=device, dtype=dtype)
    return q, kc, vc, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def reference(q, kc, vc, table, seq_lens, window_left=-1):
    """(o, lse) in float64: each sequence's keys gathered through the block table."""
    b, hq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    o = torch.zeros(b, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float64, device=q.device)
    for i, n in enumerate(seq_lens.tolist()):
        lo = max(0, n - 1 - window_left) if window_left >= 0 else 0
        if n == 0:
            continue
        blocks = table[i, : math.ceil(n / bs)].long()
        k = kc[blocks].reshape(-1, hkv, d)[lo:n].double().repeat_interleave(hq // hkv, dim=1)
        v = vc[blocks].reshape(-1, hkv, d)[lo:n].double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,jhd->hj", q[i].double(), k) / math.sqrt(d)
        lse[i] = torch.logsumexp(s, -1)
        o[i] = torch.einsum("hj,jhd->hd", torch.softmax(s, -1), v)
    return o, lse


RAGGED = [0, 1, 17, 300, 45]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [-1, 40])
def test_planned_equals_unplanned(device, dtype, window):
    q, kc, vc, table, lens = build(RAGGED, 8, 2, 64, 16, dtype, device)
    plan = ferrite.paged_decode_plan(lens, 8, 2, 64, dtype, window_left=window)
    assert plan.dtype == torch.int32 and plan.dim() == 1 and plan.device == lens.device
    o, lse = ferrite.paged_decode(q, kc, vc, table, lens, window_left=window, return_lse=True, plan=plan)
    o0, lse0 = ferrite.paged_decode(q, kc, vc, table, lens, window_left=window, return_lse=True)
    ferrite.paged_decode_errors(plan)
    if device == "cpu":
        assert torch.equal(o, o0) and torch.equal(lse, lse0)  # the same code on the CPU
    else:
        close(o, o0, dtype=dtype)
    ref_o, ref_lse = reference(q, kc, vc, table, lens, window)
    close(o, ref_o.to(dtype), dtype=dtype)
    assert torch.equal(o[0], torch.zeros_like(o[0]))  # length 0: o = 0, lse = −inf
    assert torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    torch.testing.assert_close(lse[1:].double(), ref_lse[1:], atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_one_plan_many_layers(device):
    """One plan, two layers' caches (another cache and block table each run)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lens = [5, 130, 64]
    plan = ferrite.paged_decode_plan(torch.tensor(lens, dtype=torch.int32, device=device), 8, 2, 64, dtype)
    for layer in range(2):
        q, kc, vc, table, seq_lens = build(lens, 8, 2, 64, 16, dtype, device, seed=layer)
        o = ferrite.paged_decode(q, kc, vc, table, seq_lens, plan=plan)
        close(o, reference(q, kc, vc, table, seq_lens)[0].to(dtype), dtype=dtype)
    ferrite.paged_decode_errors(plan)


@pytest.mark.parametrize("device", DEVICES)
def test_stale_plan_is_still_correct(device):
    """A plan made for other lengths (same batch shape): every key is still covered."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, kc, vc, table, lens = build(RAGGED, 8, 2, 64, 16, dtype, device)
    for other in ([300, 0, 1, 17, 45], [1, 1, 1, 1, 1], [2000, 3000, 4000, 5000, 6000]):
        plan = ferrite.paged_decode_plan(torch.tensor(other, dtype=torch.int32, device=device), 8, 2, 64, dtype)
        o = ferrite.paged_decode(q, kc, vc, table, lens, plan=plan)
        ferrite.paged_decode_errors(plan)
        close(o, reference(q, kc, vc, table, lens)[0].to(dtype), dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_plan_is_refused(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, kc, vc, table, lens = build(RAGGED, 8, 2, 64, 16, dtype, device)
    good = ferrite.paged_decode_plan(lens, 8, 2, 64, dtype)
    for bad in (good[:-1], torch.zeros(good.numel() + 16, dtype=torch.int32, device=device)):
        with pytest.raises(ValueError, match="`plan`"):
            ferrite.paged_decode(q, kc, vc, table, lens, plan=bad)
    with pytest.raises(ValueError, match="`plan`"):
        ferrite.paged_decode(q, kc, vc, table, lens, plan=good.long())
    with pytest.raises(ValueError, match="`plan`"):
        ferrite.paged_decode(q, kc, vc, table, lens, plan=good.view(1, -1))
    with pytest.raises(ValueError, match="seq_lens"):
        ferrite.paged_decode_plan(lens.long(), 8, 2, 64, dtype)
    with pytest.raises(ValueError, match="dtype"):
        ferrite.paged_decode_plan(lens, 8, 2, 64, torch.float64)
    with pytest.raises(ValueError, match="shape"):
        ferrite.paged_decode_plan(lens, 8, 3, 64, dtype)  # Hkv must divide Hq


@pytest.mark.parametrize("device", DEVICES)
def test_plan_for_another_batch_is_refused(device):
    """A plan for batch 3 used for batch 5, or for other heads: refused, naming `plan`."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, kc, vc, table, lens = build(RAGGED, 8, 2, 64, 16, dtype, device)
    plan3 = ferrite.paged_decode_plan(lens[:3].contiguous(), 8, 2, 64, dtype)
    with pytest.raises(ValueError, match=r"`plan`.*B 5"):
        ferrite.paged_decode(q, kc, vc, table, lens, plan=plan3)
    with pytest.raises(ValueError, match="`plan`"):
        ferrite.paged_decode(q[:3], kc, vc, table[:3], lens[:3], plan=ferrite.paged_decode_plan(lens, 8, 2, 64, dtype))
    plan_mha = ferrite.paged_decode_plan(lens, 8, 8, 64, dtype)  # another head count
    if plan_mha.numel() != ferrite.paged_decode_plan(lens, 8, 2, 64, dtype).numel():
        with pytest.raises(ValueError, match="`plan`"):
            ferrite.paged_decode(q, kc, vc, table, lens, plan=plan_mha)


def test_bad_table_with_plan_cpu():
    """On the CPU a planned run checks on the host and raises at once; the plan has no errors."""
    q, kc, vc, table, lens = build([5, 40], 8, 2, 64, 16, torch.float32, "cpu")
    plan = ferrite.paged_decode_plan(lens, 8, 2, 64, torch.float32)
    table[1, 1] = 10_000
    with pytest.raises(ValueError, match="block_table"):
        ferrite.paged_decode(q, kc, vc, table, lens, plan=plan)
    ferrite.paged_decode_errors(plan)


@requires_cuda
def test_bad_table_with_plan_reported_by_errors():
    """On the GPU a planned run never syncs: a bad entry sets the plan's flag, which
    paged_decode_errors raises (ValueError, as an unplanned call) and clears."""
    q, kc, vc, table, lens = build([5, 40, 33], 8, 2, 64, 16, torch.bfloat16, "cuda")
    plan = ferrite.paged_decode_plan(lens, 8, 2, 64, torch.bfloat16)
    bad = table.clone()
    bad[1, 1] = 10_000
    ferrite.paged_decode(q, kc, vc, bad, lens, plan=plan)  # no raise: launches only
    ferrite.paged_decode(q, kc, vc, table, lens, plan=plan)  # a good run keeps the flag
    with pytest.raises(ValueError, match="block_table"):
        ferrite.paged_decode_errors(plan)
    ferrite.paged_decode_errors(plan)  # cleared
    with pytest.raises(ValueError, match="block_table"):
        ferrite.paged_decode(q, kc, vc, bad, lens)  # unplanned: raises at once


def test_opcheck_plan_ops():
    q, kc, vc, table, lens = build([6, 3], 4, 2, 16, 4, torch.float32, "cpu")
    ops = torch.ops.ferrite
    numel = ferrite._native.paged_decode_plan_numel(2, 4, 2, 16, "float32")
    torch.library.opcheck(ops.paged_decode_plan.default, (lens, numel, 4, 2, 16, "float32", -1, None))
    plan = ferrite.paged_decode_plan(lens, 4, 2, 16, torch.float32)
    torch.library.opcheck(ops.paged_decode_planned.default, (q, kc, vc, table, lens, plan, None, 0.0, -1, None))
    torch.library.opcheck(ops.paged_decode.default, (q, kc, vc, table, lens, None, 0.0, -1, "parallel"))


def test_compile_plan_and_run():
    """plan + runs under torch.compile(fullgraph=True): the numel is a trace-time constant."""
    q, kc, vc, table, lens = build(RAGGED, 8, 2, 64, 16, torch.float32, "cpu")

    def step(q, kc, vc, table, lens):
        plan = ferrite.paged_decode_plan(lens, 8, 2, 64, torch.float32)
        o1 = ferrite.paged_decode(q, kc, vc, table, lens, plan=plan)
        o2 = ferrite.paged_decode(q * 2, kc, vc, table, lens, plan=plan)
        return o1 + o2

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc, vc, table, lens)
    torch.testing.assert_close(got, step(q, kc, vc, table, lens))


# ---- GPU: CUDA graphs, a serving-sized batch --------------------------------------------------


@requires_cuda
def test_plan_and_run_in_cuda_graph():
    """One decode step — plan + two layers' runs — captured once, replayed after the lengths and
    q change in place (longer and shorter contexts, a sequence emptied); equals eager calls."""
    b, hq, hkv, d, bs, cap = 6, 16, 4, 128, 16, 1024
    dtype = torch.bfloat16
    lens0 = [1, 100, 513, 1000, 37, 700]
    layers = [build(lens0, hq, hkv, d, bs, dtype, "cuda", capacity=cap, seed=s) for s in range(2)]
    q, _, _, table, seq_lens = layers[0]
    caches = [(kc, vc) for _, kc, vc, _, _ in layers]

    def step():
        plan = ferrite.paged_decode_plan(seq_lens, hq, hkv, d, dtype)
        outs = [ferrite.paged_decode(q, kc, vc, table, seq_lens, plan=plan) for kc, vc in caches]
        return plan, outs

    side = torch.cuda.Stream()  # warm up (compile the kernels) outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan, outs = step()
    for new_lens in ([1, 100, 513, 1000, 37, 700], [1024, 1, 0, 999, 512, 17], [300] * 6):
        seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        ferrite.paged_decode_errors(plan)
        for (kc, vc), o in zip(caches, outs):
            want = ferrite.paged_decode(q, kc, vc, table, seq_lens)
            close(o, want, dtype=dtype, scale=0.25)
            close(o, reference(q, kc, vc, table, seq_lens)[0].to(dtype), dtype=dtype)


@requires_cuda
def test_ragged_serving_batch_bf16():
    """32 sequences of 512..8192 tokens (GQA 32/8, D 128, page 16) against float64."""
    gen = torch.Generator().manual_seed(7)
    lens = torch.randint(512, 8193, (32,), generator=gen).tolist()
    dtype = torch.bfloat16
    q, kc, vc, table, seq_lens = build(lens, 32, 8, 128, 16, dtype, "cuda")
    plan = ferrite.paged_decode_plan(seq_lens, 32, 8, 128, dtype)
    o, lse = ferrite.paged_decode(q, kc, vc, table, seq_lens, plan=plan, return_lse=True)
    ferrite.paged_decode_errors(plan)
    ref_o, ref_lse = reference(q, kc, vc, table, seq_lens)
    close(o, ref_o.to(dtype), dtype=dtype)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-2, rtol=1e-3)
    close(o, ferrite.paged_decode(q, kc, vc, table, seq_lens), dtype=dtype, scale=0.25)

