"""Drop-in modules and the model patcher.

``ferrite.nn.Linear``, ``LayerNorm`` and ``RMSNorm`` subclass their ``torch.nn`` namesakes: same
constructor, same parameters and ``state_dict``; only ``forward`` calls ferrite.  An input ferrite
cannot run (float64, a CPU matmul in 16-bit, a device other than CPU/CUDA) falls back to the torch
implementation, so a swapped model runs wherever the original did.

``ferrite.nn.MultiheadAttention`` subclasses ``torch.nn.MultiheadAttention`` and runs ferrite's
flash attention when the call allows it (``need_weights=False``, no key-padding mask, no explicit
mask other than a causal one flagged by ``is_causal``, no ``bias_k``/``add_zero_attn``, dropout 0
or eval mode); any other call runs torch's implementation.

New modules with no exact torch counterpart: ``MoE`` (a mixture of experts with SwiGLU experts,
as ``ferrite.moe``), ``MLP`` (the GPT-style MLP, fc1 → activation → fc2,
as ``ferrite.mlp``: the activation's backward and fc1's bias gradient inside fc2's dX GEMM),
``SwiGLU`` (the gated MLP of Llama-style blocks:
one fused gate+up projection, ferrite's SwiGLU, the down projection) and ``CausalSelfAttention``
(fused QKV projection, flash attention with optional GQA / sliding window, output projection).

``optimize(model)`` swaps, in place, every module whose type is exactly ``torch.nn.Linear``,
``torch.nn.LayerNorm``, ``torch.nn.RMSNorm`` or ``torch.nn.MultiheadAttention`` (subclasses are
left alone: they may override ``forward``) by changing its class to the ferrite drop-in: the module
object, its parameters, buffers and hooks stay the same objects (an optimizer built before still
holds them).
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _attention, _fused, _moe, _ops

__all__ = ["Linear", "LayerNorm", "RMSNorm", "MultiheadAttention", "MLP", "SwiGLU", "MoE", "CausalSelfAttention", "optimize"]


def _ferrite_can_run(x: Tensor, matmul: bool = False) -> bool:
    if x.device.type not in ("cpu", "cuda") or x.dtype not in _ops._DTYPE_NAMES:
        return False
    if matmul and x.device.type == "cpu" and x.dtype != torch.float32:
        return False
    return True


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` running ``ferrite::linear`` (bias fused into the GEMM epilogue)."""

    def forward(self, input: Tensor) -> Tensor:
        if not _ferrite_can_run(input) or input.dtype != self.weight.dtype:
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


class MultiheadAttention(torch.nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` running ferrite's projections and flash attention where the
    call allows it (see the module docs); otherwise torch's implementation."""

    def _ferrite_fits(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal) -> bool:
        if need_weights or key_padding_mask is not None:
            return False
        if attn_mask is not None and not is_causal:
            return False
        if self.bias_k is not None or self.add_zero_attn or not self._qkv_same_embed_dim:
            return False
        if self.training and self.dropout > 0.0:
            return False
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            return False
        if not _ferrite_can_run(query) or query.dtype != self.in_proj_weight.dtype:
            return False
        if is_causal and query.shape[0 if not self.batch_first else 1] != key.shape[0 if not self.batch_first else 1]:
            return False
        return True

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask=None,
        need_weights: bool = True,
        attn_mask=None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        if not self._ferrite_fits(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
            return super().forward(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal,
            )
        if not self.batch_first:  # [S, B, E] -> [B, S, E]
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        e, h = self.embed_dim, self.num_heads
        d = e // h
        w, b = self.in_proj_weight, self.in_proj_bias
        if query is key and key is value:  # self-attention: one GEMM for q, k and v
            qkv = _ops.linear(query, w, b)
            bsz, s = qkv.shape[:2]
            qkv = qkv.view(bsz, s, 3, h, d)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            bw = (None, None, None) if b is None else b.split(e)
            q, k, v = (
                _ops.linear(t, wi, bi).unflatten(-1, (h, d))
                for t, wi, bi in zip((query, key, value), w.split(e), bw)
            )
        o = _attention.flash_attn_func(q, k, v, causal=bool(is_causal))
        out = _ops.linear(o.flatten(-2), self.out_proj.weight, self.out_proj.bias)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, None


class MLP(torch.nn.Module):
    """``fc2(activation(fc1(x)))`` through ``ferrite.mlp`` (``fc1``, ``fc2``: ``torch.nn.Linear``,
    so the ``state_dict`` is that of the same two layers in torch). The backward runs in the
    chain form: fc2's dX GEMM forms fc1's pre-activation gradient and bias gradient in its
    epilogue. An input ferrite cannot run falls back to torch."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        out: Optional[int] = None,
        activation: str = "gelu_tanh",
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if _ops._activation("ferrite.nn.MLP", activation) == "none":
            _ops._fail("ferrite.nn.MLP", "activation", "'relu', 'gelu', 'gelu_tanh' or 'silu'", repr(activation))
        self.activation = activation
        self.fc1 = torch.nn.Linear(dim, hidden, bias=bias, device=device, dtype=dtype)
        self.fc2 = torch.nn.Linear(hidden, dim if out is None else out, bias=bias, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        if not _ferrite_can_run(x, matmul=True) or x.dtype != self.fc1.weight.dtype:
            h = _ops._torch_act(self.fc1(x), _ops._ACTIVATIONS[self.activation])
            return self.fc2(h)
        return _ops.mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, self.activation)


class SwiGLU(torch.nn.Module):
    """``down(silu(x·W_gateᵀ) * (x·W_upᵀ))``: the gate and up projections as one GEMM
    (``gate_up`` is ``[2·hidden, dim]``, gate rows first), ferrite's fused SwiGLU, then ``down``."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.gate_up = torch.nn.Linear(dim, 2 * hidden, bias=bias, device=device, dtype=dtype)
        self.down = torch.nn.Linear(hidden, dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        h = _ops.linear(x, self.gate_up.weight, self.gate_up.bias)
        return _ops.linear(_fused.swiglu(h), self.down.weight, self.down.bias)


class MoE(torch.nn.Module):
    """A mixture-of-experts layer with SwiGLU (or GEGLU) experts, as ``ferrite.moe``: router
    ``[experts, dim]``, ``w_up`` ``[experts, dim, 2·hidden]`` (gate columns first), ``w_down``
    ``[experts, hidden, dim]``. ``forward`` returns the output and keeps the step's auxiliary loss
    (load balancing + z-loss, with the configured coefficients) in ``self.aux_loss``: add it to the
    training loss. Dropless unless ``capacity_factor`` is given."""

    def __init__(
        self, dim: int, hidden: int, experts: int, top_k: int, score: str = "softmax", renormalize: bool = True,
        groups: int = 1, topk_groups: int = 1, routed_scale: float = 1.0, capacity_factor: Optional[float] = None,
        aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0, activation: str = "silu", device=None, dtype=None,
    ):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.router = torch.nn.Parameter(torch.empty(experts, dim, **kw))
        self.w_up = torch.nn.Parameter(torch.empty(experts, dim, 2 * hidden, **kw))
        self.w_down = torch.nn.Parameter(torch.empty(experts, hidden, dim, **kw))
        self.cfg = dict(top_k=top_k, score=score, renormalize=renormalize, groups=groups, topk_groups=topk_groups,
                        routed_scale=routed_scale, capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef,
                        z_loss_coef=z_loss_coef, activation=activation)
        self.aux_loss: Optional[Tensor] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default bounds: 1/sqrt(fan_in) for the router and both projections.
        for p, fan_in in ((self.router, self.router.shape[1]), (self.w_up, self.w_up.shape[1]), (self.w_down, self.w_down.shape[1])):
            bound = fan_in ** -0.5
            torch.nn.init.uniform_(p, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        out, self.aux_loss = _moe.moe(x, self.router, self.w_up, self.w_down, **self.cfg)
        return out


class CausalSelfAttention(torch.nn.Module):
    """Causal multi-head self-attention on ``[B, S, dim]``: fused QKV projection, ferrite's flash
    attention (``kv_heads`` < ``heads`` for GQA/MQA, ``window`` for a sliding window of that many
    past keys), output projection."""

    def __init__(
        self,
        dim: int,
        heads: int,
        kv_heads: int = None,
        window: int = -1,
        bias: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        if dim % heads != 0 or heads % kv_heads != 0:
            raise ValueError(
                f"ferrite.nn.CausalSelfAttention: expected heads dividing dim and kv_heads dividing heads, "
                f"got dim={dim}, heads={heads}, kv_heads={kv_heads}"
            )
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, dim // heads, window
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=bias, device=device, dtype=dtype)
        self.proj = torch.nn.Linear(dim, dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        h, hk, d = self.heads, self.kv_heads, self.head_dim
        qkv = _ops.linear(x, self.qkv.weight, self.qkv.bias)
        q, k, v = qkv.split([h * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(b, s, h, d), k.view(b, s, hk, d), v.view(b, s, hk, d)
        o = _attention.flash_attn_func(q, k, v, causal=True, window_size=(self.window, -1))
        return _ops.linear(o.reshape(b, s, h * d), self.proj.weight, self.proj.bias)


_SWAPS = {
    torch.nn.Linear: Linear,
    torch.nn.LayerNorm: LayerNorm,
    torch.nn.RMSNorm: RMSNorm,
    torch.nn.MultiheadAttention: MultiheadAttention,
}


def optimize(
    model: torch.nn.Module,
    *,
    linear: bool = True,
    norms: bool = True,
    attention: bool = True,
    loss: bool = True,
) -> List[Tuple[str, str, str]]:
    """Swaps matching modules of ``model`` (itself included) for ferrite's, in place.

    Returns ``[(qualified name, old class, new class), ...]`` for every module swapped, in
    ``named_modules()`` order; everything else is untouched. A Hugging Face ``transformers`` model
    is also patched by :func:`ferrite.hf.patch` (attention function, Llama-family attention with
    rotary, RMSNorm, the causal-LM loss); its entries follow, with ``"kept: why"`` as the new
    class of what it leaves to the model.
    """
    kinds = set()
    if linear:
        kinds.add(torch.nn.Linear)
    if norms:
        kinds.update((torch.nn.LayerNorm, torch.nn.RMSNorm))
    if attention:
        kinds.add(torch.nn.MultiheadAttention)
    swapped = []
    for name, mod in model.named_modules():
        cls = type(mod)
        if cls in kinds:
            new = _SWAPS[cls]
            mod.__class__ = new
            swapped.append((name, f"{cls.__module__}.{cls.__qualname__}", f"ferrite.nn.{new.__name__}"))
    from . import hf

    if hf.is_hf_model(model):
        swapped += hf.patch(model, linear=linear, norms=norms, attention=attention, loss=loss)
    return swapped
