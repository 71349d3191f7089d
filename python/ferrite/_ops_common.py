"""The helpers shared by ferrite's custom ops (``_ops`` and the op modules beside it): dtype names,
the argument checks, tensor descriptors and the native call, the device/stream of a call, and the
activation names with their torch reference."""

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

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


# The GEMMs (ferrite's kernels, cuBLAS) index each extent with 32-bit integers.
_GEMM_EXTENT_MAX = 2**31 - 1


def _check_gemm_extents(op: str, extents: Sequence[Tuple[str, str, int]]) -> None:
    """Each (argument, what, size) at most _GEMM_EXTENT_MAX: refused from the shapes, before an
    output is allocated or an operand copied (an expanded view of 2^31 rows would otherwise be
    made contiguous first — tens of GB — only for the native call to refuse it)."""
    for name, what, v in extents:
        if v > _GEMM_EXTENT_MAX:
            _fail(op, name, f"at most {_GEMM_EXTENT_MAX} {what} (the GEMM's 32-bit extents)", f"{v}")


# ----------------------------------------------------------------------------------------------
# calling the native module


_DESC_NAMES = {
    **_DTYPE_NAMES,
    torch.int32: "int32",
    torch.int64: "int64",
    torch.int8: "int8",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}


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


def _empty(t: Tensor) -> Tensor:
    """A placeholder for a gradient that was not asked for."""
    return t.new_empty((0,))


# ----------------------------------------------------------------------------------------------
# activations


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
