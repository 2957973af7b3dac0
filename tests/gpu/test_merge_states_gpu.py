"""merge_states on the GPU (marker: gpu): states of split token ranges merge into the attention of
the whole (against the float64 reference), with sinks, empty states, NaN, torch and CuPy, and the
batched form of many states."""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import splitkv  # noqa: E402
from splitkv import DecodeAttention  # noqa: E402
from splitkv.reference import attention_reference  # noqa: E402

from decode_checks import check_close, random_values, to_float64  # noqa: E402

pytestmark = pytest.mark.gpu


def _state(q, k, v, lens, num_qo, num_kv, head_dim):
    attn = DecodeAttention(num_qo, num_kv, head_dim)
    attn.plan(lens)
    return attn.run(q, k, v, return_lse=True)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_two_ranges_merge_into_the_whole(head_dim):
    """A cache cut at a point: the prefix's state and the rest's merge into the attention over both,
    as cascade attention does; and with sinks, into attention with sinks."""
    num_qo, num_kv, batch, total, cut = 8, 2, 3, 3000, 1100
    q, q64 = random_values((batch, num_qo, head_dim), "bf16", 5)
    k, k64 = random_values((batch, total, num_kv, head_dim), "bf16", 6)
    v, v64 = random_values((batch, total, num_kv, head_dim), "bf16", 7)
    lens = [total, 2000, 1100]  # the last sequence's second range is empty
    o_a, lse_a = _state(q, cupy.ascontiguousarray(k[:, :cut]), cupy.ascontiguousarray(v[:, :cut]), [cut] * batch,
                        num_qo, num_kv, head_dim)
    rest = [n - cut for n in lens]
    o_b, lse_b = _state(q, cupy.ascontiguousarray(k[:, cut:]), cupy.ascontiguousarray(v[:, cut:]), rest, num_qo,
                        num_kv, head_dim)
    sinks = np.random.default_rng(1).normal(0, 2, num_qo).astype(np.float32)
    for with_sinks in (False, True):
        out, lse = splitkv.merge_states(o_a, lse_a, o_b, lse_b, sinks=cupy.asarray(sinks) if with_sinks else None)
        ref_out, ref_lse = attention_reference(cupy.asnumpy(q64), cupy.asnumpy(k64), cupy.asnumpy(v64), lens,
                                               1 / math.sqrt(head_dim), sinks=sinks if with_sinks else None)
        # The states' own rounding to bf16 enters once more than in one decode: bounded as one.
        check_close(out, lse, cupy.asarray(ref_out), ref_lse, lens, "bf16", f"merge_states sinks={with_sinks}")


def test_empty_and_nan_states_and_many_at_once():
    heads, head_dim, rows, count = 4, 128, 6, 5
    rng = np.random.default_rng(3)
    o = rng.standard_normal((rows, count, heads, head_dim)).astype(np.float32)
    lse = rng.normal(0, 3, (rows, count, heads)).astype(np.float32)
    lse[0] = -np.inf  # every state of row 0 empty: zeros and -inf
    lse[1, 1:] = -np.inf  # one state: itself
    o[2, 3, 1, 7] = np.nan  # a NaN element poisons that element of the merged row, no other
    bits = (o.view(np.uint32) + 0x7FFF + ((o.view(np.uint32) >> 16) & 1)) >> 16
    o16 = bits.astype(np.uint16)
    o64 = (o16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    out, merged = splitkv.merge_state_list(cupy.asarray(o16), cupy.asarray(lse))
    m = np.max(lse, axis=1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse.astype(np.float64) - m_safe)
    total = w.sum(axis=1)
    ref = np.einsum("nsh,nshd->nhd", w, o64) / np.where(total > 0, total, 1)[..., None]
    ref[0] = 0.0
    got = cupy.asnumpy(to_float64(out, "bf16"))
    lse_got = cupy.asnumpy(merged)
    assert (got[0] == 0).all() and np.isneginf(lse_got[0]).all()
    assert np.isnan(got[2, 1, 7])
    poisoned = np.zeros(got.shape, bool)
    poisoned[2, 1, 7] = True
    assert np.isfinite(got[~poisoned]).all()
    fine = np.ones(rows, bool)
    fine[0] = False
    ref[poisoned], got[poisoned] = 0.0, 0.0
    assert np.allclose(got[fine], ref[fine], rtol=2e-2, atol=2e-2 * np.abs(ref[fine]).max())
    assert np.allclose(lse_got[fine], (m_safe[:, 0] + np.log(total))[fine], atol=1e-4)
    np.testing.assert_array_equal(got[1], o64[1, 0].astype(np.float32).astype(np.float64))


def test_torch_states():
    torch = pytest.importorskip("torch")
    o_a = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    o_b = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    lse_a = torch.randn(3, 8, device="cuda")
    lse_b = torch.full((3, 8), -math.inf, device="cuda")  # empty: the merge is o_a itself
    out, lse = splitkv.merge_states(o_a, lse_a, o_b, lse_b)
    assert out.dtype == torch.bfloat16 and out.shape == o_a.shape and torch.equal(out, o_a)
    assert torch.allclose(lse, lse_a)
