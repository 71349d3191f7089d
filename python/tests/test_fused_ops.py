"""Parity on the CPU for linear with fused activations, softmax, bias+activation+dropout, the
gated units, cross-entropy and the AdamW optimizer (gradients against torch's float64 autograd)."""

import pytest
import torch
import torch.nn.functional as F

import ferrite
from helpers import close, grads_vs_torch

ACTS = {
    None: lambda z: z,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}


def r(*shape, dtype=torch.float32, grad=True, scale=1.0):
    return (torch.randn(*shape, dtype=dtype) * scale).requires_grad_(grad)


# ---- linear with a fused activation ------------------------------------------------------------


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("bias", [True, False])
def test_linear_activation(act, bias):
    x, w = r(3, 7, 33, scale=0.5), r(45, 33, scale=33**-0.5)
    b = r(45) if bias else None
    inputs = [x, w] + ([b] if bias else [])

    def fer(x, w, b=None):
        return ferrite.linear(x, w, b, activation=act)

    def ref(x, w, b=None):
        return ACTS[act](F.linear(x, w, b))

    grads_vs_torch(fer, ref, inputs, scale=2)


def test_linear_activation_without_grad_keeps_no_preact():
    x, w, b = r(5, 8, grad=False), r(6, 8, grad=False), r(6, grad=False)
    y, z = torch.ops.ferrite.linear_act(x, w, b, "gelu_tanh", False)
    assert z.numel() == 0
    close(y, F.gelu(F.linear(x, w, b), approximate="tanh"))
    with torch.no_grad():
        close(ferrite.linear(x, w, b, activation="relu"), F.relu(F.linear(x, w, b)))


def test_linear_16bit_on_cpu():
    x, w, b = r(9, 40, dtype=torch.bfloat16, grad=False), r(17, 40, dtype=torch.bfloat16, grad=False), r(17, dtype=torch.bfloat16, grad=False)
    close(ferrite.linear(x, w, b, activation="silu"), F.silu(F.linear(x.double(), w.double(), b.double())).bfloat16())


def test_linear_bad_activation():
    with pytest.raises(ValueError, match=r"argument `activation`: expected None, 'relu'"):
        ferrite.linear(torch.randn(2, 3), torch.randn(4, 3), activation="tanh")


# ---- the two-layer MLP (chain-form backward) -------------------------------------------------------


def _mlp_ref(act):
    return lambda x, w1, b1, w2, b2: F.linear(ACTS[act](F.linear(x, w1, b1)), w2, b2)


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu"])
def test_mlp(act):
    x, w1, b1 = r(3, 7, 33, scale=0.5), r(45, 33, scale=33**-0.5), r(45)
    w2, b2 = r(29, 45, scale=45**-0.5), r(29)
    fer = lambda x, w1, b1, w2, b2: ferrite.mlp(x, w1, b1, w2, b2, activation=act)
    grads_vs_torch(fer, _mlp_ref(act), [x, w1, b1, w2, b2], scale=2)


@pytest.mark.parametrize("which", ["x", "w1", "b1", "w2", "b2"])
def test_mlp_one_gradient(which):
    names = ["x", "w1", "b1", "w2", "b2"]
    shapes = [(11, 20), (37, 20), (37,), (9, 37), (9,)]
    ins = [r(*s, grad=n == which, scale=0.5) for n, s in zip(names, shapes)]
    fer = lambda *a: ferrite.mlp(*a, activation="gelu_tanh")
    grads_vs_torch(fer, _mlp_ref("gelu_tanh"), ins, scale=2)


def test_mlp_without_bias_and_without_grad():
    x, w1, w2 = r(2, 5, 16), r(24, 16, scale=0.25), r(7, 24, scale=0.2)
    fer = lambda x, w1, w2: ferrite.mlp(x, w1, None, w2, None, activation="silu")
    grads_vs_torch(fer, lambda x, w1, w2: F.linear(F.silu(F.linear(x, w1)), w2), [x, w1, w2], scale=2)
    with torch.no_grad():
        y, h, z = torch.ops.ferrite.mlp(x, w1, None, w2, None, "silu", False)
        assert z.numel() == 0
        close(y, F.linear(F.silu(F.linear(x, w1)), w2))


def test_mlp_empty_rows():
    x, w1, b1, w2, b2 = r(0, 16), r(24, 16), r(24), r(7, 24), r(7)
    y = ferrite.mlp(x, w1, b1, w2, b2)
    assert y.shape == (0, 7)
    y.sum().backward()
    assert torch.equal(w1.grad, torch.zeros_like(w1)) and torch.equal(b2.grad, torch.zeros_like(b2))


def test_mlp_module_matches_torch():
    torch.manual_seed(3)
    m = ferrite.nn.MLP(24, 40, activation="gelu")
    ref = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 24))
    ref.load_state_dict({k.replace("fc1", "0").replace("fc2", "2"): v for k, v in m.state_dict().items()})
    x = r(6, 24)
    close(m(x), ref(x))
    m(x).square().sum().backward()
    ref(x).square().sum().backward()
    close(m.fc1.weight.grad, ref[0].weight.grad)
    close(m.fc1.bias.grad, ref[0].bias.grad)
    close(m.fc2.weight.grad, ref[2].weight.grad)


def test_mlp_bad_input():
    x, w1, b1, w2, b2 = r(4, 16), r(24, 16), r(24), r(7, 24), r(7)
    with pytest.raises(ValueError, match=r"ferrite.mlp: argument `w2`: expected a 2-D tensor \[out_features, 24\]"):
        ferrite.mlp(x, w1, b1, r(7, 23), b2)
    with pytest.raises(ValueError, match=r"argument `b2`: expected a 1-D tensor \[7\]"):
        ferrite.mlp(x, w1, b1, w2, r(8))
    with pytest.raises(ValueError, match=r"argument `weight`: expected \[out_features, 16\]"):
        ferrite.mlp(x, r(24, 15), b1, w2, b2)
    with pytest.raises(ValueError, match=r"argument `activation`: expected an activation"):
        ferrite.mlp(x, w1, b1, w2, b2, activation=None)
    with pytest.raises(ValueError, match=r"argument `activation`"):
        ferrite.nn.MLP(16, 24, activation="tanh")


def test_mlp_opcheck():
    x, w1, b1, w2, b2 = r(5, 16), r(24, 16), r(24), r(7, 24), r(7)
    torch.library.opcheck(torch.ops.ferrite.mlp.default, (x, w1, b1, w2, b2, "gelu_tanh", True))


# ---- softmax -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,dim", [((7, 33), -1), ((3, 5, 129), -1), ((6, 11), 0), ((4, 5, 6), 1), ((1,), 0)])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_softmax(shape, dim, scale):
    grads_vs_torch(
        lambda x: ferrite.softmax(x, dim, scale=scale), lambda x: torch.softmax(x * scale, dim), [r(*shape, scale=3.0)]
    )


def test_softmax_bad_dim():
    with pytest.raises(ValueError, match=r"argument `dim`: expected a dim in \[-2, 2\), got 2"):
        ferrite.softmax(torch.randn(3, 4), 2)


# ---- bias + activation + dropout ---------------------------------------------------------------


@pytest.mark.parametrize("act", [None, "gelu_tanh", "silu", "relu"])
def test_bias_act_without_dropout(act):
    grads_vs_torch(
        lambda x, b: ferrite.bias_act_dropout(x, b, act, p=0.0),
        lambda x, b: ACTS[act](x + b),
        [r(13, 37), r(37)],
    )


@pytest.mark.parametrize("act", [None, "gelu", "silu"])
def test_dropout_mask_scaling_and_gradients(act):
    p = 0.3
    x, b = r(64, 129), r(129)
    y = ferrite.bias_act_dropout(x, b, act, p=p, seed=(1234, 7))
    h = ACTS[act]((x + b).double())
    kept = y != 0
    frac = 1 - kept.double().mean().item()
    assert abs(frac - p) < 0.03, f"dropped fraction {frac}, expected about {p}"
    close(y[kept], (h / (1 - p))[kept].float())
    # The same (seed, offset) draws the same mask; another seed or offset another one.
    y2 = ferrite.bias_act_dropout(x, b, act, p=p, seed=(1234, 7))
    assert torch.equal(y, y2)
    assert not torch.equal(y != 0, ferrite.bias_act_dropout(x, b, act, p=p, seed=(1234, 8)) != 0)
    assert not torch.equal(y != 0, ferrite.bias_act_dropout(x, b, act, p=p, seed=(1235, 7)) != 0)
    # backward: the regenerated mask, times the activation's derivative
    g = torch.randn_like(y)
    y.backward(g)
    xd, bd = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = ACTS[act](xd + bd) * kept.double() / (1 - p)
    ref.backward(g.double())
    close(x.grad, xd.grad.float())
    close(b.grad, bd.grad.float(), scale=4)


def test_dropout_eval_and_seed_from_torch_generator():
    x = r(8, 16, grad=False)
    close(ferrite.dropout(x, 0.5, training=False), x)
    torch.manual_seed(3)
    a = ferrite.dropout(x, 0.5)
    torch.manual_seed(3)
    b = ferrite.dropout(x, 0.5)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"argument `p`: expected a drop probability in \[0, 1\), got 1.0"):
        ferrite.dropout(x, 1.0)


# ---- gated units ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["swiglu", "geglu", "geglu_tanh"])
@pytest.mark.parametrize("shape", [(5, 2 * 37), (2, 3, 2 * 64)])
def test_glu(kind, shape):
    def ref(x):
        gate, up = x.chunk(2, dim=-1)
        if kind == "swiglu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh" if kind == "geglu_tanh" else "none") * up

    def fer(x):
        if kind == "swiglu":
            return ferrite.swiglu(x)
        return ferrite.geglu(x, approximate="tanh" if kind == "geglu_tanh" else "none")

    grads_vs_torch(fer, ref, [r(*shape)])


def test_glu_odd_last_dim():
    with pytest.raises(ValueError, match="last dim of even size"):
        ferrite.swiglu(torch.randn(3, 5))


# ---- cross-entropy -------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy(reduction, smoothing):
    n, c = 37, 1001
    logits = r(n, c, scale=2.0)
    target = torch.randint(0, c, (n,))
    target[3] = -100
    target[11] = -100

    def fer(x):
        return ferrite.cross_entropy(x, target, reduction=reduction, label_smoothing=smoothing)

    def ref(x):
        return F.cross_entropy(x, target, reduction=reduction, label_smoothing=smoothing)

    grads_vs_torch(fer, ref, [logits])


def test_cross_entropy_custom_ignore_index_int32_and_1d():
    logits, target = r(6, 50), torch.tensor([1, 7, 7, 49, 0, 3], dtype=torch.int32)
    grads_vs_torch(
        lambda x: ferrite.cross_entropy(x, target, ignore_index=7),
        lambda x: F.cross_entropy(x, target.long(), ignore_index=7),
        [logits],
    )
    x1 = r(50)
    grads_vs_torch(lambda x: ferrite.cross_entropy(x, torch.tensor(4)), lambda x: F.cross_entropy(x, torch.tensor(4)), [x1])


def test_cross_entropy_bf16():
    logits = torch.randn(16, 3000).bfloat16()
    target = torch.randint(0, 3000, (16,))
    close(ferrite.cross_entropy(logits, target).float(), F.cross_entropy(logits.double(), target).float(), dtype=torch.bfloat16)


def test_cross_entropy_bad_input():
    with pytest.raises(ValueError, match=r"cross_entropy: argument `targets`: expected class indices in \[0, 10\) or ignore_index \(-100\), got targets\[1\] = 10"):
        ferrite.cross_entropy(torch.randn(3, 10), torch.tensor([1, 10, 2]))
    with pytest.raises(ValueError, match=r"argument `target`: expected class indices \(int64 or int32"):
        ferrite.cross_entropy(torch.randn(3, 10), torch.randn(3, 10))
    with pytest.raises(ValueError, match=r"argument `target`: expected shape \[3\]"):
        ferrite.cross_entropy(torch.randn(3, 10), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"argument `reduction`"):
        ferrite.cross_entropy(torch.randn(3, 10), torch.tensor([1, 2, 3]), reduction="avg")


# ---- AdamW ---------------------------------------------------------------------------------------


def test_adamw_matches_torch_f32():
    torch.manual_seed(1)
    shapes = [(17, 9), (33,), (4, 5, 6)]
    ps_f = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ps_t = [torch.nn.Parameter(p.detach().clone()) for p in ps_f]
    kw = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    opt_f = ferrite.optim.AdamW(ps_f, **kw)
    opt_t = torch.optim.AdamW(ps_t, foreach=False, **kw)
    for _ in range(4):
        for pf, pt in zip(ps_f, ps_t):
            g = torch.randn(pf.shape)
            pf.grad, pt.grad = g.clone(), g.clone()
        opt_f.step()
        opt_t.step()
    for pf, pt in zip(ps_f, ps_t):
        torch.testing.assert_close(pf.detach(), pt.detach(), atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(opt_f.state[pf]["exp_avg_sq"], opt_t.state[pt]["exp_avg_sq"], atol=1e-7, rtol=1e-5)


def test_adamw_bf16_params_keep_a_master():
    p = torch.nn.Parameter(torch.randn(40, 3).bfloat16())
    ref = torch.nn.Parameter(p.detach().float().clone())
    opt, opt_ref = ferrite.optim.AdamW([p], lr=1e-3), torch.optim.AdamW([ref], lr=1e-3, foreach=False)
    for _ in range(3):
        g = torch.randn(40, 3)
        p.grad, ref.grad = g.bfloat16(), g.bfloat16().float()
        opt.step()
        opt_ref.step()
    master = opt.state[p]["master"]
    torch.testing.assert_close(master, ref.detach(), atol=1e-6, rtol=1e-6)
    assert torch.equal(p.detach(), master.bfloat16())


def test_adamw_bad_input():
    with pytest.raises(ValueError, match="expected dtype float32 or bfloat16, got float16"):
        p = torch.nn.Parameter(torch.randn(3).half())
        p.grad = torch.randn(3).half()
        ferrite.optim.AdamW([p]).step()
    with pytest.raises(ValueError, match="argument `eps`"):
        ferrite.optim.AdamW([torch.nn.Parameter(torch.randn(3))], eps=0.0)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_matches_torch(kind, dtype):
    """Fused residual add + norm: (norm(x + r), x + r) and the gradients of x, r, weight (and bias)
    against float64 torch, with both outputs used downstream."""
    x = torch.randn(5, 3, 67).to(dtype).requires_grad_()
    r = torch.randn(5, 3, 67).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(67)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(67)).to(dtype).requires_grad_()
    if kind == "rms":
        y, h = ferrite.add_rms_norm(x, r, 67, w, eps=1e-5)
        ref = lambda x, r, w, b: (F.rms_norm(x + r, (67,), w, 1e-5), x + r)  # noqa: E731
    else:
        y, h = ferrite.add_layer_norm(x, r, [67], w, b, eps=1e-5)
        ref = lambda x, r, w, b: (F.layer_norm(x + r, (67,), w, b, 1e-5), x + r)  # noqa: E731
    xd, rd, wd, bd = (t.detach().double().requires_grad_() for t in (x, r, w, b))
    yr, hr = ref(xd, rd, wd, bd)
    close(y, yr.to(dtype))
    close(h, hr.to(dtype))
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    (y * gy).sum().add((h * gh).sum()).backward()
    (yr * gy.double()).sum().add((hr * gh.double()).sum()).backward()
    for name, a, ref_t in [("x", x, xd), ("residual", r, rd), ("weight", w, wd)] + ([("bias", b, bd)] if kind == "layer" else []):
        assert a.grad is not None, name
        close(a.grad, ref_t.grad.to(dtype), dtype=dtype, scale=4.0)
    if kind == "rms":
        assert b.grad is None


def test_add_norm_opcheck_and_bad_input():
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    torch.library.opcheck(torch.ops.ferrite.add_norm.default, ("rms_norm", x, r, [32], w, None, 1e-5))
    torch.library.opcheck(torch.ops.ferrite.add_norm.default, ("layer_norm", x, r, [32], w, torch.randn(32), 1e-5))
    with pytest.raises(ValueError, match=r"add_rms_norm: argument `residual`: expected a tensor like `input`"):
        ferrite.add_rms_norm(x, torch.randn(4, 31), 32)


def test_adamw_lr_zero_and_a_failed_step_keeps_the_count():
    """lr = 0 is a step, as torch's (moments move, weights stay); a step that fails leaves the
    step count where it was."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(37))
    q = torch.nn.Parameter(p.detach().clone())
    opt = ferrite.optim.AdamW([p], lr=0.0, weight_decay=0.1)
    ref = torch.optim.AdamW([q], lr=0.0, weight_decay=0.1)
    for _ in range(2):
        g = torch.randn(37)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    close(p.detach(), q.detach())
    close(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
    assert opt.state[p]["step"] == 2
    with pytest.raises(ValueError, match="grad_scale"):
        opt.step(grad_scale=-1.0)
    assert opt.state[p]["step"] == 2


def test_compiled_cross_entropy_keeps_padded_dlogits_for_the_classifier_gemms(monkeypatch):
    """Under torch.compile the loss's backward multiplies dlogits by the incoming gradient; for
    logits in padded rows (``linear_rows``) the product must reach the classifier's backward GEMMs
    in those rows, uncopied. Padding is a CUDA-only layout: here it is switched on for the CPU to
    follow the compiled graph's strides; values against torch."""
    import torch.nn.functional as F

    from ferrite import _fused, _ops_linear

    monkeypatch.setattr(_ops_linear, "_padded_width", lambda t, rows, n: (n + 7) // 8 * 8)
    monkeypatch.setattr(
        _fused, "_ce_rows_kept", lambda lg: lg.dim() == 2 and lg.shape[0] > 1 and lg.stride(0) > lg.shape[1]
    )
    from helpers import aligned_rows_seen

    torch.manual_seed(0)
    x = torch.randn(2, 7, 16, requires_grad=True)
    w = torch.randn(131, 16, requires_grad=True)
    t = torch.randint(0, 131, (14,))
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: ferrite.cross_entropy(ferrite.linear_rows(x, w).reshape(-1, 131), t), fullgraph=True)
    with aligned_rows_seen() as seen:
        loss = f(x, w)
        (loss * 0.5).backward()  # a gradient other than 1 reaches the multiply
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    ref = F.cross_entropy((xr @ wr.t()).reshape(-1, 131), t)
    (ref * 0.5).backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-5, rtol=1e-5)
    assert seen == [(136, True)], seen
    torch._dynamo.reset()
