"""splitkv as transformers' attention implementation on a GPU (marker: gpu), on the five tiny random
models of the CPU test (Llama-style GQA, Qwen2-style 7 query heads per K/V head, Mistral-style
sliding window, Gemma-2-style soft-cap + sliding window + head_dim 256, gpt-oss-style sinks +
sliding window), in bf16: the weights are cast once and every implementation runs that same
model, so only the attention differs. (splitkv takes bf16/fp16 only; an fp32 model falls back.)

- Teacher forcing: a fixed random sequence, prompt longer than the window, then one token a step,
  with generate()'s cache and with one that keeps every token; the last position's logits of splitkv and of a yardstick against eager's. The yardstick is
  transformers' sdpa where it computes the same function (Llama, Qwen2, Mistral); sdpa ignores
  Gemma 2's soft-cap and gpt-oss does not take sdpa at all, so there it is the model's own eager
  attention computed in float32 and rounded to bf16 (an exact attention's bf16 output). Bound:
  ``max|splitkv - eager| <= 2 * max|yardstick - eager| + 2 ulps of bf16 at the largest logit``
  (the logits themselves come out of the bf16 LM head: below a couple of roundings of the largest
  one, two bf16 implementations cannot be told apart).
- Greedy tokens: 32 generated tokens equal eager's, except that a row may part from eager at a
  step where eager's own top-2 margin is within twice that bound (logits within the bound of
  eager's cannot change a wider choice); the rows' agreement is printed.
- Assisted generation (a one-layer assistant drafting 4 tokens a round, so 2-5 query tokens per
  step reach splitkv) gives plain greedy generation's tokens, with the same rule for two runs each
  within the bound of eager (a margin within four times it).
"""

from __future__ import annotations

import math
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("cupy")

import seeds
from test_integrations_transformers import CONFIGS, VOCAB, WINDOW, _model, assistant_model
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import splitkv
from splitkv.integrations import transformers as integration

pytestmark = pytest.mark.gpu

PROMPT = 3 * WINDOW  # sliding layers keep W - 1 tokens: positions relative to the cache's content
STEPS = 24
NEW_TOKENS = 32
#: Where transformers' sdpa computes the model's attention; elsewhere the float32 eager yardstick.
SDPA_EXACT = {"llama", "qwen2", "mistral"}
FP32_EAGER = "fp32-eager"


def _fp32_eager(module, query, key, value, attention_mask, **kwargs):
    """The model's own eager attention in float32 on the bf16 inputs, the output rounded to bf16."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    mask = None if attention_mask is None else attention_mask.float()
    out, _ = eager(module, query.float(), key.float(), value.float(), mask, **kwargs)
    return out.to(query.dtype), None


@pytest.fixture(autouse=True)
def _registered():
    integration.register()
    AttentionInterface.register(FP32_EAGER, _fp32_eager)
    AttentionMaskInterface.register(FP32_EAGER, eager_mask)


@pytest.fixture
def decode_calls(monkeypatch):
    """splitkv.decode as it is, with the query shape of every call recorded."""
    shapes, decode = [], splitkv.decode

    def recorded(q, *args, **kwargs):
        shapes.append(tuple(q.shape))
        return decode(q, *args, **kwargs)

    monkeypatch.setattr(splitkv, "decode", recorded)
    return shapes


def _cuda_model(name):
    torch.manual_seed(seeds.seed_of("transformers-gpu", name))
    # Weights 2.5x the configs' default scale: at 0.02 the logits of these tiny models barely feel a
    # soft-cap of the wrong size; at 0.05 a window off by one, no soft-cap or no sinks each move them
    # by 8x the bound or more (measured with a float64 stand-in for splitkv).
    model = _model(name, implementation="eager", initializer_range=0.05)
    return model.to("cuda", torch.bfloat16)


def _tokens(name, count, batch=2):
    gen = torch.Generator().manual_seed(seeds.seed_of("transformers-gpu-tokens", name))
    return torch.randint(0, VOCAB, (batch, count), generator=gen).cuda()


def _teacher_forced(model, implementation, ids):
    """Last-position logits (float32) of the prompt and of each later token fed alone, with the
    cache generate() makes (sliding layers keep W - 1 tokens, so at one token a step the window
    holds every key) and then with one that keeps every token (where the window must cut)."""
    model.set_attn_implementation(implementation)
    logits = []
    for cache in (DynamicCache(config=model.config), DynamicCache()):
        with torch.no_grad():
            logits.append(model(ids[:, :PROMPT], past_key_values=cache).logits[:, -1])
            for t in range(PROMPT, ids.shape[1] - 1):
                logits.append(model(ids[:, t:t + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(logits, dim=1).float()


def _ulp_bf16(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(x)) - 7)


def _bound(name) -> tuple[float, dict]:
    """(the bound on max|splitkv - eager| of the teacher-forced logits, the figures behind it)."""
    model = _cuda_model(name)
    ids = _tokens(name, PROMPT + STEPS)
    eager = _teacher_forced(model, "eager", ids)
    yardstick = "sdpa" if name in SDPA_EXACT else FP32_EAGER
    err = {impl: (_teacher_forced(model, impl, ids) - eager).abs().max().item() for impl in ("splitkv", yardstick)}
    floor = 2 * _ulp_bf16(eager.abs().max().item())
    return 2 * err[yardstick] + floor, {"errors": err, "yardstick": yardstick, "floor": floor}


def _parting(ref, got, allowed_margin: float) -> list:
    """Per row, the step where ``got``'s greedy tokens part from ``ref``'s (None: never); fails where
    ``ref``'s top-2 margin there is wider than ``allowed_margin``."""
    new = len(ref.logits)
    ref_new, got_new = ref.sequences[:, -new:], got.sequences[:, -new:]
    parted = []
    for row in range(ref_new.shape[0]):
        differ = (ref_new[row] != got_new[row]).nonzero()
        step = int(differ[0]) if len(differ) else None
        if step is not None:
            top2 = ref.logits[step][row].float().topk(2).values
            margin = (top2[0] - top2[1]).item()
            assert margin <= allowed_margin, (f"row {row} parts at step {step} of {new} where the reference's "
                                              f"margin {margin:.3g} exceeds {allowed_margin:.3g}")
        parted.append(step)
    return parted


def _greedy(model, implementation, prompt, **kwargs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        # An explicit mask of ones: generate() would read a random token equal to pad_token_id as padding.
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_splitkv_logits_and_greedy_tokens_follow_eager(name, decode_calls, capsys):
    bound, figures = _bound(name)
    err = figures["errors"]
    layers = CONFIGS[name]().num_hidden_layers
    # Every decode step's layers went to splitkv (the prefill to the fallback).
    assert decode_calls.count(decode_calls[0]) == 2 * (STEPS - 1) * layers
    config = CONFIGS[name]()
    assert decode_calls[0] == (2, 1, config.num_attention_heads, config.head_dim)
    print(f"{name}: max|splitkv - eager| {err['splitkv']:.3g}, max|{figures['yardstick']} - eager| "
          f"{err[figures['yardstick']]:.3g}, floor {figures['floor']:.3g}")
    assert err["splitkv"] <= bound, (name, figures)

    model = _cuda_model(name)
    prompt = _tokens(name, PROMPT)
    eager = _greedy(model, "eager", prompt)
    del decode_calls[:]
    got = _greedy(model, "splitkv", prompt)
    assert len(decode_calls) == (NEW_TOKENS - 1) * layers
    parted = _parting(eager, got, 2 * bound)
    with capsys.disabled():
        print(f"\n{name}: greedy tokens equal to eager's: "
              + ", ".join(f"{NEW_TOKENS if p is None else p}/{NEW_TOKENS}" for p in parted))


def test_assisted_generation_sends_several_tokens_a_step_and_gives_greedy_tokens(decode_calls, capsys):
    name = "mistral"  # sliding layers, rolled back past the rejected drafts
    bound, _ = _bound(name)
    model = _cuda_model(name)
    torch.manual_seed(seeds.seed_of("transformers-gpu", "assistant"))
    assistant = _assistant().to("cuda", torch.bfloat16)
    prompt = _tokens(name, PROMPT, batch=1)
    plain = _greedy(model, "splitkv", prompt)
    del decode_calls[:]
    assisted = _greedy(model, "splitkv", prompt, assistant_model=assistant)
    several = [s for s in decode_calls if s[1] > 1]
    assert several and {s[1] for s in several} <= set(range(2, 6)), sorted(set(decode_calls))
    (parted,) = _parting(plain, assisted, 4 * bound)
    with capsys.disabled():
        print(f"\nassisted ({len(several)} steps of 2-5 tokens): tokens equal to greedy's: "
              f"{NEW_TOKENS if parted is None else parted}/{NEW_TOKENS}")


def _assistant():
    return assistant_model(head_dim=64)
