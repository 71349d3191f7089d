"""Property test (hypothesis): random shapes (empty dims included), dtypes and layouts (transposed,
strided, expanded views) thrown at ferrite's ops on the CPU. Accepted outcomes: the result equals
torch's within the dtype's tolerance, or a ValueError / RuntimeError that names the ferrite op —
never another exception, a wrong result, or a crash. Where torch itself refuses the input,
ferrite must refuse it too.

CI runs a short profile; a long run: ``FERRITE_HYPOTHESIS=long pytest tests/test_property.py``.
"""

import os

import pytest
import torch
import torch.nn.functional as F

import ferrite

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (optional test dependency)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("long", max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("FERRITE_HYPOTHESIS", "ci"))

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32]
TOL = {torch.float32: 2e-4, torch.bfloat16: 8e-2, torch.float16: 2e-2, torch.float64: 1e-6}


def make(shape, dtype, layout, seed):
    """A tensor of `shape` in `dtype`, laid out as asked (the values do not depend on the layout)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g, dtype=torch.float64) * 2
    x = base.to(dtype) if dtype.is_floating_point else (base * 3).to(dtype)
    if layout == "transposed" and x.dim() >= 2:
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "strided" and x.dim() >= 1:
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    if layout == "expanded" and x.dim() >= 2 and x.shape[0] > 0:
        return x[:1].expand(x.shape)
    return x


def same(got, want, dtype):
    if not torch.is_tensor(want):
        return
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.numel() == 0:
        return
    w, g = want.double(), got.double()
    assert torch.equal(torch.isnan(g), torch.isnan(w)), "NaN pattern differs"
    m = ~torch.isnan(w)
    scale = w[m].abs().max().clamp_min(1.0) if m.any() else 1.0
    err = ((g[m] - w[m]).abs().max() / scale).item() if m.any() else 0.0
    assert err <= TOL.get(dtype, 2e-4), f"relative error {err}"


def run(op, f_ferrite, f_torch, dtype):
    try:
        want = f_torch()
        torch_error = None
    except Exception as e:  # torch refuses: ferrite must refuse too (its own error type)
        want, torch_error = None, e
    try:
        got = f_ferrite()
    except (ValueError, RuntimeError, MemoryError) as e:
        named = "ferrite" in str(e) or op.split("_")[0] in str(e)
        assert named or isinstance(e, MemoryError), f"{op}: an error that does not name the op: {e}"
        return
    assert torch_error is None, f"{op}: torch refused ({torch_error}) but ferrite returned a result"
    same(got, want.to(got.dtype) if torch.is_tensor(want) else want, dtype)


shapes = st.lists(st.integers(0, 9), min_size=1, max_size=4)
layouts = st.sampled_from(["contiguous", "transposed", "strided", "expanded"])
dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**31 - 1)


@given(shape=shapes, dtype=dtypes, layout=layouts, seed=seeds)
def test_row_ops(shape, dtype, layout, seed):
    x = make(shape, dtype, layout, seed)
    n = shape[-1]
    w = make([n], dtype, "contiguous", seed + 1)
    b = make([n], dtype, "contiguous", seed + 2)
    up = lambda t: t.double() if t.dtype.is_floating_point else t  # noqa: E731
    run("softmax", lambda: ferrite.softmax(x), lambda: torch.softmax(up(x), -1), dtype)
    run("rms_norm", lambda: ferrite.rms_norm(x, [n], w, 1e-5), lambda: F.rms_norm(up(x), [n], up(w), 1e-5), dtype)
    run("layer_norm", lambda: ferrite.layer_norm(x, [n], w, b), lambda: F.layer_norm(up(x), [n], up(w), up(b)), dtype)
    if n % 2 == 0:
        run("swiglu", lambda: ferrite.swiglu(x), lambda: F.silu(up(x)[..., : n // 2]) * up(x)[..., n // 2 :], dtype)


@given(rows=st.integers(0, 9), k=st.integers(0, 9), n=st.integers(0, 9), dtype=dtypes, layout=layouts, seed=seeds, bias=st.booleans())
def test_linear_and_matmul(rows, k, n, dtype, layout, seed, bias):
    x = make([rows, k], dtype, layout, seed)
    w = make([n, k], dtype, layout, seed + 1)
    b = make([n], dtype, "contiguous", seed + 2) if bias else None
    up = lambda t: None if t is None else (t.double() if t.dtype.is_floating_point else t)  # noqa: E731
    run("linear", lambda: ferrite.linear(x, w, b), lambda: F.linear(up(x), up(w), up(b)), dtype)
    run("matmul", lambda: ferrite.matmul(x, w.t()), lambda: up(x) @ up(w).t(), dtype)


@given(rows=st.integers(0, 9), classes=st.integers(0, 12), dtype=dtypes, layout=layouts, seed=seeds,
       reduction=st.sampled_from(["mean", "sum", "none"]), ignore=st.booleans())
def test_cross_entropy(rows, classes, dtype, layout, seed, reduction, ignore):
    x = make([rows, classes], dtype, layout, seed)
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, max(classes, 1), (rows,), generator=g)
    if ignore and rows:
        t[0] = -100
    up = lambda v: v.double() if v.dtype.is_floating_point else v  # noqa: E731
    run("cross_entropy", lambda: ferrite.cross_entropy(x, t, reduction=reduction),
        lambda: F.cross_entropy(up(x), t, reduction=reduction), dtype)


@given(b=st.integers(0, 3), s=st.integers(0, 9), h=st.integers(1, 3), half=st.integers(1, 4), extra=st.integers(0, 3),
       dtype=dtypes, seed=seeds, interleaved=st.booleans(), offset=st.integers(0, 3))
def test_rotary(b, s, h, half, extra, dtype, seed, interleaved, offset):
    d = 2 * half + extra
    x = make([b, s, h, d], dtype, "contiguous", seed)
    ang = torch.arange(s + 3, dtype=torch.float64)[:, None] * torch.rand(half, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)

    def ref():
        if not dtype.is_floating_point or dtype == torch.float64:
            raise ValueError("torch reference: floating 16/32-bit only here")
        if s + offset > s + 3:
            raise ValueError("past the tables")
        xd, c, sn = x.double(), cos.double()[offset : offset + s][None, :, None], sin.double()[offset : offset + s][None, :, None]
        out = xd.clone()
        if interleaved:
            x0, x1 = xd[..., 0 : 2 * half : 2], xd[..., 1 : 2 * half : 2]
            out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = x0 * c - x1 * sn, x1 * c + x0 * sn
        else:
            x0, x1 = xd[..., :half], xd[..., half : 2 * half]
            out[..., :half], out[..., half : 2 * half] = x0 * c - x1 * sn, x1 * c + x0 * sn
        return out

    run("apply_rotary_emb", lambda: ferrite.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offset), ref, dtype)


@given(b=st.integers(0, 2), sq=st.integers(0, 7), sk=st.integers(0, 7), hk=st.integers(1, 2), group=st.integers(1, 2),
       d=st.sampled_from([8, 16]), dtype=dtypes, seed=seeds, causal=st.booleans())
def test_attention(b, sq, sk, hk, group, d, dtype, seed, causal):
    q = make([b, sq, hk * group, d], dtype, "contiguous", seed)
    k = make([b, sk, hk, d], dtype, "contiguous", seed + 1)
    v = make([b, sk, hk, d], dtype, "contiguous", seed + 2)

    def ref():
        if not dtype.is_floating_point or dtype == torch.float64:
            raise ValueError("reference only for the dtypes ferrite runs")
        qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
        kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
        s = qd @ kd.transpose(-1, -2) / d**0.5
        if causal:  # bottom-right aligned (flash-attn's convention)
            i = torch.arange(sq)[:, None] + (sk - sq)
            s = s.masked_fill(~(torch.arange(sk)[None, :] <= i), float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)  # a row with no key attends to nothing: 0
        return (p @ vd).transpose(1, 2)

    run("flash_attn_func", lambda: ferrite.flash_attn_func(q, k, v, causal=causal), ref, dtype)
