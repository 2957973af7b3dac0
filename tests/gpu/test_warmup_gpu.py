"""DecodeAttention.warmup on the GPU (marker: gpu): after it, plans of the range compile nothing
(NVRTC replaced by an error) and what they launch is right."""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from splitkv import DecodeAttention  # noqa: E402

from decode_checks import check_close, fresh_seed, poisoned, random_values, reference  # noqa: E402

pytestmark = pytest.mark.gpu


def test_plans_after_a_warm_up_compile_nothing(monkeypatch):
    import splitkv.codegen.compile as compile_module

    attn = DecodeAttention(16, 4, 128)
    report = attn.warmup(max_len=20000, max_batch=8)
    assert report.programs > 5
    print(report)

    def refused(*args, **kwargs):
        raise AssertionError("a plan compiled after the warm-up")
    monkeypatch.setattr(compile_module, "_compile", refused)
    rng = np.random.default_rng(fresh_seed(401))
    for i in range(40):
        batch = int(rng.integers(1, 9))
        lens = [int(n) for n in rng.integers(0, 20001, size=batch)]
        lens[0] = max(lens[0], 1)
        attn.plan(lens, variant="units" if i % 5 == 0 else None)
        if i % 8 == 0:  # and the programs run right
            q, q64 = random_values((batch, 16, 128), "bf16", fresh_seed(402 + i))
            k, k64 = random_values((batch, max(lens), 4, 128), "bf16", fresh_seed(403 + i))
            v, v64 = random_values((batch, max(lens), 4, 128), "bf16", fresh_seed(404 + i))
            out = poisoned((batch, 16, 128), "bf16")
            attn.run(q, k, v, out=out)
            ref, _ = reference(q64, k64, v64, lens, 1 / math.sqrt(128))
            check_close(out, None, ref, None, lens, "bf16", f"after the warm-up: {attn.plan_info}")
