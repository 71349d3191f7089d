"""ferrite's ops as PyTorch custom ops (``torch.library.custom_op``).

Each op checks its inputs (device, dtype, shapes) in Python, allocates its outputs with torch (so
the caching allocator and CUDA-graph capture see ordinary allocations), and hands ferrite raw
descriptors ``(data_ptr, shape, strides, dtype)`` plus the device index and torch's current CUDA
stream, so the kernels run on torch's stream and write into torch's tensors.

Ops (``torch.ops.ferrite.*``), each with a fake (meta) implementation and, for the forward ones,
autograd whose backward is its own custom op:

- ``matmul(a, b)``: ``a @ b`` for ``a [..., m, k]`` and ``b [k, n]`` or ``b [..., k, n]`` with the
  same batch dims (or a 2-D ``a`` broadcast over them).  Backward: ``matmul_backward``, two matmuls.
- ``linear(x, weight, bias)``: ``x @ weight.T + bias`` (``torch.nn.functional.linear``); the bias
  is added by the GEMM itself (``out = bias; out = x·Wᵀ + 1·out``).  Backward: ``linear_backward``.
- ``rms_norm(x, normalized_shape, weight, eps) -> (y, rstd)`` and
  ``layer_norm(x, normalized_shape, weight, bias, eps) -> (y, mean, rstd)``: the saved statistics
  are float32, one per row.  Backward: ``rms_norm_backward`` / ``layer_norm_backward`` (ferrite's
  norm backward, with dweight/dbias reduced deterministically).

The Python functions :func:`matmul`, :func:`linear`, :func:`rms_norm`, :func:`layer_norm` have the
signatures of their ``torch`` / ``torch.nn.functional`` counterparts and return one tensor.

Layout policy: inputs that the kernels cannot take as they are are **copied**
(``.contiguous()``), as torch's own ops do: matmul takes row-major and transposed operands
(stride 1 in one of the last two dims) without a copy and copies anything else; the norms copy
any non-contiguous input.  The native layer itself never copies on CUDA and raises ``ValueError``
on a layout it cannot take.

Dtypes: float32, float16, bfloat16 on CUDA (sm_80+); on the CPU, matmul/linear run float32 only
and the norms run all three.  float64 is not supported (gradcheck runs in float32).
"""

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _native
from ._eager import eager

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}
_FLOATS = "float32, float16 or bfloat16"


# ----------------------------------------------------------------------------------------------
# checks (shared by the real and the fake implementations, so torch.compile fails early too)


def _fail(op: str, arg: str, expected: str, got: str):
    raise ValueError(f"{op}: argument `{arg}`: expected {expected}, got {got}")


def _describe(t: Tensor) -> str:
    s = f"{str(t.dtype).replace('torch.', '')}{list(t.shape)} on {t.device}"
    if not t.is_contiguous():
        s += f" (strides {list(t.stride())})"
    return s


def _check_tensors(op: str, named: Sequence[Tuple[str, Optional[Tensor]]]) -> None:
    """All given tensors: torch tensors, float32/float16/bfloat16, one dtype, one device."""
    first = None
    for name, t in named:
        if t is None:
            continue
        if not isinstance(t, Tensor):
            _fail(op, name, "a torch.Tensor", type(t).__name__)
        if first is None:
            if t.device.type not in ("cpu", "cuda"):
                _fail(op, name, "a CPU or CUDA tensor", _describe(t))
            if t.dtype not in _DTYPE_NAMES:
                _fail(op, name, f"dtype {_FLOATS}", _describe(t))
            first, fdev, fdt = name, t.device, t.dtype
            continue
        if t.dtype is not fdt:
            if t.dtype not in _DTYPE_NAMES:
                _fail(op, name, f"dtype {_FLOATS}", _describe(t))
            _fail(op, name, f"dtype {str(fdt).replace('torch.', '')} (like `{first}`)", _describe(t))
        if t.device != fdev:
            if t.device.type not in ("cpu", "cuda"):
                _fail(op, name, "a CPU or CUDA tensor", _describe(t))
            _fail(op, name, f"a tensor on {fdev} (like `{first}`)", _describe(t))


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
        return list(a.shape[:-1]) + [n]
    if a.dim() == 2:
        return list(b.shape[:-2]) + [m, n]
    if a.shape[:-2] != b.shape[:-2]:
        _fail(
            op,
            "b",
            f"batch dims {list(a.shape[:-2])} (like a; only a 2-D a or b broadcasts)",
            _describe(b),
        )
    return list(a.shape[:-2]) + [m, n]


def _linear_shape(op: str, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> List[int]:
    _check_tensors(op, [("input", x), ("weight", weight), ("bias", bias)])
    if x.dim() < 1:
        _fail(op, "input", "a tensor of rank ≥ 1 ([..., in_features])", _describe(x))
    if weight.dim() != 2:
        _fail(op, "weight", "a 2-D tensor [out_features, in_features]", _describe(weight))
    if weight.shape[1] != x.shape[-1]:
        _fail(op, "weight", f"[out_features, {x.shape[-1]}] (input is {list(x.shape)})", _describe(weight))
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        _fail(op, "bias", f"a 1-D tensor [{weight.shape[0]}] (out_features)", _describe(bias))
    return list(x.shape[:-1]) + [weight.shape[0]]


def _norm_shape(normalized_shape: Union[int, Sequence[int]]) -> List[int]:
    if isinstance(normalized_shape, int):
        return [normalized_shape]
    return [int(d) for d in normalized_shape]


def _norm_check(op, x, normalized_shape, weight, bias=None) -> Tuple[List[int], int]:
    """Returns (leading shape, cols): x is normalised over its last len(normalized_shape) dims."""
    _check_tensors(op, [("input", x), ("weight", weight), ("bias", bias)])
    ns = list(normalized_shape)
    if len(ns) == 0 or x.dim() < len(ns) or list(x.shape[x.dim() - len(ns):]) != ns:
        _fail(op, "normalized_shape", f"the trailing dims of input {list(x.shape)}", str(ns))
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and list(t.shape) != ns:
            _fail(op, name, f"shape {ns} (normalized_shape)", _describe(t))
    cols = 1
    for d in ns:
        cols *= d
    return list(x.shape[: x.dim() - len(ns)]), cols


# ----------------------------------------------------------------------------------------------
# calling the native module


_DESC_NAMES = {**_DTYPE_NAMES, torch.int32: "int32", torch.int64: "int64"}


def _desc(t: Tensor):
    return (t.data_ptr(), t.shape, t.stride(), _DESC_NAMES[t.dtype])


def _native_call(fn, *args, **kwargs):
    """Calls a native function, turning every tensor argument into its descriptor. The tensors
    stay referenced by ``args``/``kwargs`` until ``fn`` returns, so the pointers stay valid even
    for temporaries such as ``t.contiguous()`` written in the call (a descriptor alone would not
    keep its tensor alive)."""

    return fn(
        *[(a.data_ptr(), a.shape, a.stride(), _DESC_NAMES[a.dtype]) if isinstance(a, Tensor) else a for a in args],
        **{
            k: (v.data_ptr(), v.shape, v.stride(), _DESC_NAMES[v.dtype]) if isinstance(v, Tensor) else v
            for k, v in kwargs.items()
        },
    )


# torch's raw current-stream getter (what inductor's generated code calls): an int, without
# building a torch.cuda.Stream object per call. Falls back to the public API if it is missing.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _where(t: Tensor) -> Tuple[int, int]:
    """(device index, raw CUDA stream) for the native call; (-1, 0) on the CPU."""
    if t.device.type == "cuda":
        idx = t.device.index
        if _raw_stream is not None:
            return idx, _raw_stream(idx)
        return idx, torch.cuda.current_stream(t.device).cuda_stream
    return -1, 0


def _tf32(t: Tensor) -> bool:
    return t.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"


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


def _empty(t: Tensor) -> Tensor:
    """A placeholder for a gradient that was not asked for."""
    return t.new_empty((0,))


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


# ----------------------------------------------------------------------------------------------
# linear


_ACTIVATIONS = {
    None: "none",
    "none": "none",
    "relu": "relu",
    "gelu": "gelu_erf",
    "gelu_erf": "gelu_erf",
    "gelu_tanh": "gelu_tanh",
    "silu": "silu",
}
_ACT_NAMES = "None, 'relu', 'gelu' (erf), 'gelu_tanh' or 'silu'"


def _activation(op: str, activation) -> str:
    if activation not in _ACTIVATIONS:
        _fail(op, "activation", _ACT_NAMES, repr(activation))
    return _ACTIVATIONS[activation]


def _torch_act(z: Tensor, act: str) -> Tensor:
    """The activation in torch (for the empty-K edge case only)."""
    if act == "relu":
        return torch.relu(z)
    if act == "gelu_erf":
        return torch.nn.functional.gelu(z)
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(z, approximate="tanh")
    if act == "silu":
        return torch.nn.functional.silu(z)
    return z


def _rows2(t: Tensor) -> Tensor:
    """t ([rows, cols]) itself if its rows are unit-stride and apart by ≥ cols, else a copy."""
    if t.stride(-1) == 1 and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1]):
        return t
    return t.contiguous()


# On CUDA the linear forward takes ferrite's default selection: `persistent_pairs` (the Hopper
# wgmma GEMM with its epilogue fused, checked on the H100: 0.87–1.03× the bare GEMM at the LLM
# shapes), `fused_pairs` before sm_90. `naive` (the plain GEMM, then bias/activation kernels) ran
# at 0.57–0.78× the bare GEMM, faster than the element-wise epilogue rungs (docs/linear.md).
_CUDA_LINEAR_VARIANT = None


def _linear_run(x: Tensor, weight: Tensor, bias: Optional[Tensor], act: str, save_z: bool, padded_out: bool = False):
    """(y, z) of y = act(x·Wᵀ + b) with ferrite's linear (bias and activation in the GEMM's
    epilogue); z = x·Wᵀ + b is written only when ``save_z`` (else None). With
    ``padded_out``, a y the GEMM wrote into padded rows (see _padded_width) is returned as that
    row-strided view instead of being copied out."""
    shape = list(x.shape[:-1]) + [weight.shape[0]]
    y = x.new_empty(shape)
    z = x.new_empty(shape) if save_z else None
    rows, k, n = math.prod(x.shape[:-1]), x.shape[-1], weight.shape[0]
    if y.numel() == 0:
        return y, z
    if k == 0:  # no GEMM to run: z is the bias (or 0)
        zz = torch.zeros(shape, dtype=x.dtype, device=x.device)
        if bias is not None:
            zz += bias
        y.copy_(_torch_act(zz, act))
        if save_z:
            z.copy_(zz)
        return y, z
    dev, stream = _where(x)
    w_op, b_op = _rows2(weight), None if bias is None else bias.contiguous()
    y_op, z_op = y.view(rows, n), z.view(rows, n) if save_z else None
    npad = _padded_width(x, rows, n)
    if npad != n:
        # Output rows that are not a multiple of 16 bytes keep the GEMM off its TMA-store path:
        # it runs on a weight (and bias) padded with zero rows into padded output rows, and the
        # n columns are copied out below.
        w_op = torch.zeros((npad, k), dtype=weight.dtype, device=weight.device)
        w_op[:n].copy_(weight)
        if bias is not None:
            b_op = torch.zeros((npad,), dtype=bias.dtype, device=bias.device)
            b_op[:n].copy_(bias)
        y_op = x.new_empty((rows, npad))
        z_op = x.new_empty((rows, npad)) if save_z else None
    _native_call(
        _native.linear_forward,
        _rows2(x.reshape(rows, k)),
        w_op,
        y_op,
        bias=b_op,
        z=z_op,
        activation=act,
        tf32=_tf32(x),
        device=dev,
        stream=stream,
        variant=_CUDA_LINEAR_VARIANT if x.is_cuda else None,
    )
    if npad != n:
        if padded_out and not save_z:
            return y_op[:, :n].view(shape), z
        y.view(rows, n).copy_(y_op[:, :n])
        if save_z:
            z.view(rows, n).copy_(z_op[:, :n])
    return y, z


# CUDA linear operands (outputs, gradients) this many elements or more with 16-byte-unaligned
# rows run on padded rows (see _padded_width).
_PAD_MIN_ELEMS = 1 << 22


def _padded_width(t: Tensor, rows: int, n: int) -> int:
    """The row width `linear`'s GEMMs get for rows of n elements of t's dtype: n, or n rounded up
    to 16 bytes for a large (≥ _PAD_MIN_ELEMS) CUDA operand whose rows are unaligned. Hopper's
    TMA needs 16-byte row strides; without them a 50257-wide vocabulary sends the classifier's
    GEMMs to slower paths. At GPT-2's classifier (8192×50257×768 bf16, H100) the padded rows,
    with the copy in or out, take the forward from 4.30 to 2.68 ms and the backward from 22.42 to
    4.94 ms (bench/results/2026-11-27-h100-models/pad-check-fwd-bwd.txt). A stopgap until the
    GEMMs take unaligned rows themselves (issue 25)."""
    es = t.element_size()
    if not t.is_cuda or (n * es) % 16 == 0 or rows * n < _PAD_MIN_ELEMS:
        return n
    step = 16 // es
    return (n + step - 1) // step * step


def _aligned_rows(g: Tensor, act: str) -> Tensor:
    """dY for the backward GEMMs: contiguous, or in padded rows (see _padded_width) — as it came
    when its rows already are (the gradient of ``linear_rows``' output through cross-entropy),
    else copied there."""
    rows, n = g.shape
    npad = _padded_width(g, rows, n) if act == "none" else n
    if npad == n:
        return g.contiguous()
    if g.stride(1) == 1 and g.stride(0) >= n and (g.stride(0) * g.element_size()) % 16 == 0:
        return g
    padded = g.new_empty((rows, npad))[:, :n]
    padded.copy_(g)
    return padded


def _linear_grads(grad, x, weight, z, act, need_x, need_w, need_b):
    n, k = weight.shape
    rows = math.prod(x.shape[:-1])
    dx = x.new_empty(x.shape) if need_x else None
    dw = weight.new_empty(weight.shape) if need_w else None
    db = weight.new_empty((n,)) if need_b else None
    if rows == 0 or k == 0 or n == 0:
        # nothing for the kernels to do; what remains is zeros (and db when k == 0)
        for t in (dx, dw, db):
            if t is not None:
                t.zero_()
        if db is not None and rows > 0 and n > 0:
            g = grad.reshape(rows, n).float()
            if act != "none":
                zz = z.reshape(rows, n).detach().float().requires_grad_(True)
                with torch.enable_grad():
                    (g,) = torch.autograd.grad(_torch_act(zz, act), zz, g)
            db.copy_(g.sum(0))
    elif need_x or need_w or need_b:
        dev, stream = _where(x)
        _native_call(
            _native.linear_backward,
            _aligned_rows(grad.reshape(rows, n), act),
            _rows2(x.reshape(rows, k)),
            _rows2(weight),
            z=None if act == "none" else z.reshape(rows, n).contiguous(),
            dx=None if dx is None else dx.view(rows, k),
            dw=dw,
            db=db,
            activation=act,
            tf32=_tf32(x),
            device=dev,
            stream=stream,
        )
    return (
        dx if need_x else _empty(x),
        dw if need_w else _empty(weight),
        db if need_b else _empty(weight),
    )


@torch.library.custom_op("ferrite::linear", mutates_args=())
def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    _linear_shape("ferrite.linear", x, weight, bias)
    return _linear_run(x, weight, bias, "none", False)[0]


@_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(_linear_shape("ferrite.linear", x, weight, bias))


# linear whose output may keep padded rows: for a classifier whose width is not a multiple of
# 16 bytes (GPT-2's 50257), the GEMM writes padded rows (see _padded_width) and the output is that
# row-strided view — no copy out, and cross-entropy then writes its gradient with the same row
# stride, which the backward GEMMs take as it is (no copy in). Same values as `linear`.


def _rows_strides(shape: List[int], ld: int) -> List[int]:
    strides = [1] * len(shape)
    if len(shape) >= 2:
        strides[-2] = ld
        for i in range(len(shape) - 3, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
    return strides


@torch.library.custom_op("ferrite::linear_rows", mutates_args=())
def _linear_rows(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    _linear_shape("ferrite.linear", x, weight, bias)
    return _linear_run(x, weight, bias, "none", False, padded_out=True)[0]


@_linear_rows.register_fake
def _(x, weight, bias):
    shape = _linear_shape("ferrite.linear", x, weight, bias)
    rows, n = math.prod(shape[:-1]), shape[-1]
    npad = _padded_width(x, rows, n) if rows * n > 0 and x.shape[-1] > 0 else n
    return x.new_empty_strided(shape, _rows_strides(shape, npad))



@torch.library.custom_op("ferrite::linear_backward", mutates_args=())
def _linear_backward(
    grad: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_w: bool, need_b: bool
) -> Tuple[Tensor, Tensor, Tensor]:
    _check_tensors("ferrite.linear_backward", [("grad", grad), ("input", x), ("weight", weight)])
    return _linear_grads(grad, x, weight, None, "none", need_x, need_w, need_b)


def _linear_grads_fake(x, weight, need_x, need_w, need_b):
    return (
        x.new_empty(x.shape) if need_x else _empty(x),
        weight.new_empty(weight.shape) if need_w else _empty(weight),
        weight.new_empty((weight.shape[0],)) if need_b else _empty(weight),
    )


@_linear_backward.register_fake
def _(grad, x, weight, need_x, need_w, need_b):
    _check_tensors("ferrite.linear_backward", [("grad", grad), ("input", x), ("weight", weight)])
    return _linear_grads_fake(x, weight, need_x, need_w, need_b)


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_bwd(ctx, grad):
    x, weight = ctx.saved_tensors
    nx, nw, nb = ctx.needs_input_grad
    nb = bool(nb) and ctx.has_bias
    dx, dw, db = eager.linear_backward(grad, x, weight, nx, nw, nb)
    return (dx if nx else None), (dw if nw else None), (db if nb else None)


_linear.register_autograd(_linear_bwd, setup_context=_linear_setup)
_linear_rows.register_autograd(_linear_bwd, setup_context=_linear_setup)


# linear with a fused activation: y = act(x·Wᵀ + b); z (the pre-activation) kept for backward


@torch.library.custom_op("ferrite::linear_act", mutates_args=())
def _linear_act(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, save_preact: bool
) -> Tuple[Tensor, Tensor]:
    _linear_shape("ferrite.linear", x, weight, bias)
    act = _activation("ferrite.linear", activation)
    y, z = _linear_run(x, weight, bias, act, save_preact and act != "none")
    return y, (_empty(x) if z is None else z)


@_linear_act.register_fake
def _(x, weight, bias, activation, save_preact):
    shape = _linear_shape("ferrite.linear", x, weight, bias)
    act = _activation("ferrite.linear", activation)
    return x.new_empty(shape), (x.new_empty(shape) if save_preact and act != "none" else _empty(x))


@torch.library.custom_op("ferrite::linear_act_backward", mutates_args=())
def _linear_act_backward(
    grad: Tensor,
    x: Tensor,
    weight: Tensor,
    preact: Tensor,
    activation: str,
    need_x: bool,
    need_w: bool,
    need_b: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    op = "ferrite.linear_backward"
    _check_tensors(op, [("grad", grad), ("input", x), ("weight", weight), ("preact", preact)])
    act = _activation(op, activation)
    if act != "none" and list(preact.shape) != list(grad.shape):
        _fail(op, "preact", f"the forward's pre-activation {list(grad.shape)}", _describe(preact))
    return _linear_grads(grad, x, weight, preact, act, need_x, need_w, need_b)


@_linear_act_backward.register_fake
def _(grad, x, weight, preact, activation, need_x, need_w, need_b):
    _check_tensors("ferrite.linear_backward", [("grad", grad), ("input", x), ("weight", weight)])
    return _linear_grads_fake(x, weight, need_x, need_w, need_b)


def _linear_act_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # outputs without a gradient: None, not filled zeros
    x, weight, bias, activation, save_preact = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.has_bias = bias is not None
    ctx.activation = activation
    ctx.saved_preact = save_preact


def _linear_act_bwd(ctx, grad, _grad_z):
    if grad is None:  # only an output without a gradient was used
        return (None,) * 5
    x, weight, z = ctx.saved_tensors
    act = _activation("ferrite.linear_backward", ctx.activation)
    if act != "none" and not ctx.saved_preact:
        raise RuntimeError(
            "ferrite.linear: backward through an activation needs the pre-activation, which was "
            "not kept (save_preact=False: the forward ran without gradients)"
        )
    nx, nw, nb = ctx.needs_input_grad[:3]
    nb = bool(nb) and ctx.has_bias
    dx, dw, db = eager.linear_act_backward(grad, x, weight, z, ctx.activation, nx, nw, nb)
    return (dx if nx else None), (dw if nw else None), (db if nb else None), None, None


_linear_act.register_autograd(_linear_act_bwd, setup_context=_linear_act_setup)


# the two-layer MLP, y = act(x·W1ᵀ + b1)·W2ᵀ + b2, with its backward in the chain form: the
# second layer's dX GEMM applies act' of the first layer's pre-activation in its epilogue and
# writes the column sums that are db1 (ferrite's linear backward with `x_pre`, `db_pre`), so no
# pass over the hidden activations' gradient is left; then the first layer's two GEMMs.


def _mlp_shapes(op, x, w1, b1, w2, b2) -> Tuple[List[int], List[int]]:
    hidden = _linear_shape(op, x, w1, b1)
    _check_tensors(op, [("input", x), ("w2", w2), ("b2", b2)])
    if w2.dim() != 2 or w2.shape[1] != w1.shape[0]:
        _fail(op, "w2", f"a 2-D tensor [out_features, {w1.shape[0]}] (w1 is {list(w1.shape)})", _describe(w2))
    if b2 is not None and (b2.dim() != 1 or b2.shape[0] != w2.shape[0]):
        _fail(op, "b2", f"a 1-D tensor [{w2.shape[0]}] (out_features)", _describe(b2))
    return hidden, list(x.shape[:-1]) + [w2.shape[0]]


@torch.library.custom_op("ferrite::mlp", mutates_args=())
def _mlp(
    x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: str, save_preact: bool
) -> Tuple[Tensor, Tensor, Tensor]:
    _mlp_shapes("ferrite.mlp", x, w1, b1, w2, b2)
    act = _activation("ferrite.mlp", activation)
    h, z = _linear_run(x, w1, b1, act, save_preact)
    y, _ = _linear_run(h, w2, b2, "none", False)
    z = _empty(x) if z is None else z
    return y, h, z


@_mlp.register_fake
def _(x, w1, b1, w2, b2, activation, save_preact):
    hidden, out = _mlp_shapes("ferrite.mlp", x, w1, b1, w2, b2)
    _activation("ferrite.mlp", activation)
    return x.new_empty(out), x.new_empty(hidden), (x.new_empty(hidden) if save_preact else _empty(x))


def _mlp_grads(grad, x, w1, h, z, w2, act, need):
    """(dx, dw1, db1, dw2, db2) of the MLP; `need` says which (the rest: empty placeholders)."""
    nx, nw1, nb1, nw2, nb2 = need
    rows, k, hid, n = math.prod(x.shape[:-1]), x.shape[-1], w1.shape[0], w2.shape[0]
    out = [
        x.new_empty(x.shape) if nx else _empty(x),
        w1.new_empty(w1.shape) if nw1 else _empty(w1),
        w1.new_empty((hid,)) if nb1 else _empty(w1),
    ]
    lower = nx or nw1 or nb1
    if min(rows, k, hid, n) == 0:
        # an empty GEMM somewhere: the two layers' own backward (its edge cases included)
        dh = _linear_grads(grad, h, w2, None, "none", lower, nw2, nb2)
        if lower:
            out[:3] = _linear_grads(dh[0], x, w1, z, act, nx, nw1, nb1)
        return (*out, dh[1], dh[2])
    dw2 = w2.new_empty(w2.shape) if nw2 else None
    db2 = w2.new_empty((n,)) if nb2 else None
    dz = x.new_empty((rows, hid)) if lower else None
    dev, stream = _where(x)
    tf32 = _tf32(x)
    if lower or nw2 or nb2:
        _native_call(
            _native.linear_backward,
            grad.reshape(rows, n).contiguous(),
            _rows2(h.reshape(rows, hid)),
            _rows2(w2),
            dx=dz,
            dw=dw2,
            db=db2,
            tf32=tf32,
            device=dev,
            stream=stream,
            x_pre=z.reshape(rows, hid).contiguous() if lower else None,
            x_pre_activation=act,
            db_pre=out[2] if nb1 else None,
        )
    if nx or nw1:
        _native_call(
            _native.linear_backward,
            dz,
            _rows2(x.reshape(rows, k)),
            _rows2(w1),
            dx=out[0].view(rows, k) if nx else None,
            dw=out[1] if nw1 else None,
            tf32=tf32,
            device=dev,
            stream=stream,
        )
    return (*out, dw2 if nw2 else _empty(w2), db2 if nb2 else _empty(w2))


@torch.library.custom_op("ferrite::mlp_backward", mutates_args=())
def _mlp_backward(
    grad: Tensor,
    x: Tensor,
    w1: Tensor,
    h: Tensor,
    preact: Tensor,
    w2: Tensor,
    activation: str,
    need: List[bool],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    op = "ferrite.mlp_backward"
    _check_tensors(op, [("grad", grad), ("input", x), ("w1", w1), ("hidden", h), ("preact", preact), ("w2", w2)])
    act = _activation(op, activation)
    if len(need) != 5:
        _fail(op, "need", "5 flags (dx, dw1, db1, dw2, db2)", str(len(need)))
    if list(preact.shape) != list(h.shape):
        _fail(op, "preact", f"the forward's pre-activation {list(h.shape)}", _describe(preact))
    return _mlp_grads(grad, x, w1, h, preact, w2, act, need)


@_mlp_backward.register_fake
def _(grad, x, w1, h, preact, w2, activation, need):
    nx, nw1, nb1, nw2, nb2 = need
    return (
        x.new_empty(x.shape) if nx else _empty(x),
        w1.new_empty(w1.shape) if nw1 else _empty(w1),
        w1.new_empty((w1.shape[0],)) if nb1 else _empty(w1),
        w2.new_empty(w2.shape) if nw2 else _empty(w2),
        w2.new_empty((w2.shape[0],)) if nb2 else _empty(w2),
    )


def _mlp_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # outputs without a gradient: None, not filled zeros
    x, w1, b1, w2, b2, activation, save_preact = inputs
    ctx.save_for_backward(x, w1, output[1], output[2], w2)
    ctx.has_bias = (b1 is not None, b2 is not None)
    ctx.activation = activation
    ctx.saved_preact = save_preact


def _mlp_bwd(ctx, grad, _grad_h, _grad_z):
    if grad is None:  # only an output without a gradient was used
        return (None,) * 7
    x, w1, h, z, w2 = ctx.saved_tensors
    if not ctx.saved_preact:
        raise RuntimeError(
            "ferrite.mlp: backward needs the pre-activation, which was not kept (save_preact=False: "
            "the forward ran without gradients)"
        )
    nx, nw1, nb1, nw2, nb2 = ctx.needs_input_grad[:5]
    need = [bool(nx), bool(nw1), bool(nb1) and ctx.has_bias[0], bool(nw2), bool(nb2) and ctx.has_bias[1]]
    g = eager.mlp_backward(grad, x, w1, h, z, w2, ctx.activation, need)
    return tuple(t if n else None for t, n in zip(g, need)) + (None, None)


_mlp.register_autograd(_mlp_bwd, setup_context=_mlp_setup)


# ----------------------------------------------------------------------------------------------
# norms


def _norm_forward(kind, x, ns, weight, bias, eps):
    return _norm_run(f"ferrite.{kind}", kind, x, ns, weight, bias, eps)[:3]


def _norm_run(op, kind, x, ns, weight, bias, eps, residual=None):
    """(y, mean, rstd, h): the norm of x, or with `residual` of h = x + residual (written too)."""
    lead, cols = _norm_check(op, x, ns, weight, bias)
    xc = x.contiguous()  # the norm kernels need contiguous rows: copy if not
    y = x.new_empty(x.shape)
    h = None if residual is None else x.new_empty(x.shape)
    mean = x.new_empty(lead, dtype=torch.float32) if kind == "layer_norm" else None
    rstd = x.new_empty(lead, dtype=torch.float32)
    if x.numel() > 0:
        shape2 = lead + [cols]
        dev, stream = _where(x)
        _native_call(
            _native.norm_forward,
            kind,
            xc.view(shape2),
            y.view(shape2),
            residual=None if residual is None else residual.contiguous().view(shape2),
            weight=None if weight is None else weight.contiguous().view(cols),
            bias=None if bias is None else bias.contiguous().view(cols),
            h=None if h is None else h.view(shape2),
            mean=mean,
            rstd=rstd,
            eps=float(eps),
            device=dev,
            stream=stream,
        )
    return y, mean, rstd, h


def _norm_backward(kind, grad, x, ns, weight, mean, rstd, need_w, need_b):
    op = f"ferrite.{kind}_backward"
    lead, cols = _norm_check(op, x, ns, weight)
    _check_tensors(op, [("input", x), ("grad", grad)])
    dx = x.new_empty(x.shape)
    dw = x.new_empty(ns) if need_w else None
    db = x.new_empty(ns) if need_b else None
    if x.numel() > 0:
        shape2 = lead + [cols]
        dev, stream = _where(x)
        _native_call(
            _native.norm_backward,
            kind,
            grad.contiguous().view(shape2),
            x.contiguous().view(shape2),
            rstd.contiguous(),
            dx.view(shape2),
            weight=None if weight is None else weight.contiguous().view(cols),
            mean=None if mean is None else mean.contiguous(),
            dweight=None if dw is None else dw.view(cols),
            dbias=None if db is None else db.view(cols),
            device=dev,
            stream=stream,
        )
    else:
        if dw is not None:
            dw.zero_()
        if db is not None:
            db.zero_()
    return dx, (dw if need_w else _empty(x)), (db if need_b else _empty(x))


def _norm_fake(kind, x, ns, weight, bias):
    lead, _ = _norm_check(f"ferrite.{kind}", x, ns, weight, bias)
    y = x.new_empty(x.shape)
    rstd = x.new_empty(lead, dtype=torch.float32)
    mean = x.new_empty(lead, dtype=torch.float32) if kind == "layer_norm" else None
    return y, mean, rstd


@torch.library.custom_op("ferrite::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, normalized_shape: List[int], weight: Optional[Tensor], eps: float) -> Tuple[Tensor, Tensor]:
    y, _, rstd = _norm_forward("rms_norm", x, normalized_shape, weight, None, eps)
    return y, rstd


@_rms_norm.register_fake
def _(x, normalized_shape, weight, eps):
    y, _, rstd = _norm_fake("rms_norm", x, normalized_shape, weight, None)
    return y, rstd


@torch.library.custom_op("ferrite::rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    grad: Tensor, x: Tensor, normalized_shape: List[int], weight: Optional[Tensor], rstd: Tensor, need_w: bool
) -> Tuple[Tensor, Tensor]:
    dx, dw, _ = _norm_backward("rms_norm", grad, x, normalized_shape, weight, None, rstd, need_w, False)
    return dx, dw


@_rms_norm_backward.register_fake
def _(grad, x, normalized_shape, weight, rstd, need_w):
    _norm_check("ferrite.rms_norm_backward", x, normalized_shape, weight)
    return x.new_empty(x.shape), (x.new_empty(normalized_shape) if need_w else _empty(x))


def _rms_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # outputs without a gradient: None, not filled zeros
    x, ns, weight, eps = inputs
    ctx.ns = ns
    ctx.save_for_backward(x, weight, output[1])


def _rms_bwd(ctx, grad, _grad_rstd):
    if grad is None:  # only an output without a gradient was used
        return (None,) * 4
    x, weight, rstd = ctx.saved_tensors
    need_w = weight is not None and ctx.needs_input_grad[2]
    dx, dw = eager.rms_norm_backward(grad, x, ctx.ns, weight, rstd, need_w)
    return dx, None, (dw if need_w else None), None


_rms_norm.register_autograd(_rms_bwd, setup_context=_rms_setup)


@torch.library.custom_op("ferrite::layer_norm", mutates_args=())
def _layer_norm(
    x: Tensor, normalized_shape: List[int], weight: Optional[Tensor], bias: Optional[Tensor], eps: float
) -> Tuple[Tensor, Tensor, Tensor]:
    return _norm_forward("layer_norm", x, normalized_shape, weight, bias, eps)


@_layer_norm.register_fake
def _(x, normalized_shape, weight, bias, eps):
    return _norm_fake("layer_norm", x, normalized_shape, weight, bias)


@torch.library.custom_op("ferrite::layer_norm_backward", mutates_args=())
def _layer_norm_backward(
    grad: Tensor,
    x: Tensor,
    normalized_shape: List[int],
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    need_w: bool,
    need_b: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    return _norm_backward("layer_norm", grad, x, normalized_shape, weight, mean, rstd, need_w, need_b)


@_layer_norm_backward.register_fake
def _(grad, x, normalized_shape, weight, mean, rstd, need_w, need_b):
    _norm_check("ferrite.layer_norm_backward", x, normalized_shape, weight)
    return (
        x.new_empty(x.shape),
        x.new_empty(normalized_shape) if need_w else _empty(x),
        x.new_empty(normalized_shape) if need_b else _empty(x),
    )


def _ln_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # outputs without a gradient: None, not filled zeros
    x, ns, weight, bias, eps = inputs
    ctx.ns = ns
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, output[1], output[2])


def _ln_bwd(ctx, grad, _grad_mean, _grad_rstd):
    if grad is None:  # only an output without a gradient was used
        return (None,) * 5
    x, weight, mean, rstd = ctx.saved_tensors
    need_w = weight is not None and ctx.needs_input_grad[2]
    need_b = ctx.has_bias and ctx.needs_input_grad[3]
    dx, dw, db = eager.layer_norm_backward(grad, x, ctx.ns, weight, mean, rstd, need_w, need_b)
    return dx, None, (dw if need_w else None), (db if need_b else None), None


_layer_norm.register_autograd(_ln_bwd, setup_context=_ln_setup)


# ----------------------------------------------------------------------------------------------
# residual add + norm, fused: h = x + residual, y = norm(h) in one kernel (one read of each input,
# one write of y and h)


def _add_norm_check(op, x, residual):
    if not isinstance(residual, Tensor) or residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        _fail(op, "residual", f"a tensor like `input` ({_describe(x)})", _describe(residual))


@torch.library.custom_op("ferrite::add_norm", mutates_args=())
def _add_norm(
    kind: str,
    x: Tensor,
    residual: Tensor,
    normalized_shape: List[int],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    op = f"ferrite.add_{kind}"
    _add_norm_check(op, x, residual)
    y, mean, rstd, h = _norm_run(op, kind, x, normalized_shape, weight, bias, eps, residual)
    return y, h, (mean if mean is not None else _empty(x)), rstd


@_add_norm.register_fake
def _(kind, x, residual, normalized_shape, weight, bias, eps):
    _add_norm_check(f"ferrite.add_{kind}", x, residual)
    y, mean, rstd = _norm_fake(kind, x, normalized_shape, weight, bias)
    return y, x.new_empty(x.shape), (mean if mean is not None else _empty(x)), rstd


def _add_norm_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # outputs without a gradient: None, not filled zeros
    kind, x, residual, ns, weight, bias, eps = inputs
    ctx.kind, ctx.ns, ctx.has_bias = kind, ns, bias is not None
    ctx.save_for_backward(output[1], weight, output[2], output[3])


def _add_norm_bwd(ctx, grad_y, grad_h, _grad_mean, _grad_rstd):
    h, weight, mean, rstd = ctx.saved_tensors
    need_w = weight is not None and ctx.needs_input_grad[4]
    need_b = ctx.has_bias and ctx.needs_input_grad[5]
    if grad_y is None:  # only the new residual stream was used
        need_w = need_b = False
        dh, dw, db = grad_h, None, None
    elif ctx.kind == "rms_norm":
        dh, dw = eager.rms_norm_backward(grad_y, h, ctx.ns, weight, rstd, need_w)
        db = None
    else:
        dh, dw, db = eager.layer_norm_backward(grad_y, h, ctx.ns, weight, mean, rstd, need_w, need_b)
    # h = x + residual feeds both the norm and the caller (the new residual stream)
    if grad_y is not None and grad_h is not None:
        dh = dh + grad_h
    return (
        None,
        dh if ctx.needs_input_grad[1] else None,
        dh if ctx.needs_input_grad[2] else None,
        None,
        dw if need_w else None,
        db if need_b else None,
        None,
    )


_add_norm.register_autograd(_add_norm_bwd, setup_context=_add_norm_setup)


# ----------------------------------------------------------------------------------------------
# the public functions (torch / torch.nn.functional signatures)


def linear_rows(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``linear`` for a classifier head: on CUDA, when the output rows are not a multiple of 16
    bytes (a 50257-wide vocabulary) and the output is large, the result is a view with padded rows
    (row stride rounded up to 16 bytes; ``.contiguous()`` packs it) instead of a packed copy, and
    ``ferrite.cross_entropy`` on it writes its gradient in the same rows — the classifier's
    forward and backward GEMMs then run without a copy of the logits either way. Otherwise the
    same as ``linear``."""
    return eager.linear_rows(input, weight, bias)


def matmul(input: Tensor, other: Tensor) -> Tensor:
    """``torch.matmul`` for ``input [..., m, k]`` and ``other [k, n]`` or ``[..., k, n]``."""
    return eager.matmul(input, other)


def linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None) -> Tensor:
    """``torch.nn.functional.linear`` (``input @ weight.T + bias``), optionally followed by a fused
    activation: ``activation`` None, ``"relu"``, ``"gelu"`` (exact, erf), ``"gelu_tanh"`` or
    ``"silu"``. Bias and activation run in the GEMM's epilogue; with an activation the
    pre-activation is kept for the backward only when a gradient will be needed."""
    act = _activation("ferrite.linear", activation)
    if act == "none":
        return eager.linear(input, weight, bias)
    need = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, weight, bias)
    )
    return eager.linear_act(input, weight, bias, act, need)[0]


def mlp(
    input: Tensor,
    w1: Tensor,
    b1: Optional[Tensor],
    w2: Tensor,
    b2: Optional[Tensor],
    activation: str = "gelu_tanh",
) -> Tensor:
    """The transformer MLP ``linear(activation(linear(input, w1, b1)), w2, b2)`` (``activation``
    ``"relu"``, ``"gelu"`` (erf), ``"gelu_tanh"`` or ``"silu"``). Forward: two GEMMs, the first
    with bias and activation in its epilogue (keeping the pre-activation when a gradient will be
    needed). Backward in the chain form: the second layer's dX GEMM applies the activation's
    derivative and writes db1's column sums in its epilogue, so the hidden layer's gradient is
    formed once, inside a GEMM; then the first layer's dX and dW GEMMs."""
    act = _activation("ferrite.mlp", activation)
    if act == "none":
        _fail("ferrite.mlp", "activation", "an activation ('relu', 'gelu', 'gelu_tanh', 'silu')", repr(activation))
    need = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, w1, b1, w2, b2))
    return eager.mlp(input, w1, b1, w2, b2, act, need)[0]


def rms_norm(
    input: Tensor,
    normalized_shape: Union[int, Sequence[int]],
    weight: Optional[Tensor] = None,
    eps: Optional[float] = None,
) -> Tensor:
    """``torch.nn.functional.rms_norm`` (eps None: ``torch.finfo(input.dtype).eps``, as torch)."""
    if eps is None:
        eps = torch.finfo(input.dtype).eps if input.is_floating_point() else 1e-6
    return eager.rms_norm(input, _norm_shape(normalized_shape), weight, float(eps))[0]


def layer_norm(
    input: Tensor,
    normalized_shape: Union[int, Sequence[int]],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
) -> Tensor:
    """``torch.nn.functional.layer_norm``."""
    return eager.layer_norm(input, _norm_shape(normalized_shape), weight, bias, float(eps))[0]


def add_rms_norm(
    input: Tensor,
    residual: Tensor,
    normalized_shape: Union[int, Sequence[int]],
    weight: Optional[Tensor] = None,
    eps: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """The pre-norm block's residual step fused: ``h = input + residual``, returns
    ``(rms_norm(h), h)`` — the normed output and the new residual stream — from one kernel."""
    if eps is None:
        eps = torch.finfo(input.dtype).eps if input.is_floating_point() else 1e-6
    y, h, _, _ = eager.add_norm("rms_norm", input, residual, _norm_shape(normalized_shape), weight, None, float(eps))
    return y, h


def add_layer_norm(
    input: Tensor,
    residual: Tensor,
    normalized_shape: Union[int, Sequence[int]],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
) -> Tuple[Tensor, Tensor]:
    """``h = input + residual``, returns ``(layer_norm(h), h)`` from one kernel."""
    y, h, _, _ = eager.add_norm("layer_norm", input, residual, _norm_shape(normalized_shape), weight, bias, float(eps))
    return y, h


def cuda_status() -> Tuple[int, Optional[str]]:
    """(CUDA devices ferrite can use, None) or (0, why not)."""
    return _native.cuda_status()

