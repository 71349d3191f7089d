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



def _attention_ops(gm):
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    return [n for n in names if "scaled_dot_product" in n], [n for n in names if "ferrite.attention" in n or "ferrite.flash" in n]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_compiled_model_runs_ferrite_attention_without_a_mask(name):
    """Under torch.compile transformers cannot rule out packed sequences from the positions'
    values, and would build a [B, 1, S, S] mask (then SDPA runs with it). A forward whose positions
    the model makes itself has none to rule out: its traced graph holds ferrite's attention once
    per layer and no SDPA."""
    ref, m, _ = pair(MODELS[name], "cpu", torch.float32)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.randint(0, V, (2, 16))
    f = torch.compile(lambda ids: m(input_ids=ids, labels=ids).loss, backend=backend, fullgraph=True)
    torch.testing.assert_close(f(ids), ref(input_ids=ids, labels=ids).loss, atol=1e-4, rtol=1e-4)
    assert len(graphs) == 1
    sdpa, ours = _attention_ops(graphs[0])
    assert not sdpa and len(ours) == 2, (sdpa, ours)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("use_cache", [None, True, False])
def test_plain_call_takes_the_fast_attention_and_fills_the_cache(name, use_cache):
    """``model(input_ids, labels=...)`` as users write it makes a KV cache by default (GPT-2's and
    Llama's configs have ``use_cache=True``): the layers still run ferrite's attention on their
    own projections (GPT-2: the packed path), and the cache holds the same keys and values as the
    unpatched model's."""
    from ferrite import _attention

    ref, m, _ = pair(MODELS[name], "cpu", torch.float32)
    fn = "flash_attn_qkvpacked_func" if name == "gpt2" else "flash_attn_func"
    calls = []
    orig = getattr(_attention, fn)

    def counted(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    ids = torch.randint(0, V, (2, 13))
    kw = {} if use_cache is None else {"use_cache": use_cache}
    setattr(_attention, fn, counted)
    try:
        b = m(input_ids=ids, labels=ids, **kw)
    finally:
        setattr(_attention, fn, orig)
    a = ref(input_ids=ids, labels=ids, **kw)
    assert len(calls) == 2
    torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
    if use_cache is False:
        assert b.past_key_values is None
        return
    ca, cb = a.past_key_values, b.past_key_values
    assert cb.get_seq_length() == 13
    for la, lb in zip(ca.layers, cb.layers):
        torch.testing.assert_close(lb.keys, la.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lb.values, la.values, atol=1e-5, rtol=1e-5)
    # the cache continues a generation exactly as the model's own
    nxt = torch.randint(0, V, (2, 1))
    with torch.no_grad():
        ya = ref(input_ids=nxt, past_key_values=ca).logits
        yb = m(input_ids=nxt, past_key_values=cb).logits
    torch.testing.assert_close(yb, ya, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("compiled", [False, True])
def test_packed_position_ids_keep_the_models_mask(name, compiled):
    """Position ids given by the caller may describe packed sequences (positions restart inside
    a row): the patched model keeps transformers' mask for them, eager and compiled."""
    ref, m, _ = pair(MODELS[name], "cpu", torch.float32)
    ids = torch.randint(0, V, (1, 17))
    pos = torch.cat([torch.arange(7), torch.arange(10)])[None]

    def run(model):
        f = lambda: model(input_ids=ids, position_ids=pos, use_cache=False).logits  # noqa: E731
        return torch.compile(f)() if compiled else f()

    torch.testing.assert_close(run(m), run(ref), atol=1e-4, rtol=1e-4)
    # the second sequence does not see the first: its logits differ from a causal run over both
    causal = m(input_ids=ids, use_cache=False).logits
    assert (causal[0, 7:] - run(m)[0, 7:]).abs().max() > 1e-3
