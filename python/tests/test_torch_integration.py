"""torch.library.opcheck, torch.autograd.gradcheck and torch.compile(fullgraph=True) on the CPU.

gradcheck: ferrite has no float64 kernels (matmul on the CPU is float32 only; the norms are
f32/f16/bf16), so gradcheck runs in float32 with a larger finite-difference step and loose
tolerances (eps=1e-2, atol=rtol=1e-2, on well-conditioned small inputs). The precise check of
the gradients is test_parity.py, which compares them with torch's float64 autograd.
"""

import pytest
import torch
import torch.nn.functional as F

import ferrite
from helpers import close

ops = torch.ops.ferrite


def r(*shape, grad=True):
    return torch.randn(*shape).requires_grad_(grad)


OPCHECK_CASES = [
    ("matmul", lambda: (r(5, 7), r(7, 3))),
    ("matmul", lambda: (r(2, 5, 7), r(7, 3))),
    ("matmul", lambda: (r(4, 5, 7), r(4, 7, 3))),
    ("matmul", lambda: (r(5, 7), r(4, 7, 3))),
    ("linear", lambda: (r(3, 4, 9), r(5, 9), r(5))),
    ("linear", lambda: (r(4, 9), r(5, 9), None)),
    ("linear_rows", lambda: (r(3, 4, 9), r(5, 9), r(5))),
    ("rms_norm", lambda: (r(4, 16), [16], r(16), 1e-6)),
    ("rms_norm", lambda: (r(2, 3, 4, 5), [4, 5], None, 1e-6)),
    ("layer_norm", lambda: (r(4, 16), [16], r(16), r(16), 1e-5)),
    ("layer_norm", lambda: (r(2, 3, 8), [8], None, r(8), 1e-5)),
    ("matmul_backward", lambda: (r(5, 3, grad=False), r(5, 7, grad=False), r(7, 3, grad=False), True, True)),
    ("matmul_backward", lambda: (r(4, 5, 3, grad=False), r(5, 7, grad=False), r(4, 7, 3, grad=False), True, False)),
    ("linear_backward", lambda: (r(6, 5, grad=False), r(6, 9, grad=False), r(5, 9, grad=False), True, True, True)),
    ("linear_act", lambda: (r(3, 4, 9), r(5, 9), r(5), "gelu_tanh", True)),
    ("linear_act", lambda: (r(4, 9), r(5, 9), None, "silu", True)),
    ("softmax", lambda: (r(4, 33), 0.5)),
    ("bias_act_dropout", lambda: (r(6, 17), r(17), "gelu_tanh", 0.25, torch.tensor([3, 9]))),
    ("bias_act_dropout", lambda: (r(2, 3, 8), None, "none", 0.0, torch.tensor([1, 0]))),
    ("glu", lambda: (r(5, 2 * 11), "silu")),
    ("cross_entropy", lambda: (r(7, 40), torch.randint(0, 40, (7,)), -100, 0.1, "mean", True)),
    ("cross_entropy", lambda: (r(7, 40), torch.randint(0, 40, (7,)), 3, 0.0, "none", True)),
    (
        "attention",
        lambda: (r(2, 9, 4, 16), r(2, 9, 2, 16), r(2, 9, 2, 16), None, None, 0, 0, "bshd", None, True, -1, -1, 0.0, False),
    ),
    (
        "attention",
        lambda: (r(1, 2, 7, 16), r(1, 2, 11, 16), r(1, 2, 11, 16), None, None, 0, 0, "bhsd", 0.5, False, 3, 2, 5.0, True),
    ),
]


@pytest.mark.parametrize("name,make", OPCHECK_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(OPCHECK_CASES)])
def test_opcheck(name, make):
    torch.library.opcheck(getattr(ops, name).default, make())


def test_opcheck_norm_backward_ops():
    x, w = torch.randn(4, 16), torch.randn(16)
    y, rstd = ops.rms_norm(x, [16], w, 1e-6)
    torch.library.opcheck(ops.rms_norm_backward.default, (torch.randn(4, 16), x, [16], w, rstd, True))
    y, mean, rstd = ops.layer_norm(x, [16], w, None, 1e-5)
    torch.library.opcheck(
        ops.layer_norm_backward.default, (torch.randn(4, 16), x, [16], w, mean, rstd, True, False)
    )


GC = dict(eps=1e-2, atol=1e-2, rtol=1e-2, nondet_tol=0.0)


@pytest.mark.filterwarnings("ignore:Input #")
def test_gradcheck_matmul():
    assert torch.autograd.gradcheck(ferrite.matmul, (r(4, 5), r(5, 3)), **GC)
    assert torch.autograd.gradcheck(ferrite.matmul, (r(2, 4, 5), r(2, 5, 3)), **GC)
    assert torch.autograd.gradcheck(ferrite.matmul, (r(4, 5), r(2, 5, 3)), **GC)


@pytest.mark.filterwarnings("ignore:Input #")
def test_gradcheck_linear():
    assert torch.autograd.gradcheck(ferrite.linear, (r(2, 3, 5), r(4, 5), r(4)), **GC)


@pytest.mark.filterwarnings("ignore:Input #")
def test_gradcheck_norms():
    # Rows far from constant keep rstd (and so the finite differences) well conditioned.
    x = (torch.randn(3, 8) * 2).requires_grad_()
    w, b = (1 + 0.1 * torch.randn(8)).requires_grad_(), r(8)
    assert torch.autograd.gradcheck(lambda x, w: ferrite.rms_norm(x, [8], w, 1e-5), (x, w), **GC)
    assert torch.autograd.gradcheck(lambda x, w, b: ferrite.layer_norm(x, [8], w, b), (x, w, b), **GC)


def test_opcheck_decode_and_append():
    torch.manual_seed(0)
    kc, vc = torch.randn(5, 4, 2, 16), torch.randn(5, 4, 2, 16)
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    torch.library.opcheck(ops.paged_decode.default, (torch.randn(2, 4, 16), kc, vc, table, lens, None, 0.0, -1))
    slots = torch.tensor([0, 7, -1], dtype=torch.int32)
    torch.library.opcheck(ops.append_kv.default, (torch.randn(3, 2, 16), torch.randn(3, 2, 16), kc, vc, slots))


class GptBlock(torch.nn.Module):
    """A pre-norm GPT block on ferrite ops only: RMSNorm, fused QKV, flash attention, GELU MLP
    with the activation in the GEMM epilogue, dropout, and a fused cross-entropy head."""

    def __init__(self, d=32, heads=4, vocab=50):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, x, targets):
        b, s, d = x.shape
        h = ferrite.rms_norm(x, [d], self.n1.weight)
        q, k, v = ferrite.linear(h, self.qkv.weight, self.qkv.bias).view(b, s, 3, self.heads, -1).unbind(2)
        a = ferrite.flash_attn_func(q, k, v, causal=True).reshape(b, s, d)
        x = x + ferrite.dropout(ferrite.linear(a, self.proj.weight, self.proj.bias), 0.1, seed=(5, 0))
        h = ferrite.rms_norm(x, [d], self.n2.weight)
        x = x + ferrite.linear(ferrite.linear(h, self.up.weight, self.up.bias, activation="gelu_tanh"), self.down.weight, self.down.bias)
        logits = ferrite.linear(x, self.head.weight)
        return ferrite.cross_entropy(logits.view(b * s, -1), targets.view(-1))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_gpt_block_fullgraph(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = GptBlock()
    x = torch.randn(2, 9, 32)
    t = torch.randint(0, 50, (2, 9))
    ref = m(x, t)
    ref.backward()
    gref = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    loss = torch.compile(m, fullgraph=True, backend=backend)(x, t)
    close(loss, ref)
    loss.backward()
    for a, b in zip([p.grad for p in m.parameters()], gref):
        close(a, b)


class Block(torch.nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d)
        self.rms = torch.nn.RMSNorm(d)

    def forward(self, x):
        y = x + self.down(F.gelu(self.up(self.ln(x))))
        return self.rms(y) @ self.up.weight[:, :].t()[:, :8].contiguous()


class FerriteBlock(Block):
    def forward(self, x):
        h = ferrite.layer_norm(x, [x.shape[-1]], self.ln.weight, self.ln.bias)
        h = ferrite.linear(h, self.up.weight, self.up.bias)
        y = x + ferrite.linear(F.gelu(h), self.down.weight, self.down.bias)
        y = ferrite.rms_norm(y, [y.shape[-1]], self.rms.weight, self.rms.eps)
        return ferrite.matmul(y, self.up.weight.t()[:, :8])


def _compiled_matches_eager(backend, dynamic):
    torch._dynamo.reset()
    m = FerriteBlock()
    x = torch.randn(2, 5, 32, requires_grad=True)
    ref = m(x)
    ref.sum().backward()
    gref = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    m.zero_grad()
    x.grad = None
    cm = torch.compile(m, fullgraph=True, backend=backend, dynamic=dynamic)
    out = cm(x)
    close(out, ref)
    out.sum().backward()
    for a, b in zip([p.grad for p in m.parameters()] + [x.grad], gref):
        close(a, b)
    # and matches plain torch
    plain = Block()
    plain.load_state_dict(m.state_dict())
    close(plain(x), ref)
    return cm


def test_compile_fullgraph_inductor():
    _compiled_matches_eager("inductor", dynamic=False)


def test_compile_fullgraph_dynamic_shapes():
    cm = _compiled_matches_eager("aot_eager", dynamic=True)
    x = torch.randn(3, 7, 32)  # another shape: no recompilation needed for a correct answer
    close(cm(x), FerriteBlock.forward(cm._orig_mod, x))


def test_compile_optimized_model():
    torch._dynamo.reset()
    m = Block()
    x = torch.randn(4, 32)
    ref = m(x)
    ferrite.optimize(m)
    cm = torch.compile(m, fullgraph=True)
    close(cm(x), ref)


def test_first_use_of_an_op_inside_a_trace_compiles_fullgraph():
    """ferrite's eager fast path builds an op's entry on first use; when that first use is inside
    torch.compile's trace (a model compiled before any eager call), the trace takes the op
    itself instead of building the entry there (which dynamo cannot trace: a graph break)."""
    from ferrite._eager import _Namespace

    ns = _Namespace()  # no entry built yet, as in a fresh process
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    y = torch.compile(lambda t: ns.rms_norm(t, [8], None, 1e-6)[0], fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(y, ferrite.rms_norm(x, 8, eps=1e-6))
