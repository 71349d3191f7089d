"""CUDA parity for linear+activation, softmax, dropout (the same mask as on the CPU), SwiGLU,
cross-entropy, AdamW, flash attention (every feature, forward and backward), paged decode; CUDA
graphs and torch.compile on a GPT block. Skipped without a GPU (they run on the H100)."""

import pytest
import torch
import torch.nn.functional as F

import ferrite
from conftest import requires_cuda
from helpers import close, grads_vs_torch
from test_attention import paged_setup, gather, reference
from test_torch_integration import GptBlock

pytestmark = requires_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HALVES = [torch.float16, torch.bfloat16]


def r(*shape, dtype=torch.float32, grad=True, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=dtype) * scale).requires_grad_(grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["gelu_tanh", "silu", "relu"])
def test_linear_activation(dtype, act):
    f = {"gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu, "relu": F.relu}[act]
    if act == "relu" and dtype != torch.float32:
        # ReLU's derivative jumps at 0: a pre-activation rounded to 16 bits can sit on the other
        # side of 0 than the float64 reference's, flipping whole terms of dx. Forward only here;
        # the 16-bit ReLU backward is covered by `ferrite check linear` against its own z.
        x, w, b = r(3, 67, 96, dtype=dtype, scale=0.5), r(136, 96, dtype=dtype, scale=96**-0.5), r(136, dtype=dtype)
        close(ferrite.linear(x, w, b, activation="relu"), F.relu(F.linear(x.double(), w.double(), b.double())).to(dtype), scale=3)
        return
    grads_vs_torch(
        lambda x, w, b: ferrite.linear(x, w, b, activation=act),
        lambda x, w, b: f(F.linear(x, w, b)),
        [r(3, 67, 96, dtype=dtype, scale=0.5), r(136, 96, dtype=dtype, scale=96**-0.5), r(136, dtype=dtype)],
        scale=3,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim,hidden", [(192, 128, 512), (111, 96, 136)])
def test_mlp(dtype, rows, dim, hidden):
    # 192 rows × 512 hidden: fc2's dX GEMM writes db1's column sums in its epilogue (rows a
    # multiple of 64, hidden of 256); 111 × 136: the same backward with db1 from a pass.
    grads_vs_torch(
        lambda x, w1, b1, w2, b2: ferrite.mlp(x, w1, b1, w2, b2, activation="gelu_tanh"),
        lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2),
        [
            r(rows, dim, dtype=dtype, scale=0.5),
            r(hidden, dim, dtype=dtype, scale=dim**-0.5),
            r(hidden, dtype=dtype),
            r(dim, hidden, dtype=dtype, scale=hidden**-0.5),
            r(dim, dtype=dtype),
        ],
        scale=3,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_and_swiglu(dtype):
    grads_vs_torch(lambda x: ferrite.softmax(x, scale=0.5), lambda x: torch.softmax(0.5 * x, -1), [r(37, 1000, dtype=dtype)])
    grads_vs_torch(
        ferrite.swiglu, lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1], [r(19, 2 * 264, dtype=dtype)], scale=2
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_same_mask_as_cpu(dtype):
    x, b = torch.randn(33, 300, dtype=dtype), torch.randn(300, dtype=dtype)
    yc = ferrite.bias_act_dropout(x, b, "gelu_tanh", p=0.2, seed=(99, 5))
    yg = ferrite.bias_act_dropout(x.cuda(), b.cuda(), "gelu_tanh", p=0.2, seed=(99, 5))
    assert torch.equal(yc != 0, yg.cpu() != 0), "the GPU and CPU masks differ"
    close(yg.cpu(), yc, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy(dtype, smoothing):
    logits = r(64, 50257, dtype=dtype, scale=2.0)
    target = torch.randint(0, 50257, (64,), device="cuda")
    target[5] = -100
    grads_vs_torch(
        lambda z: ferrite.cross_entropy(z, target, label_smoothing=smoothing),
        lambda z: F.cross_entropy(z, target, label_smoothing=smoothing),
        [logits],
    )
    bad = target.clone()
    bad[2] = 50257
    with pytest.raises(ValueError, match=r"targets\[2\] = 50257"):
        ferrite.cross_entropy(logits, bad, check_targets=True)
    # unchecked (asynchronous): the bad row's loss is NaN, the others are right
    rows = ferrite.cross_entropy(logits.detach(), bad, reduction="none")
    assert torch.isnan(rows[2]).item()
    assert torch.isnan(ferrite.cross_entropy(logits.detach(), bad)).item()
    ok = torch.arange(64, device="cuda") != 2
    close(rows[ok].float(), F.cross_entropy(logits.detach()[ok].double(), bad[ok], reduction="none").float(), dtype=dtype)


def test_adamw_cuda_matches_cpu():
    torch.manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(1000, 17)), torch.nn.Parameter(torch.randn(123))]
    pg = [torch.nn.Parameter(p.detach().cuda()) for p in ps]
    oc, og = ferrite.optim.AdamW(ps, lr=1e-2), ferrite.optim.AdamW(pg, lr=1e-2)
    for _ in range(3):
        for a, b in zip(ps, pg):
            g = torch.randn(a.shape)
            a.grad, b.grad = g, g.cuda()
        oc.step()
        og.step()
    for a, b in zip(ps, pg):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), atol=1e-6, rtol=1e-6)


ATTN_CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, causal, window, softcap)
    (2, 300, 300, 8, 8, 128, False, (-1, -1), 0.0),
    (2, 257, 257, 8, 2, 64, True, (-1, -1), 0.0),
    (1, 100, 333, 4, 1, 128, True, (-1, -1), 0.0),
    (2, 200, 200, 4, 4, 96, False, (64, 16), 0.0),
    (1, 129, 129, 6, 3, 32, True, (-1, -1), 30.0),
]


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,causal,window,softcap", ATTN_CASES)
def test_flash_attention(dtype, b, sq, sk, hq, hkv, d, causal, window, softcap):
    grads_vs_torch(
        lambda q, k, v: ferrite.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap),
        lambda q, k, v: reference(q.cpu(), k.cpu(), v.cpu(), causal, window, softcap).cuda(),
        [r(b, sq, hq, d, dtype=dtype), r(b, sk, hkv, d, dtype=dtype), r(b, sk, hkv, d, dtype=dtype)],
        scale=2,
    )


@pytest.mark.parametrize("dtype", HALVES)
def test_sdpa_and_varlen(dtype):
    q, k, v = (r(2, 8, 513, 64, dtype=dtype) for _ in range(3))
    grads_vs_torch(
        lambda q, k, v: ferrite.scaled_dot_product_attention(q, k, v, is_causal=True),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        [q, k, v],
        scale=2,
    )
    lens = [100, 7, 260]
    cu = torch.tensor([0, 100, 107, 367], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(367, 4, 128, device="cuda", dtype=dtype) for _ in range(3))
    o = ferrite.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    for i in range(3):
        s, e = cu[i].item(), cu[i + 1].item()
        ref = reference(q[s:e].cpu()[None], k[s:e].cpu()[None], v[s:e].cpu()[None], causal=True)[0]
        close(o[s:e].cpu(), ref.to(dtype), dtype=dtype)


def test_attention_deterministic_backward():
    q, k, v = (r(1, 500, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        ferrite.flash_attn_func(q, k, v, causal=True, deterministic=True).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", HALVES)
def test_paged_decode(dtype):
    lens, bs = [1, 37, 300, 1000], 16
    q, kc, vc, table, seq_lens = paged_setup(lens, hq=32, hkv=8, d=128, bs=bs, dtype=dtype)
    o = ferrite.paged_decode(q.cuda(), kc.cuda(), vc.cuda(), table.cuda(), seq_lens.cuda())
    for i, ln in enumerate(lens):
        k = gather(kc, table[i], ln, bs)[None]
        v = gather(vc, table[i], ln, bs)[None]
        ref = reference(q[i][None, None], k, v)[0, 0]
        close(o[i].cpu(), ref.to(dtype), dtype=dtype)
    bad = table.clone()
    bad[3, 2] = 10_000
    with pytest.raises(ValueError, match="block_table"):
        ferrite.paged_decode(q.cuda(), kc.cuda(), vc.cuda(), bad.cuda(), seq_lens.cuda())


def test_attention_in_cuda_graph():
    q, k, v = (torch.randn(2, 256, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ferrite.flash_attn_func(q, k, v, causal=True)  # compile the kernels outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ferrite.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ferrite.flash_attn_func(q, k, v, causal=True)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    g.replay()
    torch.cuda.synchronize()
    close(out, F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2))


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compile_gpt_block_cuda(mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = GptBlock(d=128, heads=2, vocab=1000).cuda().bfloat16()
    x = torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 1000, (2, 64), device="cuda")
    ref = m(x, t)
    cm = torch.compile(m, fullgraph=True, mode=mode)
    for _ in range(3):
        loss = cm(x, t)
    close(loss, ref, dtype=torch.bfloat16)
