"""ferrite.moe / ferrite.nn.MoE / ferrite.grouped_mm against plain-torch references in float64:
forward, every gradient (x, router, both expert weights), the aux and z-losses and their
gradients, capacity drops, group-limited sigmoid routing; opcheck and torch.compile(fullgraph)."""

import pytest
import torch
import torch.nn.functional as F

import ferrite
from conftest import requires_cuda


def ref_moe(x, router, w_up, w_down, k, score="softmax", renorm=True, groups=1, topk_groups=1, scale=1.0,
            cap=None, aux_coef=0.0, z_coef=0.0):
    """The layer per token in float64, routing from float64 logits."""
    t, h = x.shape
    e = router.shape[0]
    i = w_up.shape[2] // 2
    logits = x @ router.t()
    lse = torch.logsumexp(logits, -1)
    s = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    key = logits.clone()
    if topk_groups < groups:
        gs = e // groups
        gsc = s.view(t, groups, gs).topk(min(2, gs), -1).values.sum(-1)
        keep = gsc.topk(topk_groups, -1).indices
        mask = torch.ones(t, groups, dtype=torch.bool).scatter_(1, keep, False)
        key = key.masked_fill(mask.repeat_interleave(gs, 1), float("-inf"))
    idx = key.topk(k, -1).indices
    w = s.gather(1, idx)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    w = w * scale
    out = torch.zeros_like(x)
    counts = torch.zeros(e, dtype=torch.long)
    for tok in range(t):
        for j in range(k):
            ex = int(idx[tok, j])
            kept = cap is None or counts[ex] < cap
            counts[ex] += 1
            if not kept:
                continue
            u = x[tok] @ w_up[ex]
            hh = F.silu(u[:i]) * u[i:]
            out[tok] = out[tok] + w[tok, j] * (hh @ w_down[ex])
    f = counts.double() / (t * k)
    aux = aux_coef * e * (f * s.mean(0)).sum() + z_coef * (lse**2).mean()
    return out, aux


def inputs(t, h, i, e, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(1)
    mk = lambda *s, sc=1.0: ((torch.rand(*s, generator=g) * 2 - 1) * sc).to(device=device, dtype=dtype).requires_grad_()
    return mk(t, h), mk(e, h), mk(e, h, 2 * i, sc=h**-0.5), mk(e, i, h, sc=i**-0.5)


CASES = [
    dict(t=37, h=24, i=16, e=4, k=2),
    dict(t=50, h=16, i=8, e=8, k=1, renorm=False, aux_coef=0.1, z_coef=0.01),
    dict(t=40, h=16, i=8, e=8, k=4, score="sigmoid", renorm=False, groups=4, topk_groups=2, scale=2.0, aux_coef=0.05),
    dict(t=64, h=16, i=8, e=4, k=2, cap_factor=0.5),
    dict(t=1, h=8, i=4, e=1, k=1),
]


def run_case(c, device="cpu", dtype=torch.float32, tol=1e-4):
    x, r, u, d = inputs(c["t"], c["h"], c["i"], c["e"], dtype, device)
    kw = dict(score=c.get("score", "softmax"), renormalize=c.get("renorm", True), groups=c.get("groups", 1),
              topk_groups=c.get("topk_groups", 1), routed_scale=c.get("scale", 1.0), capacity_factor=c.get("cap_factor"),
              aux_loss_coef=c.get("aux_coef", 0.0), z_loss_coef=c.get("z_coef", 0.0))
    out, aux = ferrite.moe(x, r, u, d, c["k"], **kw)
    cap = None
    if c.get("cap_factor"):
        import math
        cap = math.ceil(c["t"] * c["k"] / c["e"] * c["cap_factor"])
    xs = [v.detach().double().cpu().requires_grad_() for v in (x, r, u, d)]
    ro, ra = ref_moe(*xs, c["k"], kw["score"], kw["renormalize"], kw["groups"], kw["topk_groups"], kw["routed_scale"], cap,
                     kw["aux_loss_coef"], kw["z_loss_coef"])
    torch.testing.assert_close(out.double().cpu(), ro, atol=tol * 10, rtol=tol * 10)
    torch.testing.assert_close(aux.double().cpu(), ra, atol=tol * 10, rtol=tol * 10)
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (out.double() * gout.to(out.device)).sum().add(aux.double()).backward()
    ((ro * gout).sum() + ra).backward()
    for name, a, b in zip(("x", "router", "w_up", "w_down"), (x, r, u, d), xs):
        err = (a.grad.double().cpu() - b.grad).norm() / b.grad.norm().clamp_min(1e-12)
        assert err < tol * 20, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("c", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_moe_matches_float64_reference(c):
    run_case(c)


def test_moe_module_and_aux_loss():
    torch.manual_seed(0)
    m = ferrite.nn.MoE(16, 8, experts=4, top_k=2, aux_loss_coef=0.02)
    x = torch.randn(2, 5, 16)
    y = m(x)
    assert y.shape == x.shape and m.aux_loss is not None and m.aux_loss.dim() == 0
    (y.square().mean() + m.aux_loss).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_moe_metrics_and_bad_input():
    x, r, u, d = inputs(20, 8, 4, 4)
    saved = ferrite.moe_forward(x.detach(), r.detach(), u.detach(), d.detach(), 2, capacity_factor=0.5)
    m = ferrite.moe_metrics(saved)
    assert sum(m["tokens_per_expert"]) == 40 and m["dropped"] > 0
    with pytest.raises(ValueError, match="top_k"):
        ferrite.moe(x, r, u, d, 5)
    with pytest.raises(ValueError, match="w_down"):
        ferrite.moe(x, r, u, d[:, :3], 2)
    with pytest.raises(ValueError, match="capacity_factor"):
        ferrite.moe(x, r, u, d, 2, capacity_factor=-1.0)


def ref_grouped(a, b, offs):
    out, s = [], 0
    for g, e in enumerate(offs.tolist()):
        out.append(a[s:e] @ b[g])
        s = e
    return torch.cat(out)


@pytest.mark.parametrize("bt", [False, True])
def test_grouped_mm_forward_backward(bt):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(41, 12, generator=g, requires_grad=True)
    braw = torch.randn(5, 9, 12, generator=g) if bt else torch.randn(5, 12, 9, generator=g)
    b = (braw.transpose(1, 2) if bt else braw).detach().requires_grad_()
    offs = torch.tensor([0, 10, 10, 30, 41], dtype=torch.int32)
    out = ferrite.grouped_mm(a, b, offs)
    a2, b2 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = ref_grouped(a2, b2, offs)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    gout = torch.randn(out.shape, generator=g)
    out.backward(gout)
    ref.backward(gout.double())
    torch.testing.assert_close(a.grad.double(), a2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.grad.double(), b2.grad, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="offs"):
        ferrite.grouped_mm(a, b, torch.tensor([0, 10, 10, 30, 40], dtype=torch.int32))


def test_opcheck_and_compile():
    ops = torch.ops.ferrite
    a = torch.randn(20, 8, requires_grad=True)
    b = torch.randn(3, 8, 6, requires_grad=True)
    offs = torch.tensor([5, 5, 20], dtype=torch.int32)
    torch.library.opcheck(ops.grouped_mm.default, (a, b, offs))
    x, r, u, d = inputs(12, 8, 4, 4)
    args = (x, r, u, d, 2, "softmax", True, 1, 1, 1.0, 0.0, 0.01, 0.001, "silu", False)
    torch.library.opcheck(ops.moe.default, args)

    def f(x, r, u, d):
        o, aux = ferrite.moe(x, r, u, d, 2, aux_loss_coef=0.01)
        return o.sum() + aux

    eager = f(x, r, u, d)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, u, d)
    torch.testing.assert_close(compiled, eager)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_cuda(dtype):
    c = dict(t=300, h=64, i=40, e=8, k=2, aux_coef=0.01, z_coef=0.001)
    run_case(c, device="cuda", dtype=dtype, tol=1e-2 if dtype == torch.bfloat16 else 1e-3)


@requires_cuda
def test_moe_cuda_graph_replay_matches_eager():
    # The layer's forward + backward captured once and replayed on new input: no host
    # synchronisation inside (the layout is planned on the device), workspaces in stream order.
    x, r, u, d = inputs(300, 64, 40, 8, torch.bfloat16, "cuda")
    static_x = x.detach().clone()
    params = [r, u, d]

    def step():
        out, aux = ferrite.moe(static_x, r, u, d, 2, aux_loss_coef=0.01, z_loss_coef=0.001)
        (out.float().square().mean() + aux).backward()
        return out

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # first uses compile and tune outside the capture
            step()
            for p in params:
                p.grad = None
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    static_x.copy_(torch.randn_like(static_x))
    for p in params:
        p.grad.zero_()
    g.replay()
    torch.cuda.synchronize()
    ref = [p.detach().clone().requires_grad_() for p in params]
    o2, aux2 = ferrite.moe(static_x, *ref, 2, aux_loss_coef=0.01, z_loss_coef=0.001)
    (o2.float().square().mean() + aux2).backward()
    torch.testing.assert_close(out, o2, atol=0, rtol=0)
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_moe_under_no_grad_matches_and_skips_the_saved_state(device):
    # Without a gradient to come the forward runs forward-only (CUDA `fused`: the pre-activations
    # are not stored); the output is the same bits as with autograd recording.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, r, u, d = inputs(300, 64, 40, 8, dtype, device)
    out, aux = ferrite.moe(x, r, u, d, 2, aux_loss_coef=0.01)
    with torch.no_grad():
        out2, aux2 = ferrite.moe(x, r, u, d, 2, aux_loss_coef=0.01)
    assert not out2.requires_grad
    assert torch.equal(out.detach(), out2) and torch.equal(aux.detach(), aux2)
    assert torch.isfinite(out2.float()).all()


def test_backward_ops_opcheck_compile_and_one_backward_per_forward():
    """The eager backward writes the pre-activations' gradient over the forward's saved hpre
    (a mutating op, declared so); a traced backward runs the functional op, which leaves the
    forward's buffers as they were. Both give the same gradients; a second backward through the
    same call is refused."""
    ops = torch.ops.ferrite
    x, r, u, d = inputs(12, 8, 4, 4)
    cfg = (2, "softmax", True, 1, 1, 1.0, 0.0, 0.01, 0.001, "silu")
    plain = [t.detach() for t in (x, r, u, d)]  # the backward ops have no gradient of their own
    saved = ops.moe.default(*plain, *cfg, False)
    dout = torch.randn_like(x).detach()
    lg = torch.tensor([1.0, 0.5])
    torch.library.opcheck(ops.moe_backward.default, (dout, lg, *plain, saved, *cfg))
    # The mutating op is the eager path only (traced graphs run the functional one): its schema,
    # fake and autograd registration are checked, not AOT functionalisation of a list output.
    torch.library.opcheck(
        ops.moe_backward_.default, (dout, lg, *plain, saved[:13], saved[13].clone(), *cfg),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )

    def f(x, r, u, d):
        o, aux = ferrite.moe(x, r, u, d, 2, aux_loss_coef=0.01, z_loss_coef=0.001)
        return (o * dout).sum() + aux

    params = (x, r, u, d)
    eager = torch.autograd.grad(f(*params), params)
    torch._dynamo.reset()
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(*params)
    compiled = torch.autograd.grad(loss, params)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    loss = f(*params)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
