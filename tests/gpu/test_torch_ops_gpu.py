"""splitkv's torch.library custom ops on the GPU (marker: gpu): ``torch.compile(fullgraph=True)``
over a layer that calls ``torch.ops.splitkv.run``, plain and in its CUDA-graph mode, gives the bits
of the eager run() under the same plan, and right against float64."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

from splitkv import DecodeAttention  # noqa: E402
from splitkv.integrations import torch_ops  # noqa: E402
from splitkv.reference import attention_reference  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_run_gives_the_eager_bits(mode):
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(3)
    batch, tokens, num_qo, num_kv, head_dim, length = 2, 2, 8, 2, 128, 3000
    q = torch.randn(batch, tokens, num_qo, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cache_k = torch.randn(batch, num_kv, 4096, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cache_v = torch.randn(batch, num_kv, 4096, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]  # views of a preallocated cache, read in place
    lens = torch.tensor([length, 1234], dtype=torch.int32, device="cuda")
    attn = DecodeAttention(num_qo, num_kv, head_dim, kv_layout="HND")
    attn.plan(lens, max_len=length, query_tokens=tokens, window_left=1000)
    handle, plan = torch_ops.handle(attn), torch_ops.plan_tensor(attn)

    def layer(q, k, v, plan):
        return torch.ops.splitkv.run(q * 1.0, k, v, plan, handle)

    eager = attn.run(q, k, v)
    compiled = torch.compile(layer, fullgraph=True, mode=mode)
    for _ in range(3):  # warm-up, then (reduce-overhead) capture and replays
        got = compiled(q, k, v, plan)
    torch.cuda.synchronize()
    assert torch.equal(got, eager)
    ref, _ = attention_reference(q.double().cpu().numpy(), k.double().cpu().permute(0, 2, 1, 3).numpy(),
                                 v.double().cpu().permute(0, 2, 1, 3).numpy(), [length, 1234],
                                 1 / math.sqrt(head_dim), window_left=1000)
    err = np.abs(got.float().cpu().numpy() - ref).max() / np.abs(ref).max()
    assert err < 2e-2, f"compiled run: max error {err:.3e} of the output's scale"
