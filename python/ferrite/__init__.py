"""ferrite for PyTorch: ferrite's kernels as ``torch.library`` custom ops with autograd and
``torch.compile`` support, drop-in modules, a fused optimizer and a model patcher.

    import ferrite
    y = ferrite.linear(x, w, b, activation="gelu")     # bias + GELU in the GEMM epilogue
    o = ferrite.flash_attn_func(q, k, v, causal=True)  # [B, S, H, D], GQA, window, varlen
    loss = ferrite.cross_entropy(logits, targets)      # fused loss + gradient
    out, aux = ferrite.moe(x, router, w_up, w_down, top_k=2)  # mixture of experts, grouped GEMMs
    swapped = ferrite.optimize(model)                  # nn.Linear / norms / MHA / HF models -> ferrite
    print(ferrite.validate(reference, model, (x,)))    # outputs and gradients compared
    opt = ferrite.optim.AdamW(model.parameters())      # one fused launch per step

The ops are also reachable as ``torch.ops.ferrite.*`` once ``ferrite`` is imported.
"""

from . import _native
from ._attention import (
    append_kv,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    paged_decode,
    paged_decode_errors,
    paged_decode_plan,
    scaled_dot_product_attention,
)
from ._fused import bias_act_dropout, cross_entropy, dropout, geglu, softmax, swiglu
from ._rotary import apply_rotary_emb
from ._fp8 import quantize_fp8, scaled_mm
from ._w8a16 import quantize_int8, w8a16
from ._moe import grouped_mm, moe, moe_forward, moe_metrics
from ._ops import add_layer_norm, add_rms_norm, cuda_status, layer_norm, linear, linear_rows, matmul, mlp, rms_norm
from . import nn, optim
from .nn import optimize
from ._validate import validate

__version__ = _native.__version__
variants = _native.variants

__all__ = [
    "matmul",
    "scaled_mm",
    "quantize_fp8",
    "w8a16",
    "quantize_int8",
    "linear",
    "linear_rows",
    "mlp",
    "rms_norm",
    "layer_norm",
    "add_rms_norm",
    "add_layer_norm",
    "softmax",
    "bias_act_dropout",
    "dropout",
    "swiglu",
    "geglu",
    "cross_entropy",
    "grouped_mm",
    "moe",
    "moe_forward",
    "moe_metrics",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "apply_rotary_emb",
    "scaled_dot_product_attention",
    "paged_decode",
    "paged_decode_plan",
    "paged_decode_errors",
    "append_kv",
    "optimize",
    "validate",
    "nn",
    "optim",
    "cuda_status",
    "variants",
    "__version__",
]
