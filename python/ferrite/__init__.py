"""ferrite for PyTorch: ferrite's kernels as ``torch.library`` custom ops with autograd and
``torch.compile`` support, drop-in modules, and a model patcher.

    import ferrite
    y = ferrite.linear(x, w, b)            # or ferrite.rms_norm / layer_norm / matmul
    swapped = ferrite.optimize(model)      # nn.Linear / nn.LayerNorm / nn.RMSNorm -> ferrite

The ops are also reachable as ``torch.ops.ferrite.*`` once ``ferrite`` is imported.
"""

from . import _native
from ._ops import cuda_status, layer_norm, linear, matmul, rms_norm
from . import nn
from .nn import optimize

__version__ = _native.__version__
variants = _native.variants

__all__ = [
    "matmul",
    "linear",
    "rms_norm",
    "layer_norm",
    "optimize",
    "nn",
    "cuda_status",
    "variants",
    "__version__",
]
