"""``ferrite.optimize`` on Hugging Face ``transformers`` models built from small configs (no
download): outputs, losses and every parameter's gradient against the unpatched model; the
fallbacks (padding mask, KV-cache generation) give the model's own results. Skipped without
``transformers`` (CI installs the pinned version: scripts/python-ci.sh)."""

import copy

import pytest
import torch

import ferrite
from conftest import HAS_CUDA

transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional test dependency)")

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
V = 131


def llama(kind="llama"):
    common = dict(
        vocab_size=V, hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.0,
    )
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=8, **common))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))


def gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=V, n_embd=128, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


MODELS = {"gpt2": gpt2, "llama": llama, "mistral": lambda: llama("mistral"), "qwen2": lambda: llama("qwen2")}


def pair(make, device, dtype):
    torch.manual_seed(0)
    ref = make().to(device=device, dtype=dtype)
    ref.config._attn_implementation = "sdpa"
    m = copy.deepcopy(ref)
    report = ferrite.optimize(m)
    return ref, m, report


def step(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, **kw)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(MODELS))
def test_patched_model_matches_outputs_and_gradients(device, name):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ref, m, report = pair(MODELS[name], device, dtype)
    news = {new for _, _, new in report}
    assert "_attn_implementation=ferrite" in news and "ferrite.hf.causal_lm_loss" in news
    if name != "gpt2":
        assert any("RMSNorm" in n for n in news) and any(n.endswith("Attention") for n in news)
    else:
        for cls in ("FerriteConv1D", "FerriteGPT2MLP", "FerriteGPT2Attention", "FerriteGPT2Block"):
            assert f"ferrite.hf.{cls}" in news, (cls, report)
    ids = torch.randint(0, V, (2, 37), device=device)  # 37: longer than Mistral's window of 8
    a, ga = step(ref, ids)
    b, gb = step(m, ids)
    assert b.loss.dtype == torch.float32
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(b.logits.float(), a.logits.float(), **tol)
    torch.testing.assert_close(b.loss, a.loss.float(), **tol)
    assert ga.keys() == gb.keys() and len(ga) > 0
    for k in ga:
        scale = ga[k].float().abs().max().item() + 1e-6
        err = (gb[k].float() - ga[k].float()).abs().max().item() / scale
        assert err < (1e-3 if dtype == torch.float32 else 8e-2), f"{k}: {err}"


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_padding_mask_and_generation_fall_back_to_the_models_own_path(name):
    ref, m, _ = pair(MODELS[name], "cpu", torch.float32)
    ref.eval(), m.eval()
    ids = torch.randint(1, V, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on the second sequence
    with torch.no_grad():
        a = ref(input_ids=ids, attention_mask=mask).logits
        b = m(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(b[mask.bool()], a[mask.bool()], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        ga = ref.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
        gb = m.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ga, gb)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_optimize_is_idempotent_and_keeps_parameters(name):
    torch.manual_seed(0)
    m = MODELS[name]()
    params = {n: p for n, p in m.named_parameters()}
    values = {n: p.detach().clone() for n, p in m.named_parameters()}
    first = ferrite.optimize(m)
    assert len(first) > 0
    again = ferrite.optimize(m)
    assert not [r for r in again if not r[2].startswith("kept")]
    assert all(p is params[n] for n, p in m.named_parameters())
    assert all(torch.equal(p, values[n]) for n, p in m.named_parameters())


def test_gpt2_conv1d_weights_train_in_their_new_layout():
    """The re-laid Conv1D weights: gradients arrive in the parameter's layout (no copy), an
    optimizer steps the same values as on the unpatched model (SGD with momentum: Adam would
    turn the key bias's rounding-noise gradient, zero in exact arithmetic, into ±lr steps), and
    AdamW's state takes the parameter's layout."""
    ref, m, _ = pair(MODELS["gpt2"], "cpu", torch.float32)
    w = m.transformer.h[0].mlp.c_fc.weight
    assert w.shape == ref.transformer.h[0].mlp.c_fc.weight.shape and w.stride() == (1, w.shape[0])
    ids = torch.randint(0, V, (2, 19))
    opts = [torch.optim.SGD(x.parameters(), lr=1e-1, momentum=0.9) for x in (ref, m)]
    for _ in range(2):
        for x, o in zip((ref, m), opts):
            step(x, ids)
            o.step()
    assert w.grad.stride() == w.stride()
    for (n, a), (_, b) in zip(ref.named_parameters(), m.named_parameters()):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-3, msg=n)
    adam = torch.optim.AdamW(m.parameters(), lr=1e-3)
    step(m, ids)
    adam.step()
    assert adam.state[w]["exp_avg"].stride() == w.stride() and torch.isfinite(w).all()


def test_gpt2_unsupported_activation_is_kept_and_reported():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=1, n_head=2, n_positions=32, activation_function="quick_gelu")
    m = transformers.GPT2LMHeadModel(cfg)
    report = ferrite.optimize(m)
    kept = [r for r in report if r[0].endswith("mlp")]
    assert kept and kept[0][2].startswith("kept: activation"), report


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_patched_model_compiles_without_graph_breaks(name):
    ref, m, _ = pair(MODELS[name], "cpu", torch.float32)
    ids = torch.randint(0, V, (2, 16))
    f = torch.compile(lambda ids: m(input_ids=ids, labels=ids).loss, fullgraph=True)
    torch.testing.assert_close(f(ids), ref(input_ids=ids, labels=ids).loss, atol=1e-4, rtol=1e-4)

