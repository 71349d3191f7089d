"""``ferrite::matmul`` and its backward, and the GEMM call (``_mm_into``) behind them."""

import math
from typing import List, Tuple

import torch
from torch import Tensor

from . import _native
from ._eager import eager
from ._ops_common import _check_gemm_extents, _check_tensors, _describe, _empty, _fail, _native_call, _tf32, _where


# ----------------------------------------------------------------------------------------------
# checks (shared by the real and the fake implementations, so torch.compile fails early too)


def _check_cpu_matmul_dtype(op: str, t: Tensor) -> None:
    if t.device.type == "cpu" and t.dtype != torch.float32:
        _fail(
            op,
            "a",
            "float32 on the CPU (ferrite's CPU GEMMs are fp32; CUDA runs float32/float16/bfloat16)",
            _describe(t),
        )


def _matmul_shape(op: str, a: Tensor, b: Tensor) -> List[int]:
    _check_tensors(op, [("a", a), ("b", b)])
    _check_cpu_matmul_dtype(op, a)
    if a.dim() < 2:
        _fail(op, "a", "a tensor of rank ≥ 2 ([..., m, k])", _describe(a))
    if b.dim() < 2:
        _fail(op, "b", "a tensor of rank ≥ 2 ([k, n] or [..., k, n])", _describe(b))
    m, k = a.shape[-2], a.shape[-1]
    if b.shape[-2] != k:
        _fail(op, "b", f"{k} rows (a is {list(a.shape)}: inner dims must match)", _describe(b))
    n = b.shape[-1]
    if b.dim() == 2:
        # [..., m, k] @ [k, n] is one GEMM over all of a's rows
        _check_gemm_extents(op, [("a", "rows (all leading dims)", math.prod(a.shape[:-1])), ("a", "columns (k)", k), ("b", "columns (n)", n)])
        return list(a.shape[:-1]) + [n]
    if a.dim() == 2:
        _check_gemm_extents(op, [("a", "rows (m)", m), ("a", "columns (k)", k), ("b", "columns (n)", n), ("b", "batches", math.prod(b.shape[:-2]))])
        return list(b.shape[:-2]) + [m, n]
    if a.shape[:-2] != b.shape[:-2]:
        _fail(
            op,
            "b",
            f"batch dims {list(a.shape[:-2])} (like a; only a 2-D a or b broadcasts)",
            _describe(b),
        )
    _check_gemm_extents(op, [("a", "rows (m)", m), ("a", "columns (k)", k), ("b", "columns (n)", n), ("a", "batches", math.prod(a.shape[:-2]))])
    return list(a.shape[:-2]) + [m, n]


# ----------------------------------------------------------------------------------------------
# calling the native module


def _mm_operand(t: Tensor) -> Tensor:
    """t itself if the GEMM can read it (row-major or transposed: stride 1 in one of the last two
    dims, rows/cols apart by at least their length), else a contiguous copy."""
    r, c = t.shape[-2], t.shape[-1]
    sr, sc = t.stride(-2), t.stride(-1)
    if (c <= 1 or sc == 1) and (r <= 1 or sr >= max(c, 1)):
        return t
    if (r <= 1 or sr == 1) and (c <= 1 or sc >= max(r, 1)):
        return t
    return t.contiguous()


def _mm_into(a: Tensor, b: Tensor, out: Tensor, beta: float = 0.0) -> None:
    """out = a @ b + beta·out with ferrite's GEMM; out is contiguous with the matmul shape."""
    if out.numel() == 0:
        return
    k, n = a.shape[-1], b.shape[-1]
    if k == 0:
        if beta == 0.0:
            out.zero_()
        else:
            out.mul_(beta)
        return
    if b.dim() == 2:
        # [..., m, k] @ [k, n]: one GEMM over all rows (a copy only if the rows cannot be merged)
        rows = math.prod(a.shape[:-1])
        a2, b2, o2 = a.reshape(rows, k), b, out.view(rows, n)
    elif a.dim() == 2:
        m = a.shape[0]
        a2, b2, o2 = a, b.reshape(-1, k, n), out.view(-1, m, n)
    else:
        m = a.shape[-2]
        a2, b2, o2 = a.reshape(-1, m, k), b.reshape(-1, k, n), out.view(-1, m, n)
    a2, b2 = _mm_operand(a2), _mm_operand(b2)
    dev, stream = _where(out)
    _native_call(_native.matmul, a2, b2, o2, 1.0, float(beta), _tf32(out), dev, stream)


# ----------------------------------------------------------------------------------------------
# matmul


@torch.library.custom_op("ferrite::matmul", mutates_args=())
def _matmul(a: Tensor, b: Tensor) -> Tensor:
    shape = _matmul_shape("ferrite.matmul", a, b)
    out = a.new_empty(shape)
    _mm_into(a, b, out)
    return out


@_matmul.register_fake
def _(a, b):
    return a.new_empty(_matmul_shape("ferrite.matmul", a, b))


def _matmul_grads(grad, a, b, need_a, need_b, fake):
    """Shapes (fake) or values of (da, db) for c = a @ b."""
    bt = b.transpose(-1, -2)
    at = a.transpose(-1, -2)
    da = db = None
    if need_a:
        if b.dim() > 2 and a.dim() == 2:
            # a was broadcast over b's batch: da = Σ_batch grad·bᵀ
            if fake:
                da = a.new_empty(a.shape)
            else:
                full = grad.new_empty(list(grad.shape[:-1]) + [a.shape[-1]])
                _mm_into(grad, bt, full)
                da = full.reshape(math.prod(b.shape[:-2]), a.shape[0], a.shape[1]).sum(0)
        else:
            da = a.new_empty(a.shape)
            if not fake:
                _mm_into(grad, bt, da)
    if need_b:
        db = b.new_empty(b.shape)
        if not fake:
            if b.dim() == 2:
                # Σ over every row of a: aᵀ [k, rows] @ grad [rows, n]
                k, n = a.shape[-1], b.shape[-1]
                rows = math.prod(a.shape[:-1])
                _mm_into(a.reshape(rows, k).transpose(0, 1), grad.reshape(rows, n), db)
            else:
                _mm_into(at, grad, db)
    return (da if need_a else _empty(a)), (db if need_b else _empty(b))


@torch.library.custom_op("ferrite::matmul_backward", mutates_args=())
def _matmul_backward(grad: Tensor, a: Tensor, b: Tensor, need_a: bool, need_b: bool) -> Tuple[Tensor, Tensor]:
    _check_tensors("ferrite.matmul_backward", [("grad", grad), ("a", a), ("b", b)])
    return _matmul_grads(grad, a, b, need_a, need_b, fake=False)


@_matmul_backward.register_fake
def _(grad, a, b, need_a, need_b):
    _check_tensors("ferrite.matmul_backward", [("grad", grad), ("a", a), ("b", b)])
    return _matmul_grads(grad, a, b, need_a, need_b, fake=True)


def _matmul_setup(ctx, inputs, output):
    a, b = inputs
    ctx.save_for_backward(a, b)


def _matmul_bwd(ctx, grad):
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    da, db = eager.matmul_backward(grad, a, b, need_a, need_b)
    return (da if need_a else None), (db if need_b else None)


_matmul.register_autograd(_matmul_bwd, setup_context=_matmul_setup)
