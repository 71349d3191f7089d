"""Drop-in modules and the model patcher.

``ferrite.nn.Linear``, ``LayerNorm`` and ``RMSNorm`` subclass their ``torch.nn`` namesakes: same
constructor, same parameters and ``state_dict``; only ``forward`` calls ferrite.  An input ferrite
cannot run (float64, a CPU matmul in 16-bit, a device other than CPU/CUDA) falls back to the torch
implementation, so a swapped model runs wherever the original did.

``optimize(model)`` swaps, in place, every module whose type is exactly ``torch.nn.Linear``,
``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (subclasses are left alone: they may override
``forward``) by changing its class to the ferrite drop-in: the module object, its parameters,
buffers and hooks stay the same objects (an optimizer built before still holds them).
"""

from typing import List, Tuple

import torch
from torch import Tensor

from . import _ops

__all__ = ["Linear", "LayerNorm", "RMSNorm", "optimize"]


def _ferrite_can_run(x: Tensor, matmul: bool) -> bool:
    if x.device.type not in ("cpu", "cuda") or x.dtype not in _ops._DTYPE_NAMES:
        return False
    if matmul and x.device.type == "cpu" and x.dtype != torch.float32:
        return False
    return True


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` running ``ferrite::linear`` (bias fused into the GEMM epilogue)."""

    def forward(self, input: Tensor) -> Tensor:
        if not _ferrite_can_run(input, matmul=True) or input.dtype != self.weight.dtype:
            return super().forward(input)
        return _ops.linear(input, self.weight, self.bias)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` running ``ferrite::layer_norm``."""

    def forward(self, input: Tensor) -> Tensor:
        if not _ferrite_can_run(input, matmul=False) or (
            self.weight is not None and input.dtype != self.weight.dtype
        ):
            return super().forward(input)
        return _ops.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` running ``ferrite::rms_norm``."""

    def forward(self, input: Tensor) -> Tensor:
        if not _ferrite_can_run(input, matmul=False) or (
            self.weight is not None and input.dtype != self.weight.dtype
        ):
            return super().forward(input)
        return _ops.rms_norm(input, self.normalized_shape, self.weight, self.eps)


_SWAPS = {
    torch.nn.Linear: Linear,
    torch.nn.LayerNorm: LayerNorm,
    torch.nn.RMSNorm: RMSNorm,
}


def optimize(
    model: torch.nn.Module, *, linear: bool = True, norms: bool = True
) -> List[Tuple[str, str, str]]:
    """Swaps matching modules of ``model`` (itself included) for ferrite's, in place.

    Returns ``[(qualified name, old class, new class), ...]`` for every module swapped, in
    ``named_modules()`` order; everything else is untouched.
    """
    kinds = set()
    if linear:
        kinds.add(torch.nn.Linear)
    if norms:
        kinds.update((torch.nn.LayerNorm, torch.nn.RMSNorm))
    swapped = []
    for name, mod in model.named_modules():
        cls = type(mod)
        if cls in kinds:
            new = _SWAPS[cls]
            mod.__class__ = new
            swapped.append((name, f"{cls.__module__}.{cls.__qualname__}", f"ferrite.nn.{new.__name__}"))
    return swapped
