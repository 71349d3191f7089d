"""The public functions over the ops of ``_ops_matmul``, ``_ops_linear``, ``_ops_mlp`` and
``_ops_norm`` (torch / torch.nn.functional signatures), each calling its op through the eager
fast path, and ``cuda_status``."""

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _native
from ._eager import eager
from ._ops_common import _activation, _fail
from ._ops_norm import _norm_shape


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


def linear(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = None,
    fp8: Optional[str] = None,
) -> Tensor:
    """``torch.nn.functional.linear`` (``input @ weight.T + bias``), optionally followed by a fused
    activation: ``activation`` None, ``"relu"``, ``"gelu"`` (exact, erf), ``"gelu_tanh"`` or
    ``"silu"``. Bias and activation run in the GEMM's epilogue; with an activation the
    pre-activation is kept for the backward only when a gradient will be needed.

    ``fp8="tensorwise"`` or ``"rowwise"``: the forward and both backward GEMMs in FP8 (e4m3
    operands, e5m2 gradients), each operand quantised with current scaling by
    :func:`quantize_fp8` — per tensor, or per row of each operand — then :func:`scaled_mm`
    (no activation with ``fp8``)."""
    if fp8 is not None:
        if activation is not None:
            _fail("ferrite.linear", "activation", "None with fp8 (the FP8 path has no activation epilogue yet)", repr(activation))
        from ._fp8 import linear_fp8

        return linear_fp8(input, weight, bias, fp8)
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
