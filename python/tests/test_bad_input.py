"""Bad input gives a Python exception with a clear message, never a crash."""

import pytest
import torch

import ferrite
from ferrite import _native

from conftest import HAS_CUDA, requires_cuda

ops = torch.ops.ferrite


def test_wrong_dtype():
    with pytest.raises(ValueError, match=r"ferrite.matmul: argument `a`: expected dtype float32, float16 or bfloat16, got float64\[3, 4\] on cpu"):
        ferrite.matmul(torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="int32"):
        ferrite.rms_norm(torch.ones(3, 4, dtype=torch.int32), [4])
    with pytest.raises(ValueError, match=r"argument `b`: expected dtype float32 \(like `a`\), got float16"):
        ferrite.matmul(torch.randn(3, 4), torch.randn(4, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"argument `weight`: expected dtype bfloat16 \(like `input`\)"):
        ferrite.layer_norm(torch.randn(3, 4, dtype=torch.bfloat16), [4], torch.randn(4))
    # the CPU matmul is fp32 only (the CPU linear widens 16-bit inputs)
    with pytest.raises(ValueError, match="float32 on the CPU"):
        ferrite.matmul(torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(4, 2, dtype=torch.bfloat16))


def test_wrong_shapes():
    with pytest.raises(ValueError, match=r"argument `b`: expected 4 rows .*inner dims must match.*got float32\[5, 2\]"):
        ferrite.matmul(torch.randn(3, 4), torch.randn(5, 2))
    with pytest.raises(ValueError, match="rank ≥ 2"):
        ferrite.matmul(torch.randn(4), torch.randn(4, 2))
    with pytest.raises(ValueError, match=r"batch dims \[2\]"):
        ferrite.matmul(torch.randn(2, 3, 4), torch.randn(3, 4, 2))
    with pytest.raises(ValueError, match=r"argument `weight`: expected \[out_features, 4\]"):
        ferrite.linear(torch.randn(3, 4), torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"argument `bias`: expected a 1-D tensor \[2\]"):
        ferrite.linear(torch.randn(3, 4), torch.randn(2, 4), torch.randn(3))
    with pytest.raises(ValueError, match=r"argument `normalized_shape`: expected the trailing dims of input \[3, 4\], got \[5\]"):
        ferrite.rms_norm(torch.randn(3, 4), [5])
    with pytest.raises(ValueError, match=r"argument `weight`: expected shape \[4\]"):
        ferrite.layer_norm(torch.randn(3, 4), [4], torch.randn(5))
    with pytest.raises(ValueError, match=r"argument `bias`: expected shape \[4\]"):
        ferrite.layer_norm(torch.randn(3, 4), [4], None, torch.randn(3))


def test_shape_errors_surface_under_compile():
    """The fake implementations check too: torch.compile fails at trace time with the message."""
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: ferrite.matmul(a, b), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="inner dims must match"):
        f(torch.randn(3, 4), torch.randn(5, 2))


def test_devices_mixed_cpu_meta():
    """A device ferrite does not run on (meta stands in for any): a clear error."""
    with pytest.raises(ValueError, match=r"argument `b`: expected a CPU or CUDA tensor, got float32\[4, 2\] on meta"):
        ferrite.matmul(torch.randn(3, 4), torch.randn(4, 2, device="meta"))


@requires_cuda
def test_devices_mixed_cpu_cuda():
    with pytest.raises(ValueError, match=r"argument `b`: expected a tensor on cpu \(like `a`\), got float32\[4, 2\] on cuda:0"):
        ferrite.matmul(torch.randn(3, 4), torch.randn(4, 2, device="cuda"))
    with pytest.raises(ValueError, match="like `input`"):
        ferrite.rms_norm(torch.randn(3, 4, device="cuda"), [4], torch.randn(4))
    with pytest.raises(ValueError, match="like `input`"):
        ferrite.linear(torch.randn(3, 4, device="cuda"), torch.randn(2, 4))


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_devices_two_gpus():
    with pytest.raises(ValueError, match="cuda:1"):
        ferrite.matmul(torch.randn(3, 4, device="cuda:0"), torch.randn(4, 2, device="cuda:1"))


def test_non_contiguous_policy():
    """The ops copy layouts the kernels cannot read (see test_parity); the native layer, which
    never copies, refuses them with a ValueError naming the op and the argument."""
    x = torch.randn(6, 32).t()  # [32, 6], not contiguous
    y = torch.empty(32, 6)
    rstd = torch.empty(32)
    d = lambda t: (t.data_ptr(), list(t.shape), list(t.stride()), "float32")  # noqa: E731
    with pytest.raises(ValueError, match=r"rms_norm: argument `x`: expected a contiguous .*got f32\[32, 6\] on cpu \(strides \[1, 32\]\)"):
        _native.norm_forward("rms_norm", d(x), d(y), rstd=d(rstd))
    a = torch.randn(10, 14)[::2, ::2]  # no unit stride
    b, c = torch.randn(7, 3), torch.empty(5, 3)
    with pytest.raises(ValueError, match=r"matmul: argument `a`: expected stride 1 in one of the last two dims"):
        _native.matmul(d(a), d(b), d(c))
    # and through the op: a copy, right answer
    torch.testing.assert_close(ferrite.matmul(a, b), a @ b)


def test_native_rejects_bad_descriptors():
    t = torch.randn(4, 4)
    good = (t.data_ptr(), [4, 4], [4, 1], "float32")
    with pytest.raises(ValueError, match="expected dtype float32, float16 or bfloat16.*got float64"):
        _native.matmul(good, good[:3] + ("float64",), good)
    with pytest.raises(ValueError, match="one stride per dim"):
        _native.matmul(good, (t.data_ptr(), [4, 4], [4], "float32"), good)
    with pytest.raises(ValueError, match="non-null data pointer"):
        _native.matmul(good, (0, [4, 4], [4, 1], "float32"), good)
    with pytest.raises(ValueError, match="overflow"):
        _native.matmul(good, (t.data_ptr(), [1 << 62, 4], [1 << 62, 1], "float32"), good)
    with pytest.raises(ValueError, match="`kind`: expected layer_norm or rms_norm"):
        _native.norm_forward("batch_norm", good, good)
    with pytest.raises(TypeError):
        _native.matmul("not a tensor", good, good)
    with pytest.raises(ValueError, match="ferrite.variants"):
        ferrite.variants("conv")


def test_native_cuda_request_without_cuda_is_runtime_error():
    if HAS_CUDA:
        pytest.skip("this machine has CUDA")
    d = (1 << 20, [4, 4], [4, 1], "float32")  # never dereferenced: CUDA is checked first
    with pytest.raises(RuntimeError, match="CUDA unavailable"):
        _native.matmul(d, d, d, device=0, stream=0)


def test_eps_must_be_positive():
    with pytest.raises(ValueError, match="eps"):
        ferrite.rms_norm(torch.randn(3, 4), [4], None, 0.0)
    with pytest.raises(ValueError, match="eps"):
        ferrite.layer_norm(torch.randn(3, 4), [4], eps=-1.0)


def test_norm_backward_shape_errors():
    x = torch.randn(4, 8)
    y, rstd = ops.rms_norm(x, [8], None, 1e-5)
    with pytest.raises(ValueError, match="rstd"):
        ops.rms_norm_backward(torch.randn(4, 8), x, [8], None, torch.empty(3), False)


def test_cross_entropy_without_classes_is_an_error():
    # torch raises for targets with no class to index; an empty batch stays an empty loss.
    with pytest.raises(ValueError, match="at least one class"):
        ferrite.cross_entropy(torch.empty(3, 0), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one class"):
        ferrite.cross_entropy(torch.empty(0), torch.tensor(0))
    loss = ferrite.cross_entropy(torch.empty(0, 5), torch.zeros(0, dtype=torch.long), reduction="sum")
    assert loss.item() == 0.0


def test_attention_with_no_query_rows_is_empty_not_an_error():
    # S = 0 queries (an empty batch of prompts): empty outputs, zero gradients — as torch's SDPA.
    q, k, v = (torch.randn(2, 0, 4, 32, requires_grad=True) for _ in range(3))
    o = ferrite.flash_attn_func(q, k, v, causal=True)
    assert o.shape == (2, 0, 4, 32)
    o.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    q2 = torch.randn(1, 3, 2, 16, requires_grad=True)
    k2, v2 = (torch.randn(1, 0, 2, 16, requires_grad=True) for _ in range(2))
    o2 = ferrite.flash_attn_func(q2, k2, v2)
    assert o2.shape == q2.shape and torch.isfinite(o2).all()
    o2.sum().backward()
    assert (q2.grad == 0).all()


def test_append_kv_checks_meta_and_fake_calls():
    """append_kv returns nothing, so its fake used to check nothing: a meta slot_mapping (routed to
    the fake by the dispatcher) or a mis-shaped call under fake tensors went through silently."""
    t, h, d, blocks, bs = 3, 2, 8, 4, 16
    k, v = torch.randn(t, h, d), torch.randn(t, h, d)
    kc, vc = torch.zeros(blocks, bs, h, d), torch.zeros(blocks, bs, h, d)
    slots = torch.tensor([0, 5, 17], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"argument `slot_mapping`: expected a tensor on cpu .*got int32\[3\] on meta"):
        ferrite.append_kv(k, v, kc, vc, slots.to("meta"))
    assert kc.abs().sum() == 0  # nothing was written
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fk, fkc, fs = torch.empty(t, h, d), torch.empty(blocks, bs, h, d), torch.empty(t, dtype=torch.int32)
        ops.append_kv(fk, fk, fkc, fkc.clone(), fs)  # well-formed: no error
        with pytest.raises(ValueError, match=r"argument `k`: expected shape \[T, Hkv, D\] = \[3, 2, 8\]"):
            ops.append_kv(torch.empty(t, h, d + 1), fk, fkc, fkc.clone(), fs)
        with pytest.raises(ValueError, match=r"argument `slot_mapping`: expected shape \[T\] = \[3\]"):
            ops.append_kv(fk, fk, fkc, fkc.clone(), torch.empty(t + 1, dtype=torch.int32))
        with pytest.raises(ValueError, match=r"argument `slot_mapping`: expected an int32 tensor of rank 1"):
            ops.append_kv(fk, fk, fkc, fkc.clone(), torch.empty(t))
        with pytest.raises(ValueError, match=r"argument `value_cache`: expected the shape of `key_cache`"):
            ops.append_kv(fk, fk, fkc, torch.empty(blocks, bs, h, d + 8), fs)


def test_gemm_extents_refused_before_any_copy():
    """An expanded view of 2^31 rows is refused from its shape (the GEMM's 32-bit extents), not
    made contiguous first (32 GB and tens of seconds before the native call refused it)."""
    big = 2**31
    with pytest.raises(ValueError, match=r"ferrite.matmul: argument `a`: expected at most 2147483647 rows \(all leading dims\).*got 2147483648"):
        ferrite.matmul(torch.randn(1, 4).expand(big, 4), torch.randn(4, 2))
    with pytest.raises(ValueError, match=r"argument `a`: expected at most 2147483647 rows \(all leading dims\)"):
        ferrite.matmul(torch.randn(1, 1, 4).expand(2, big // 2, 4), torch.randn(4, 2))
    with pytest.raises(ValueError, match=r"argument `b`: expected at most 2147483647 batches"):
        ferrite.matmul(torch.randn(3, 4), torch.randn(1, 4, 2).expand(big, 4, 2))
    with pytest.raises(ValueError, match=r"ferrite.linear: argument `input`: expected at most 2147483647 rows"):
        ferrite.linear(torch.randn(1, 64).expand(big, 64), torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"argument `weight`: expected at most 2147483647 out_features"):
        ferrite.linear(torch.randn(2, 3), torch.randn(1, 3).expand(big, 3))
    # the fakes check too: torch.compile refuses at trace time
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(ValueError, match="rows"):
        ops.matmul(torch.empty(1, 4).expand(big, 4), torch.empty(4, 2))
