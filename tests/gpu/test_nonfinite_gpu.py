"""Non-finite inputs follow the float64 math (marker: gpu): the softmax of the scaled scores, then
the weighted sum of V, in float64 with IEEE rules. Where that gives NaN (a NaN in q, in K or V
inside the length, a +inf score, every score -inf) splitkv gives NaN, never a finite number; where
it is finite splitkv is finite and within the usual bounds; values past a length never matter.

One batch holds a sequence per case, so a case that leaks into another sequence's result, or a
merge that drops a NaN partial, shows. Every program layout that writes a final result is run:
dense, a warp per K/V head, split with the fused merge, with the separate merge program, in one
cluster per row, and work units.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from splitkv import DecodeAttention  # noqa: E402
from splitkv.heuristics import default_spec  # noqa: E402

from decode_checks import REL_TOL, fresh_seed, poisoned, random_values, to_float64  # noqa: E402

pytestmark = pytest.mark.gpu

LEN = 3000  # every case's length: 4 splits of 750 tokens; the special tokens sit in the second
TOKEN = 1000
NUM_KV, GROUP, HEAD_DIM = 4, 4, 128  # 4 K/V heads: a warp each in the warp_heads layout
CASES = ["q NaN", "q +inf", "k NaN", "k +inf", "k -inf score", "all scores -inf", "v NaN", "v +inf",
         "NaN past the length", "empty", "plain"]


def _set(stored, index, value: float, dtype: str):
    """Writes ``value`` at ``index`` of a bf16 (uint16 bits) or fp16 array."""
    if dtype == "fp16":
        stored[index] = value
    else:
        stored[index] = int(np.array(value, np.float32).view(np.uint32) >> 16)


def _inputs(dtype: str):
    """q, k, v (stored and float64), the lengths: one sequence per case of CASES."""
    batch, num_qo = len(CASES), NUM_KV * GROUP
    q, _ = random_values((batch, num_qo, HEAD_DIM), dtype, fresh_seed(901))
    k, _ = random_values((batch, LEN + 64, NUM_KV, HEAD_DIM), dtype, fresh_seed(902))
    v, _ = random_values((batch, LEN + 64, NUM_KV, HEAD_DIM), dtype, fresh_seed(903))
    lens = [LEN] * batch
    for b, case in enumerate(CASES):
        if case == "q NaN":
            _set(q, (b, 1, 7), math.nan, dtype)  # query head 1 alone
        elif case == "q +inf":
            _set(q, (b, 5, 0), math.inf, dtype)
        elif case == "k NaN":
            _set(k, (b, TOKEN, 0, 3), math.nan, dtype)  # every query head of K/V head 0
        elif case == "k +inf":
            _set(k, (b, TOKEN, 1, 9), math.inf, dtype)  # +inf or -inf scores by the sign of q there
        elif case == "k -inf score":  # one token's scores are -inf for K/V head 0: weight 0, finite
            for h in range(GROUP):
                _set(q, (b, h, 0), 1.0, dtype)
            _set(k, (b, TOKEN, 0, 0), -math.inf, dtype)
        elif case == "all scores -inf":  # every in-length score of K/V head 0 is -inf: NaN
            for h in range(GROUP):
                _set(q, (b, h, 0), 1.0, dtype)
            for t in range(LEN):
                _set(k, (b, t, 0, 0), -math.inf, dtype)
        elif case == "v NaN":
            _set(v, (b, TOKEN, 1, 5), math.nan, dtype)  # dimension 5 of K/V head 1's query heads
        elif case == "v +inf":
            _set(v, (b, TOKEN, 0, 11), math.inf, dtype)
        elif case == "NaN past the length":
            lens[b] = LEN - 100
            bits = 0x7FC0 if dtype == "bf16" else int(np.float16(np.nan).view(np.uint16))
            k.view(cupy.uint16)[b, lens[b]:] = bits
            v.view(cupy.uint16)[b, lens[b]:] = bits
        elif case == "empty":
            lens[b] = 0
    return q, k, v, lens


def math_reference(q64, k64, v64, lens, sm_scale):
    """The float64 math with IEEE rules, in NumPy: NaN and inf go where the formula takes them
    (max over NaN is NaN; -inf - -inf is NaN; 0 x inf is NaN). Length 0: zeros and -inf."""
    batch, num_qo, dim = q64.shape
    out = np.zeros((batch, num_qo, dim))
    lse = np.full((batch, num_qo), -np.inf)
    with np.errstate(all="ignore"):
        for b, n in enumerate(lens):
            if n == 0:
                continue
            qg = q64[b].reshape(NUM_KV, GROUP, dim)
            # Products summed as a matmul would, so that inf x 0 and inf - inf give NaN.
            scores = (qg[:, :, None, :] * k64[b, :n].transpose(1, 0, 2)[:, None, :, :]).sum(-1) * sm_scale
            m = scores.max(axis=2, keepdims=True)
            p = np.exp(scores - m)
            total = p.sum(axis=2, keepdims=True)
            weighted = (p[..., None] * v64[b, :n].transpose(1, 0, 2)[:, None, :, :]).sum(2)
            out[b] = (weighted / total).reshape(num_qo, dim)
            lse[b] = (m + np.log(total)).reshape(num_qo)
    return out, lse


def _check(out, lse, ref_out, ref_lse, dtype, label):
    got = cupy.asnumpy(to_float64(out, dtype))
    got_lse = cupy.asnumpy(lse).astype(np.float64)
    for b, case in enumerate(CASES):
        where = f"{label}, {case}"
        nan = np.isnan(ref_out[b])
        assert np.isnan(got[b][nan]).all(), f"{where}: {int((~np.isnan(got[b][nan])).sum())} outputs not NaN where the math is"
        infinite = np.isinf(ref_out[b])
        assert not np.isfinite(got[b][infinite]).any(), f"{where}: a finite output where the math is infinite"
        finite = np.isfinite(ref_out[b])
        assert np.isfinite(got[b][finite]).all(), f"{where}: a non-finite output where the math is finite"
        scale = np.abs(np.where(finite, ref_out[b], 0)).max(axis=1, keepdims=True)
        bound = REL_TOL[dtype] * (np.abs(ref_out[b]) + scale)
        with np.errstate(invalid="ignore"):  # inf - inf where both are infinite: only finite ones are compared
            error = np.abs(got[b] - ref_out[b])
        assert (error[finite] <= bound[finite]).all(), f"{where}: beyond the bound"
        assert np.array_equal(np.isnan(got_lse[b]), np.isnan(ref_lse[b])), f"{where}: lse NaN {got_lse[b]} vs {ref_lse[b]}"
        assert np.array_equal(np.isneginf(got_lse[b]), np.isneginf(ref_lse[b])), f"{where}: lse {got_lse[b]}"
        both = np.isfinite(ref_lse[b])
        assert np.allclose(got_lse[b][both], ref_lse[b][both], atol=1e-3), f"{where}: lse {got_lse[b]} vs {ref_lse[b]}"
    # The cases meant to be NaN are, so the checks above compared something.
    assert np.isnan(ref_out[CASES.index("all scores -inf"), :GROUP]).all()
    assert np.isnan(ref_out[CASES.index("q NaN"), 1]).all() and np.isfinite(ref_out[CASES.index("q NaN"), 0]).all()
    assert np.isfinite(ref_out[CASES.index("k -inf score")]).all()


@pytest.mark.parametrize("layout", ["dense", "warp_heads", "split", "split, separate merge", "split, cluster",
                                    "units"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_non_finite_inputs_follow_the_math(layout, dtype):
    q, k, v, lens = _inputs(dtype)
    q64, k64, v64 = (to_float64(x, dtype) for x in (q, k, v))
    ref_out, ref_lse = math_reference(*(cupy.asnumpy(x) for x in (q64, k64, v64)), lens, 1 / math.sqrt(HEAD_DIM))
    spec = default_spec("sm_90", HEAD_DIM, GROUP, dtype, dtype)
    plan_args = {"dense": dict(variant="dense", warp_heads=False), "warp_heads": dict(variant="dense", warp_heads=True),
                 "split": dict(variant="split", num_splits=4), "split, separate merge": dict(variant="split", num_splits=4),
                 "split, cluster": dict(variant="split", num_splits=4), "units": dict(variant="units")}[layout]
    changes = {"split": dict(cluster=1), "split, separate merge": dict(cluster=1, fused_merge=False),
               "split, cluster": dict(cluster=4)}.get(layout)
    attn = DecodeAttention(NUM_KV * GROUP, NUM_KV, HEAD_DIM, q_dtype=dtype, kv_dtype=dtype,
                           spec=spec.replace(**changes) if changes else None, tuned=False)
    out = poisoned(q.shape, dtype)
    lse = cupy.full(q.shape[:2], cupy.nan, dtype=cupy.float32)
    if layout == "split, cluster":  # a sequence per plan: a cluster per row needs every row's cluster resident
        for b, n in enumerate(lens):
            attn.plan([n], **plan_args)
            assert n == 0 or attn._launch.spec.cluster == 4, attn.plan_info
            attn.run(q[b:b + 1], k[b:b + 1], v[b:b + 1], out=out[b:b + 1], lse=lse[b:b + 1])
    else:
        attn.plan(lens, **plan_args)
        attn.run(q, k, v, out=out, lse=lse)
    _check(out, lse, ref_out, ref_lse, dtype, f"{dtype} {layout} ({attn.plan_info})")
