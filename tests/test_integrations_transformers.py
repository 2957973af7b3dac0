"""splitkv.integrations.transformers on the CPU: which calls reach splitkv.decode and with what, and
that the models it serves give eager attention's logits.

splitkv.decode is replaced by a float64 stand-in written from its contract (below), and the
integration is told to take float32 CPU tensors as it takes bf16/fp16 CUDA ones, so that tiny
randomly initialised models (built from configs, no downloads) run the integration's real routing
end to end: Llama-style GQA, Qwen2-style with 7 query heads per K/V head, Mistral-style sliding
window, Gemma-2-style (logit soft-cap, sliding window, head_dim 256) and gpt-oss-style (sinks,
sliding window). Prompts are longer than the windows, so sliding layers run with caches that keep
only their last W - 1 tokens.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma2Config,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

import splitkv
from splitkv.integrations import transformers as integration

VOCAB = 128
WINDOW = 8
PROMPT = 13  # longer than the window
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # float32 model against float32 eager

_COMMON = {"vocab_size": VOCAB, "num_hidden_layers": 2, "max_position_embeddings": 256}
CONFIGS = {
    "llama": lambda: LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
                                 head_dim=64, **_COMMON),
    "qwen2": lambda: Qwen2Config(hidden_size=128, intermediate_size=256, num_attention_heads=14, num_key_value_heads=2,
                                 head_dim=64, **_COMMON),
    "mistral": lambda: MistralConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                     num_key_value_heads=1, head_dim=128, sliding_window=WINDOW, **_COMMON),
    # A soft-cap small enough to change these small random scores (it moves the logits ~1e-2).
    "gemma2": lambda: Gemma2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=256, sliding_window=WINDOW, attn_logit_softcapping=0.05, **_COMMON),
    # Every expert on every token: no routing ties for rounding noise to flip.
    "gpt_oss": lambda: GptOssConfig(hidden_size=64, intermediate_size=64, num_attention_heads=8, num_key_value_heads=2,
                                    head_dim=64, sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=2,
                                    **{**_COMMON, "max_position_embeddings": 131072}),  # YaRN's own ratio
}


# ---- splitkv.decode's contract, in float64 --------------------------------------------------------------
def contract_decode(q, k, v, seq_lens, *, sm_scale=None, kv_layout="NHD", window_left=-1, logits_soft_cap=0.0,
                    sinks=None, out=None, lse=None, return_lse=False):
    """q [B, Hq, D] or [B, T, Hq, D]; k, v [B, L, Hkv, D] (NHD) or [B, Hkv, L, D] (HND, maybe a view
    cache[:, :, :L]); query t of a sequence of length n sits at n - T + t and sees the positions p
    with p <= n - T + t and, for window_left w >= 0, p >= n - T + t - w; a soft-cap c maps each
    scaled score s to c * tanh(s / c); sinks [Hq] float32 add exp(sink) to each head's denominator."""
    assert q.dtype == k.dtype == v.dtype and q.is_contiguous()
    assert out is None and lse is None
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    batch, tokens, qo_heads, head_dim = q4.shape
    assert kv_layout in ("NHD", "HND") and k.shape == v.shape
    if kv_layout == "HND":
        for t in (k, v):
            assert t.stride(3) == 1 and t.stride(2) == head_dim
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    else:
        assert k.is_contiguous() and v.is_contiguous()
    kv_heads = k.shape[2]
    assert head_dim in (64, 96, 128, 256) and qo_heads % kv_heads == 0 and 1 <= tokens <= 16
    lens = [int(n) for n in seq_lens]
    assert len(lens) == batch
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    if sinks is not None:
        assert sinks.dtype == torch.float32 and tuple(sinks.shape) == (qo_heads,)
    outs, lses = torch.zeros(batch, tokens, qo_heads, head_dim, dtype=torch.float64), []
    for b, n in enumerate(lens):
        assert tokens <= n <= k.shape[1]
        kb = k[b, :n].double().repeat_interleave(qo_heads // kv_heads, dim=1)  # [n, Hq, D]
        vb = v[b, :n].double().repeat_interleave(qo_heads // kv_heads, dim=1)
        s = torch.einsum("thd,nhd->htn", q4[b].double(), kb) * scale
        if logits_soft_cap:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        at = n - tokens + torch.arange(tokens)[:, None]
        pos = torch.arange(n)[None, :]
        seen = pos <= at
        if window_left >= 0:
            seen &= pos >= at - window_left
        s = s.masked_fill(~seen, -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(qo_heads, tokens, 1)], dim=-1)
        norm = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - norm[..., None])[..., :n]
        outs[b] = torch.einsum("htn,nhd->thd", p, vb)
        lses.append(norm.T)
    result = outs.to(q.dtype).reshape(q.shape)
    return (result, torch.stack(lses).float()) if return_lse else result


@pytest.fixture
def standin(monkeypatch):
    """splitkv.decode replaced by the contract, float32 CPU tensors taken, every call recorded: the
    stand-in's (in layer order within a forward pass) and the fallback's."""
    calls, fallbacks = [], []

    def decode(q, k, v, seq_lens, **kw):
        calls.append(SimpleNamespace(shape=tuple(q.shape), kv_shape=tuple(k.shape), seq_lens=[int(n) for n in seq_lens],
                                     has_sinks=kw.get("sinks") is not None, **kw))
        return contract_decode(q, k, v, seq_lens, **kw)

    fallback = integration._fallback

    def recorded_fallback(module, query, key, value, attention_mask, **kw):
        fallbacks.append(SimpleNamespace(layer=module.layer_idx, tokens=query.shape[2], length=key.shape[2]))
        return fallback(module, query, key, value, attention_mask, **kw)

    monkeypatch.setattr(splitkv, "decode", decode)
    monkeypatch.setattr(integration, "_fallback", recorded_fallback)
    monkeypatch.setattr(integration, "_DTYPES", (torch.float32,))
    monkeypatch.setattr(integration, "_DEVICE_TYPES", ("cpu",))
    integration.register()
    return SimpleNamespace(calls=calls, fallbacks=fallbacks)


def _model(name, implementation="splitkv", **overrides):
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()
    if name == "gpt_oss":  # sinks of a size that matters against ~20 keys (init gives about 0)
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    return model


def _sliding(model, layer: int) -> bool:
    types = getattr(model.config, "layer_types", None)
    if types is not None:
        return types[layer] == "sliding_attention"
    return getattr(model.config, "sliding_window", None) is not None


def _expected_call(model, layer: int, batch: int, tokens: int, seen: int, cropped: bool = True) -> dict:
    """What one layer's decode call of ``tokens`` new tokens after ``seen`` must pass splitkv;
    ``cropped``: the cache generate() makes, whose sliding layers keep their last W - 1 tokens."""
    attn = model.model.layers[layer].self_attn
    sliding = _sliding(model, layer)
    window = model.config.sliding_window if sliding else None
    # A sliding layer keeps its last W - 1 tokens: W - 1 + T keys once it has seen W.
    length = min(seen, window - 1) + tokens if cropped and sliding and seen >= window else seen + tokens
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    return {"shape": (batch, tokens, attn.config.num_attention_heads, attn.head_dim), "seq_lens": [length] * batch,
            "window_left": window - 1 if sliding else -1, "logits_soft_cap": softcap or 0.0, "kv_layout": "HND",
            "sm_scale": attn.scaling, "has_sinks": hasattr(attn, "sinks")}


def _check_calls(calls, model, batch: int, tokens: int, seen: int, cropped: bool = True) -> None:
    layers = model.config.num_hidden_layers
    assert len(calls) == layers
    for layer, call in enumerate(calls):
        want = _expected_call(model, layer, batch, tokens, seen, cropped)
        got = {key: getattr(call, key) for key in want}
        assert got == want, (layer, got, want)


# ---- registration ----------------------------------------------------------------------------------------
def test_register_makes_the_name_an_attention_and_a_mask_implementation():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert integration.register("splitkv-test") == "splitkv-test"
    assert AttentionInterface._global_mapping["splitkv-test"] is integration.attention_forward
    assert AttentionMaskInterface._global_mapping["splitkv-test"] is integration.mask
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"](), attn_implementation="splitkv-test")
    assert model.config._attn_implementation == "splitkv-test"
    model.set_attn_implementation("eager")
    model.set_attn_implementation("splitkv-test")
    assert model.config._attn_implementation == "splitkv-test"


def test_importing_splitkv_loads_neither_torch_nor_transformers():
    code = "import sys, splitkv; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


# ---- the window convention --------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [1, 2, 5, 8])
@pytest.mark.parametrize("tokens, seen", [(1, 20), (3, 20), (4, 2), (1, 4)])
@pytest.mark.parametrize("cropped", [True, False])
def test_a_sliding_window_of_w_tokens_is_window_left_w_minus_1(window, tokens, seen, cropped):
    """transformers' sliding-window mask of ``sliding_window = W`` is the contract's window_left =
    W - 1 over the cache's own positions, whether the cache keeps every token or, as its sliding
    layer does, the last W - 1 and then the new ones; the integration's mask function marks it so."""
    offset = max(seen - window + 1, 0) if cropped else 0
    length = seen + tokens - offset
    mask = sdpa_mask(batch_size=1, q_length=tokens, kv_length=length, q_offset=seen, kv_offset=offset,
                     mask_function=sliding_window_causal_mask_function(window), local_size=window,
                     allow_is_causal_skip=False)[0, 0]
    at = length - tokens + torch.arange(tokens)[:, None]
    pos = torch.arange(length)[None, :]
    assert torch.equal(mask, (pos <= at) & (pos >= at - (window - 1)))
    if not cropped and seen + tokens - 1 >= window:  # a window_left of W would see one key too many
        assert not torch.equal(mask, (pos <= at) & (pos >= at - window))
    marked = integration.mask(batch_size=1, q_length=tokens, kv_length=length, q_offset=seen, kv_offset=offset,
                              mask_function=sliding_window_causal_mask_function(window), local_size=window,
                              attention_mask=torch.ones(1, seen + tokens, dtype=torch.bool))
    if marked is not None:  # None: sdpa's own causal handling (one token, every key in the window)
        assert getattr(marked, integration._MARK) == window - 1
        assert torch.equal(marked[0, 0], mask)


def test_the_mask_function_marks_only_what_splitkv_computes():
    ones = torch.ones(2, 12, dtype=torch.bool)
    causal = {"batch_size": 2, "q_length": 3, "kv_length": 12, "q_offset": 9, "kv_offset": 0}
    assert getattr(integration.mask(**causal, attention_mask=ones), integration._MARK) == -1
    assert getattr(integration.mask(**causal, attention_mask=None), integration._MARK) == -1
    padded = ones.clone()
    padded[1, :2] = False  # left padding
    assert not hasattr(integration.mask(**causal, attention_mask=padded), integration._MARK)
    # Transformers' overlays and compiled static-cache steps say so with allow_is_causal_skip=False.
    assert not hasattr(integration.mask(**causal, attention_mask=ones, allow_is_causal_skip=False), integration._MARK)
    # Queries that are not the last positions (a static cache, keys past the filled ones).
    static = dict(causal, kv_length=20)
    assert not hasattr(integration.mask(**static, attention_mask=ones), integration._MARK)
    # Chunked attention passes a local_size too, with another mask function.
    from transformers.masking_utils import chunked_causal_mask_function

    chunked = integration.mask(**causal, attention_mask=ones, local_size=4,
                               mask_function=chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long)))
    assert not hasattr(chunked, integration._MARK)


# ---- whole models -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cropped", [True, False], ids=["generate-cache", "full-cache"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_teacher_forced_decode_steps_go_to_splitkv_and_match_eager(name, cropped, standin):
    """A prompt longer than the window through the fallback, then steps of 1, 3, 1, 4 and 16 new
    tokens through splitkv with the layer's window, soft-cap, sinks, lengths and scale; every logit
    as eager attention gives it over the whole sequence at once. With the cache generate() makes
    (sliding layers keep W - 1 tokens) and with one that keeps every token."""
    model = _model(name)
    chunks = [1, 3, 1, 4, 16, 1]
    batch = 2
    ids = torch.randint(0, VOCAB, (batch, PROMPT + sum(chunks)))
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(ids).logits
        model.set_attn_implementation("splitkv")
        cache = DynamicCache(config=model.config) if cropped else DynamicCache()
        got = [model(ids[:, :PROMPT], past_key_values=cache).logits]
        assert standin.calls == [] and [(f.tokens, f.length) for f in standin.fallbacks] == [(PROMPT, PROMPT)] * 2
        seen = PROMPT
        for tokens in chunks:
            del standin.calls[:]
            got.append(model(ids[:, seen:seen + tokens], past_key_values=cache).logits)
            _check_calls(standin.calls, model, batch, tokens, seen, cropped)
            seen += tokens
    assert len(standin.fallbacks) == 2  # the prefill's only
    torch.testing.assert_close(torch.cat(got, dim=1), want, **TOLERANCE)


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt_oss"])
def test_generate_decodes_through_splitkv_and_gives_eager_tokens(name, standin):
    """generate() passes a 2D attention_mask of ones: the mask function reads it and lets the steps
    through. Greedy tokens as eager's."""
    model = _model(name)
    ids = torch.randint(0, VOCAB, (2, PROMPT))
    new = 6
    with torch.no_grad():
        # An explicit mask of ones: generate() would read a random token equal to pad_token_id as padding.
        kw = {"attention_mask": torch.ones_like(ids), "max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
        got = model.generate(ids, **kw)
        layers = model.config.num_hidden_layers
        assert len(standin.calls) == (new - 1) * layers and len(standin.fallbacks) == layers
        for step in range(new - 1):
            _check_calls(standin.calls[step * layers:(step + 1) * layers], model, 2, 1, PROMPT + step)
        model.set_attn_implementation("eager")
        want = model.generate(ids, **kw)
    assert torch.equal(got, want)


def test_a_padded_batch_falls_back_and_gives_eager_tokens(standin):
    model = _model("mistral")
    ids = torch.randint(1, VOCAB, (2, PROMPT))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    ids[1, :4] = 0
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                             pad_token_id=0)
        assert standin.calls == [] and len(standin.fallbacks) == 5 * 2
        model.set_attn_implementation("eager")
        want = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                              pad_token_id=0)
    assert torch.equal(got, want)


def test_a_static_cache_falls_back_and_gives_eager_tokens(standin):
    model = _model("llama")
    ids = torch.randint(0, VOCAB, (1, PROMPT))
    kw = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False, "cache_implementation": "static"}
    with torch.no_grad():
        got = model.generate(ids, **kw)
        assert standin.calls == [] and len(standin.fallbacks) == 4 * 2
        model.set_attn_implementation("eager")
        want = model.generate(ids, **kw)
    assert torch.equal(got, want)


def assistant_model(head_dim: int):
    """A one-layer Llama-style assistant that drafts 4 tokens a round (every draft kept to the
    model's check: no confidence threshold), on transformers' sdpa."""
    assistant = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=head_dim), attn_implementation="sdpa").eval()
    assistant.generation_config.num_assistant_tokens = 4
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return assistant


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_assisted_generation_sends_several_tokens_per_step_to_splitkv(name, standin):
    """A one-layer assistant drafts 4 tokens a round; the model checks them in one forward pass of 5
    tokens, rolls its cache back past the rejected ones (a sliding layer included) and must give
    plain greedy generation's tokens."""
    model = _model(name)
    assistant = assistant_model(head_dim=32)
    ids = torch.randint(0, VOCAB, (1, PROMPT))
    kw = {"max_new_tokens": 20, "min_new_tokens": 20, "do_sample": False}
    with torch.no_grad():
        got = model.generate(ids, assistant_model=assistant, **kw)
        several = [c for c in standin.calls if c.shape[1] > 1]
        assert several and {c.shape[1] for c in several} <= set(range(2, 6))
        if name == "mistral":  # the sliding layers: W - 1 kept tokens and the T checked ones
            assert all(c.window_left == WINDOW - 1 and c.seq_lens == [WINDOW - 1 + c.shape[1]] for c in several)
        want = model.generate(ids, **kw)
        model.set_attn_implementation("eager")
        eager = model.generate(ids, **kw)
    assert torch.equal(got, want) and torch.equal(want, eager)


# ---- what falls back ----------------------------------------------------------------------------------------
def _debug_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == integration.__name__]


def test_more_than_16_new_tokens_fall_back_once_logged(standin, caplog, monkeypatch):
    monkeypatch.setattr(integration, "_logged", set())
    model = _model("llama")
    ids = torch.randint(0, VOCAB, (1, PROMPT + 34))
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger=integration.__name__):
        cache = DynamicCache(config=model.config)
        model(ids[:, :PROMPT], past_key_values=cache)
        model(ids[:, PROMPT:PROMPT + 17], past_key_values=cache)
        model(ids[:, PROMPT + 17:PROMPT + 34], past_key_values=cache)
    assert standin.calls == [] and [f.tokens for f in standin.fallbacks] == [PROMPT] * 2 + [17] * 4
    assert _debug_lines(caplog) == [("splitkv: more than 16 new tokens per sequence; such calls run transformers' "
                                     "attention instead")]


def test_float32_and_an_unsupported_head_dim_fall_back_once_logged(standin, caplog, monkeypatch):
    monkeypatch.setattr(integration, "_logged", set())
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger=integration.__name__):
        model = _model("llama", head_dim=32)
        ids = torch.randint(0, VOCAB, (1, PROMPT))
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        monkeypatch.setattr(integration, "_DTYPES", (torch.bfloat16, torch.float16))  # the real ones
        _model("llama").generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert standin.calls == [] and len(standin.fallbacks) == 2 * 4 * 2
    lines = _debug_lines(caplog)
    assert len(lines) == 2
    assert lines[0].startswith("splitkv: head_dim 32 (splitkv takes 64, 96, 128, 256)")
    assert lines[1].startswith("splitkv: dtypes torch.float32, torch.float32, torch.float32")


def test_the_fallback_of_a_soft_cap_or_sinks_is_the_models_eager_attention(standin, monkeypatch):
    """sdpa ignores softcap and s_aux: a prefill of Gemma 2 or gpt-oss through the fallback must be
    eager's, bit for bit (the same function on the same mask)."""
    for name in ("gemma2", "gpt_oss"):
        model = _model(name)
        ids = torch.randint(0, VOCAB, (2, PROMPT))
        with torch.no_grad():
            got = model(ids).logits
            model.set_attn_implementation("eager")
            want = model(ids).logits
        assert torch.equal(got, want), name
    assert standin.calls == []


def test_a_strided_cache_view_is_read_in_place(standin):
    """K/V given as cache[:, :, :L] of a longer preallocated cache reach splitkv as they are."""
    model = _model("llama")
    attn = model.model.layers[0].self_attn
    batch, tokens, length = 2, 2, 9
    q = torch.randn(batch, tokens, 8, 64).transpose(1, 2)  # [B, Hq, T, D], the projection's layout
    big_k, big_v = torch.randn(2, batch, 2, 32, 64)
    k, v = big_k[:, :, :length], big_v[:, :, :length]
    mask = integration.mask(batch_size=batch, q_length=tokens, kv_length=length, q_offset=length - tokens)
    out, weights = integration.attention_forward(attn, q, k, v, mask, scaling=attn.scaling)
    (call,) = standin.calls
    assert call.kv_shape == (batch, 2, length, 64) and weights is None
    ref, _ = integration.sdpa_attention_forward(attn, q, k, v, mask, scaling=attn.scaling)
    torch.testing.assert_close(out, ref, **TOLERANCE)


def test_compiled_decode_refuses_the_models_its_static_steps_cannot_take(standin, monkeypatch):
    """StaticCache's sliding layers are rings of the window's tokens, and the plan is of bf16/fp16
    programs: such models are refused by name before anything is planned."""
    for name in ("mistral", "gemma2", "gpt_oss"):
        with pytest.raises(ValueError, match="sliding-window layers"):
            integration.CompiledDecode(_model(name), batch_size=2, max_cache_len=64)
    with pytest.raises(ValueError, match="bf16 or fp16 models"):
        integration.CompiledDecode(_model("llama"), batch_size=2, max_cache_len=64)  # float32


@pytest.mark.parametrize("case", ["softcap", "sinks", "scale", "tokens"])
def test_a_compiled_step_refuses_what_its_plan_does_not_compute(standin, case):
    """A step that carries a plan runs splitkv's op or raises: never a silent fallback, since the
    plan, not the call, fixes what is computed."""
    attn = _model("llama").model.layers[0].self_attn
    tokens = 17 if case == "tokens" else 1
    q = torch.randn(2, 8, tokens, 64).transpose(1, 2).contiguous().transpose(1, 2)
    k = v = torch.randn(2, 2, 32, 64)
    keywords = {integration.PLAN_KEYWORD: torch.full((2,), 20, dtype=torch.int32), integration.HANDLE_KEYWORD: 1,
                integration.SCALE_KEYWORD: attn.scaling}
    extra = {"softcap": {"softcap": 30.0}, "sinks": {"s_aux": torch.zeros(8)}, "scale": {}, "tokens": {}}[case]
    scaling = attn.scaling * (2 if case == "scale" else 1)
    match = {"softcap": "soft-cap", "sinks": "sinks", "scale": "scale", "tokens": "more than 16"}[case]
    with pytest.raises(ValueError, match=match):
        integration.attention_forward(attn, q, k, v, None, scaling=scaling, **keywords, **extra)
    assert standin.calls == [] and standin.fallbacks == []
