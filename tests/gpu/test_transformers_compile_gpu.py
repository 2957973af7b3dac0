"""``torch.compile(model, fullgraph=True)`` through splitkv's decode steps (marker: gpu), on the
Llama-style model of the CPU test in bf16: a StaticCache, the prefill by transformers' attention,
then one token a step through `CompiledDecode`, compiled plainly and in its CUDA-graph mode
("reduce-overhead"), the plan made once outside the compiled region.

- The compiled steps ran splitkv's op: plainly, DecodeAttention.run once per layer and step; under
  CUDA graphs only while it warmed up and captured (replays run no Python), with no step skipped by
  the graph trees.
- Teacher-forced logits: ``max|splitkv - eager| <= 2 * max|sdpa - eager| + 2 ulps of bf16 at the
  largest logit`` (the bound of the uncompiled test, test_transformers_gpu.py), the three over the
  same StaticCache steps and tokens.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("cupy")

import seeds
from test_integrations_transformers import CONFIGS, VOCAB, _model
from transformers import StaticCache

import splitkv
from splitkv.integrations import transformers as integration

pytestmark = pytest.mark.gpu

NAME = "llama"
PROMPT, STEPS, CACHE, BATCH = 40, 12, 128, 2


@pytest.fixture
def run_calls(monkeypatch):
    """DecodeAttention.run as it is, its calls counted."""
    calls, run = [], splitkv.DecodeAttention.run

    def counted(self, *args, **kwargs):
        calls.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(splitkv.DecodeAttention, "run", counted)
    return calls


def _cuda_model():
    integration.register()
    torch.manual_seed(seeds.seed_of("transformers-compile-gpu", NAME))
    return _model(NAME, implementation="eager", initializer_range=0.05).to("cuda", torch.bfloat16)


def _ids():
    gen = torch.Generator().manual_seed(seeds.seed_of("transformers-compile-gpu-tokens", NAME))
    return torch.randint(0, VOCAB, (BATCH, PROMPT + STEPS), generator=gen).cuda()


def _positions(t):
    return torch.full((BATCH, 1), t, dtype=torch.long, device="cuda")


def _steps(model, ids, implementation, step):
    """Last-position logits (float32) of the prompt and of each later token fed alone over a
    StaticCache; ``step(tokens, cache, t)`` runs position t's forward pass."""
    model.set_attn_implementation(implementation)
    cache = StaticCache(config=model.config, max_cache_len=CACHE)
    with torch.no_grad():
        logits = [model(ids[:, :PROMPT], past_key_values=cache).logits[:, -1].float()]
        for t in range(PROMPT, PROMPT + STEPS):
            logits.append(step(ids[:, t:t + 1], cache, t).float().clone())
    return torch.stack(logits, dim=1)


def _uncompiled(model):
    return lambda tokens, cache, t: model(tokens, past_key_values=cache, position_ids=_positions(t)).logits[:, -1]


def _ulp_bf16(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(x)) - 7)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_decode_steps_run_splitkv_within_the_bound(mode, run_calls, capsys):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, ids = _cuda_model(), _ids()
    eager = _steps(model, ids, "eager", _uncompiled(model))
    sdpa = _steps(model, ids, "sdpa", _uncompiled(model))
    assert not run_calls

    steps = integration.CompiledDecode(model, batch_size=BATCH, max_cache_len=CACHE)
    compiled = torch.compile(model, fullgraph=True, mode=mode)

    def compiled_step(tokens, cache, t):
        return compiled(tokens, past_key_values=cache, position_ids=_positions(t), **steps.step(t + 1)).logits[:, -1]

    got = _steps(model, ids, "splitkv", compiled_step)
    torch.cuda.synchronize()
    layers = CONFIGS[NAME]().num_hidden_layers
    if mode is None:
        assert len(run_calls) == layers * STEPS
    else:
        assert 0 < len(run_calls) < layers * STEPS, len(run_calls)
        assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    assert torch.isfinite(got).all()
    err_splitkv = (got - eager).abs().max().item()
    err_sdpa = (sdpa - eager).abs().max().item()
    bound = 2 * err_sdpa + 2 * _ulp_bf16(eager.abs().max().item())
    with capsys.disabled():
        print(f"\ncompiled ({mode}): max|splitkv - eager| {err_splitkv:.3g}, max|sdpa - eager| {err_sdpa:.3g}, "
              f"bound {bound:.3g}; run() called {len(run_calls)} times over {STEPS} steps")
    assert err_splitkv <= bound
