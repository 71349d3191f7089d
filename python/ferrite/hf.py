"""Hugging Face ``transformers`` models on ferrite's kernels, patched in place by
``ferrite.optimize(model)`` (this module is imported only when a model from ``transformers`` is
given; ``transformers`` is not a dependency of ferrite).

What is swapped, and when it runs ferrite (anything else runs the model's own code, per call):

- **Attention** (every model that dispatches through ``ALL_ATTENTION_FUNCTIONS``: GPT-2, Llama,
  Mistral, Qwen2, ...): ``config._attn_implementation = "ferrite"`` — ferrite's flash attention
  (causal, GQA, sliding window) when the model's mask is purely causal (no padding: the mask
  function, SDPA's, then returns None) and no attention dropout is active; otherwise SDPA with
  the mask, exactly as ``"sdpa"`` would run. Decode steps against the model's KV cache (one new
  token) run SDPA too.
- **Decoder models** (GPT-2, Llama, Mistral, Qwen2): a forward given neither a padding mask, nor
  position ids, nor cached tokens makes its own positions (an ``arange``), so its mask is purely
  causal and none is built (``ferrite_mask``). ``transformers``' own test for that reads the
  positions' values to rule out packed sequences, which a ``torch.compile`` trace cannot: a
  compiled model would otherwise carry a ``[B, 1, S, S]`` mask into SDPA. Positions given by
  the caller keep the model's mask (they may describe packed sequences).
- **Llama-family attention modules** (Llama, Mistral, Qwen2): the forward runs q/k/v projections
  in ``[B, S, H, D]``, ferrite's rotary on q and k (the model's own cos/sin tables: any rope
  scaling the model computes is kept) and flash attention, without the transposes; an empty
  ``DynamicCache`` (a plain call with the config's ``use_cache=True``) receives the layer's keys
  and values afterwards; with cached tokens, a padding mask, per-sequence position ids or
  dropout it runs the original forward.
- **RMSNorm** (Llama, Mistral, Qwen2): ``ferrite.rms_norm``.
- **The causal-LM loss**: ``ferrite.cross_entropy`` on the logits in their own dtype (the model's
  loss upcasts the whole logits tensor to float32 first), float32 loss, the labels shifted as the
  model does, ``num_items_in_batch`` honoured.
- **GPT-2's ``Conv1D`` projections**: ``ferrite.linear``. A ``Conv1D`` weight is ``[in, out]``;
  its storage is re-laid in place as ``[out, in]`` rows (the parameter object, its shape and
  values stay; its strides become ``(1, in)``), so ``weight.t()`` is the row-major ``[out, in]``
  operand ferrite's GEMMs take, with no copy per call, and the weight gradient arrives in the
  parameter's own layout. ``save_pretrained`` writes contiguous tensors as before.
- **GPT-2's MLP**: ``ferrite.mlp`` — bias and GELU (``gelu_new``'s tanh form; also exact GELU,
  ReLU, SiLU) in the first GEMM's epilogue, the chain-form backward. The model's own ``gelu_new``
  is a Python formula: seven elementwise passes forward over the ``[tokens, 4·hidden]`` tensor.
  Other activations: the original forward.
- **GPT-2's self-attention**: the QKV projection into one ``[B, S, 3, H, D]`` tensor,
  ``flash_attn_qkvpacked_func`` on it (its backward writes one packed gradient: no
  split/select gradients and zero fills), the output projection; an empty ``DynamicCache``
  receives the keys and values (views of the packed tensor). With cached tokens, a mask,
  cross-attention or active attention dropout it runs the original forward.
- **GPT-2's blocks**: the attention's residual add and ``ln_2`` as one ``ferrite.add_layer_norm``
  (one read of each stream, the normed output and the new residual written together); with
  cross-attention inputs, the original forward.
- **The causal LM's output projection**: ``ferrite.linear_rows`` — for a vocabulary whose rows are
  not a multiple of 16 bytes (GPT-2's 50257), ``logits`` is a view with padded rows (values as
  before; ``.contiguous()`` packs them), and the loss writes its gradient in the same rows: the
  classifier's GEMMs run without copying the logits.
- ``torch.nn.Linear``/``LayerNorm`` inside the model: as for any model (``ferrite.nn``).

Not swapped, reported: attention modules of other families (they still get the attention
function above), and GPT-2 MLPs with other activations.
"""

from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _attention, _fused, _ops, _rotary

_REGISTERED = False
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}
# transformers' activation modules by class name -> ferrite's epilogue activation.
_ACTS = {
    "NewGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "GELUActivation": "gelu",
    "ReLU": "relu",
    "SiLU": "silu",
    "SiLUActivation": "silu",
}
_ATTENTIONS = {"LlamaAttention", "MistralAttention", "Qwen2Attention"}
_DECODER_MODELS = {"GPT2Model", "LlamaModel", "MistralModel", "Qwen2Model"}


def is_hf_model(model: torch.nn.Module) -> bool:
    return any(type(m).__module__.startswith("transformers.") for m in model.modules())


def _sdpa_fallback():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _window(module) -> Tuple[int, int]:
    w = getattr(module, "sliding_window", None)
    return (int(w) - 1, 0) if w else (-1, -1)


def ferrite_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """The ``"ferrite"`` attention function: q/k/v ``[B, H, S, D]`` as HF passes them; returns
    (``[B, S, H, D]``, None)."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    sq, sk = query.shape[2], key.shape[2]
    # One new token against the model's own KV cache (generate's decode steps): SDPA. ferrite's
    # decode path is the paged cache (`ferrite.paged_decode`); through this function a token cost
    # more host time than SDPA (GPT-2 716 vs 992 tokens/s, H100, README) and gains nothing.
    decode = sq == 1 and sk > 1
    if attention_mask is not None or dropout > 0.0 or decode or (causal and sq != sk) or query.dtype == torch.float64:
        return _sdpa_fallback()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # views: [B, S, H, D]
    wl, wr = _window(module)
    o = _attention.flash_attn_func(q, k, v, softmax_scale=scaling, causal=bool(causal), window_size=(wl, wr))
    return o, None


# True while a patched decoder model runs a forward whose positions it makes itself: no padding
# mask, no position ids and no cached tokens were given, so its mask is exactly causal. Set and
# cleared by _DecoderModel.forward (also inside a torch.compile trace: dynamo replays it).
_OWN_CAUSAL = False


def ferrite_mask(*args, **kwargs):
    """The ``"ferrite"`` mask function: None (ferrite's attention runs causal, no mask tensor)
    inside a forward whose positions the model made itself, for full-attention layers; SDPA's
    mask otherwise. ``transformers``' own skip of a causal mask reads the positions' values (to
    rule out packed sequences), which a ``torch.compile`` trace cannot, so a compiled model would
    materialise a ``[B, 1, S, S]`` mask and fall back to SDPA with it; positions the model made
    itself (an ``arange``) are never packed."""
    if _OWN_CAUSAL and kwargs.get("attention_mask") is None and kwargs.get("local_size") is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("ferrite", ferrite_attention_forward)
    AttentionMaskInterface.register("ferrite", ferrite_mask)
    _REGISTERED = True


def _fresh_cache(cache, layer_idx) -> bool:
    """cache is None, or a ``DynamicCache`` holding nothing yet for this layer (a prefill with
    ``use_cache``, as a plain ``model(input_ids, labels=...)`` call makes one): the layer's keys
    and values are then this call's own, appended after the attention."""
    if cache is None:
        return True
    return type(cache).__name__ == "DynamicCache" and cache.get_seq_length(layer_idx) == 0


def _own_positions(args, kwargs) -> bool:
    """A decoder model's forward called with nothing that would make its mask other than causal:
    input ids (or embeddings) only, no padding mask, no position ids, no cached tokens, no
    encoder states."""
    if len(args) > 1:
        return False
    if any(kwargs.get(k) is not None for k in ("attention_mask", "position_ids", "encoder_hidden_states")):
        return False
    return _fresh_cache(kwargs.get("cache", kwargs.get("past_key_values")), 0)


class _DecoderModel(torch.nn.Module):
    """A decoder model (GPT-2, Llama, Mistral, Qwen2) whose forward marks the calls that make
    their own positions, for ``ferrite_mask``; everything else is the model's own forward."""

    def forward(self, *args, **kwargs):
        global _OWN_CAUSAL
        if _OWN_CAUSAL or self.config._attn_implementation != "ferrite" or not _own_positions(args, kwargs):
            return self._ferrite_base.forward(self, *args, **kwargs)
        _OWN_CAUSAL = True
        try:
            return self._ferrite_base.forward(self, *args, **kwargs)
        finally:
            _OWN_CAUSAL = False


class _RMSNorm(torch.nn.Module):
    """A Llama-family RMSNorm (``weight``, ``variance_epsilon``) on ``ferrite.rms_norm``."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        w = self.weight
        if hidden_states.dtype != w.dtype or hidden_states.dtype == torch.float64:
            return self._ferrite_base.forward(self, hidden_states)
        return _ops.rms_norm(hidden_states, [hidden_states.shape[-1]], w, self.variance_epsilon)


class _LlamaAttention(torch.nn.Module):
    """Llama/Mistral/Qwen2 attention: projections, ferrite's rotary and flash attention in
    ``[B, S, H, D]``; the original forward whenever its extras are in use."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        fast = (
            attention_mask is None
            and _fresh_cache(cache, self.layer_idx)
            and position_embeddings is not None
            and position_embeddings[0].shape[0] == 1
            and not (self.training and self.attention_dropout > 0.0)
            and hidden_states.dtype in (torch.float32, torch.float16, torch.bfloat16)
        )
        if not fast:
            return self._ferrite_base.forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        b, s, _ = hidden_states.shape
        d = self.head_dim
        q = self.q_proj(hidden_states).view(b, s, -1, d)
        k = self.k_proj(hidden_states).view(b, s, -1, d)
        v = self.v_proj(hidden_states).view(b, s, -1, d)
        cos, sin = position_embeddings
        # The model's tables repeat the R/2 angles twice (cat(freqs, freqs)): the first half is
        # the [S, R/2] table rotary takes.
        c = cos[0, :, : d // 2].to(q.dtype).contiguous()
        sn = sin[0, :, : d // 2].to(q.dtype).contiguous()
        q = _rotary.apply_rotary_emb(q, c, sn)
        k = _rotary.apply_rotary_emb(k, c, sn)
        o = _attention.flash_attn_func(q, k, v, softmax_scale=self.scaling, causal=True, window_size=_window(self))
        if cache is not None:
            cache.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx)
        return self.o_proj(o.reshape(b, s, -1)), None


def _is_conv1d(mod) -> bool:
    return type(mod).__name__ == "Conv1D" and type(mod).__module__.startswith("transformers.")


def _rows_out_in(conv) -> None:
    """Re-lays a ``Conv1D`` weight ``[in, out]`` in place so that ``weight.t()`` is a row-major
    ``[out, in]`` tensor (strides ``(1, in)``); same parameter, shape and values."""
    w = conv.weight
    if w.dim() == 2 and w.shape[0] > 1 and w.shape[1] > 1 and w.stride() != (1, w.shape[0]):
        with torch.no_grad():
            w.data = w.data.t().contiguous().t()


def _fast_dtype(x: Tensor, w: Tensor) -> bool:
    return x.dtype == w.dtype and x.dtype in (torch.float32, torch.float16, torch.bfloat16) and x.device == w.device


class _Conv1D(torch.nn.Module):
    """GPT-2's ``Conv1D`` (``x @ weight + bias``, weight ``[in, out]``) on ``ferrite.linear``."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if not _fast_dtype(x, w) or w.stride() != (1, w.shape[0]):
            return self._ferrite_base.forward(self, x)
        return _ops.linear(x, w.t(), self.bias)


class _GPT2MLP(torch.nn.Module):
    """GPT-2's MLP on ``ferrite.mlp`` (bias + activation in the first GEMM's epilogue)."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        fc, proj = self.c_fc, self.c_proj
        act = _ACTS.get(type(self.act).__name__)
        laid = all(c.weight.stride() == (1, c.weight.shape[0]) for c in (fc, proj))
        if act is None or not laid or not _fast_dtype(hidden_states, fc.weight):
            return self._ferrite_base.forward(self, hidden_states)
        h = _ops.mlp(hidden_states, fc.weight.t(), fc.bias, proj.weight.t(), proj.bias, activation=act)
        return self.dropout(h)


class _GPT2Attention(torch.nn.Module):
    """GPT-2's self-attention: one QKV projection viewed ``[B, S, 3, H, D]``, packed flash
    attention (one packed gradient), the output projection; the original forward otherwise."""

    def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)  # the name before transformers 5.24
        w = self.c_attn.weight
        fast = (
            _fresh_cache(cache, self.layer_idx)
            and attention_mask is None
            and encoder_hidden_states is None
            and not kwargs.get("output_attentions")
            and not self.is_cross_attention
            and not (self.training and self.attn_dropout.p > 0.0)
            and not (self.reorder_and_upcast_attn and self.config._attn_implementation == "eager")
            and hidden_states.dim() == 3
            and w.stride() == (1, w.shape[0])
            and self.c_proj.weight.stride() == (1, self.c_proj.weight.shape[0])
            and _fast_dtype(hidden_states, w)
        )
        if not fast:
            return self._ferrite_base.forward(
                self, hidden_states, cache, attention_mask, encoder_hidden_states, encoder_attention_mask, **kwargs
            )
        b, s, c = hidden_states.shape
        qkv = _ops.linear(hidden_states, w.t(), self.c_attn.bias).view(b, s, 3, self.num_heads, self.head_dim)
        o = _attention.flash_attn_qkvpacked_func(qkv, softmax_scale=self.scaling, causal=True)
        if cache is not None:
            cache.update(qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2), self.layer_idx)
        o = _ops.linear(o.reshape(b, s, c), self.c_proj.weight.t(), self.c_proj.bias)
        return self.resid_dropout(o), None


class _GPT2Block(torch.nn.Module):
    """GPT-2's block with the attention's residual add fused into ``ln_2``."""

    def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, **kwargs):
        cache = kwargs.pop("past_key_values", cache)  # the name before transformers 5.24
        ln = self.ln_2
        if (
            encoder_hidden_states is not None
            or ln.weight is None
            or ln.bias is None
            or not _fast_dtype(hidden_states, ln.weight)
        ):
            return self._ferrite_base.forward(
                self, hidden_states, cache, attention_mask, encoder_hidden_states, encoder_attention_mask, use_cache,
                **kwargs,
            )
        attn, _ = self.attn(self.ln_1(hidden_states), cache, attention_mask, use_cache=use_cache, **kwargs)
        h, hidden = _ops.add_layer_norm(attn, hidden_states, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        return hidden + self.mlp(h)


class _LMHead(torch.nn.Module):
    """A causal LM's output projection on ``ferrite.linear_rows``: a vocabulary whose rows are not
    a multiple of 16 bytes (GPT-2's 50257) gives logits in padded rows (a row-strided view), which
    the loss reads and writes its gradient into as they are — no copy of the logits out of the
    forward GEMM's rows or into the backward's."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if not _fast_dtype(x, w):
            return self._ferrite_base.forward(self, x)
        return _ops.linear_rows(x, w, self.bias)


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
    """``transformers``' ``ForCausalLMLoss`` on ``ferrite.cross_entropy``: the logits stay in their
    dtype (no float32 copy), the loss is float32."""
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    x = logits.reshape(-1, vocab_size)
    t = shift_labels.reshape(-1).to(x.device)
    if num_items_in_batch is None:
        return _fused.cross_entropy(x, t, ignore_index=ignore_index, float_loss=True)
    loss = _fused.cross_entropy(x, t, ignore_index=ignore_index, reduction="sum", float_loss=True)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


_CLASSES = {}


def _swap(mod: torch.nn.Module, mixin: type, name: str = "") -> str:
    """Changes mod's class to a subclass whose forward is the mixin's (parameters, buffers and
    hooks stay the same objects)."""
    base = type(mod)
    cls = _CLASSES.get((base, mixin))
    if cls is None:
        cls = type(f"Ferrite{name or base.__name__}", (mixin, base), {"_ferrite_base": base, "forward": mixin.forward})
        _CLASSES[(base, mixin)] = cls
    mod.__class__ = cls
    return f"ferrite.hf.{cls.__name__}"


def patch(
    model: torch.nn.Module, *, linear: bool = True, norms: bool = True, attention: bool = True, loss: bool = True
) -> List[Tuple[str, str, str]]:
    """The ``transformers`` part of ``ferrite.optimize``: returns (name, old, new) per change and
    (name, class, "kept: why") for what it leaves to the model."""
    _register()
    out = []
    for name, mod in model.named_modules():
        cname = type(mod).__name__
        qual = f"{type(mod).__module__}.{cname}"
        if getattr(mod, "_ferrite_base", None) is not None:
            continue
        if attention and cname in _DECODER_MODELS:
            out.append((name, qual, _swap(mod, _DecoderModel)))
        elif norms and cname in _NORMS:
            out.append((name, qual, _swap(mod, _RMSNorm)))
        elif attention and cname in _ATTENTIONS:
            out.append((name, qual, _swap(mod, _LlamaAttention)))
        elif linear and _is_conv1d(mod):
            _rows_out_in(mod)
            out.append((name, qual, _swap(mod, _Conv1D)))
        elif linear and cname == "GPT2MLP":
            if type(mod.act).__name__ in _ACTS:
                for c in (mod.c_fc, mod.c_proj):
                    _rows_out_in(c)
                out.append((name, qual, _swap(mod, _GPT2MLP)))
            else:
                out.append((name, qual, f"kept: activation {type(mod.act).__name__}"))
        elif norms and cname == "GPT2Block" and isinstance(mod.ln_2, torch.nn.LayerNorm):
            out.append((name, qual, _swap(mod, _GPT2Block)))
        elif attention and cname == "GPT2Attention" and not mod.is_cross_attention:
            for c in (mod.c_attn, mod.c_proj):
                _rows_out_in(c)
            out.append((name, qual, _swap(mod, _GPT2Attention)))
    if attention:
        configs = [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")]
        seen = set()
        for c in configs:
            if id(c) in seen:
                continue
            seen.add(id(c))
            old = c._attn_implementation
            if old != "ferrite":
                c._attn_implementation = "ferrite"
                out.append(("config", f"_attn_implementation={old}", "_attn_implementation=ferrite"))
    lm = type(model).__name__
    causal_lm = lm.endswith("ForCausalLM") or lm == "GPT2LMHeadModel"
    head = model.get_output_embeddings() if causal_lm and hasattr(model, "get_output_embeddings") else None
    if linear and isinstance(head, torch.nn.Linear) and getattr(head, "_ferrite_base", None) is None:
        name = next(n for n, m in model.named_modules() if m is head)
        out.append((name, f"{type(head).__module__}.{type(head).__name__}", _swap(head, _LMHead, "LMHead")))
    already = getattr(model, "_loss_function", None) is causal_lm_loss
    if loss and not already and causal_lm:
        model.loss_function = causal_lm_loss
        out.append(("loss_function", "transformers ForCausalLMLoss", "ferrite.hf.causal_lm_loss"))
    return out
