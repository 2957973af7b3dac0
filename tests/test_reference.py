"""The float64 reference against a naive loop, and the split + merge emulator against the reference."""

import math
import warnings

import numpy as np
import pytest

import seeds

from splitkv.plan import SplitPlan, plan_splits
from splitkv.reference import (attention_reference, emulate_split_decode, merge_partials,
                               split_partials)


@pytest.fixture
def rng(request):
    # Fresh inputs every run, from the run's seed (in the pytest header; SPLITKV_TEST_SEED replays it).
    return seeds.rng(request.node.name)


def make_inputs(rng, lens, num_kv_heads, group, head_dim=32, max_len=None, q_gain=1.0):
    lens = np.asarray(lens, dtype=np.int64)
    max_len = int(lens.max()) if max_len is None else max_len
    batch = lens.size
    q = rng.standard_normal((batch, num_kv_heads * group, head_dim)) * q_gain
    k = rng.standard_normal((batch, max_len, num_kv_heads, head_dim))
    v = rng.standard_normal((batch, max_len, num_kv_heads, head_dim))
    return q, k, v, lens


def naive_attention(q, k, v, lens, scale):
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[2]
    out = np.zeros((batch, num_q_heads, head_dim))
    lse = np.full((batch, num_q_heads), -np.inf)
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            continue
        for h in range(num_q_heads):
            keys = k[b, :n, h // group].astype(np.float64)
            vals = v[b, :n, h // group].astype(np.float64)
            logits = [scale * float(np.dot(q[b, h].astype(np.float64), keys[t])) for t in range(n)]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = math.fsum(weights)
            out[b, h] = sum(w * vals[t] for t, w in enumerate(weights)) / total
            lse[b, h] = top + math.log(total)
    return out, lse


def assert_matches(out, lse, want_out, want_lse, rtol=1e-10, atol=1e-10):
    assert out.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(out, want_out, rtol=rtol, atol=atol)
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=rtol, atol=atol)


# ---- reference ----------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [1, 4, 8, 16])
def test_reference_matches_naive_loop(rng, group):
    q, k, v, lens = make_inputs(rng, [0, 1, 7, 23], num_kv_heads=2, group=group, max_len=25)
    out, lse = attention_reference(q, k, v, lens)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert_matches(out, lse, *naive_attention(q, k, v, lens, 1 / math.sqrt(q.shape[-1])))


def test_reference_scale_and_empty_sequence(rng):
    q, k, v, lens = make_inputs(rng, [5, 0], num_kv_heads=1, group=2)
    out, lse = attention_reference(q, k, v, lens, sm_scale=0.3)
    assert_matches(out, lse, *naive_attention(q, k, v, lens, 0.3))
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))


def test_reference_ignores_cache_past_the_end(rng):
    q, k, v, lens = make_inputs(rng, [3, 9], num_kv_heads=2, group=2, max_len=12)
    want = attention_reference(q, k, v, lens)
    k[0, 3:] = np.nan
    v[0, 3:] = np.nan
    v[1, 9:] = np.inf
    assert_matches(*attention_reference(q, k, v, lens), *want, rtol=0, atol=0)


def test_reference_extreme_logits_are_finite(rng):
    q, k, v, lens = make_inputs(rng, [40, 1], num_kv_heads=1, group=4, q_gain=1e3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attention_reference(q, k, v, lens)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert_matches(out, lse, *naive_attention(q, k, v, lens, 1 / math.sqrt(q.shape[-1])),
                   rtol=1e-9, atol=1e-9)


def test_reference_accepts_half_precision_inputs(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v, lens = make_inputs(rng, [6, 11], num_kv_heads=2, group=4)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        qd, kd, vd = q.astype(dtype), k.astype(dtype), v.astype(dtype)
        out, lse = attention_reference(qd, kd, vd, lens)
        want = naive_attention(qd.astype(np.float64), kd.astype(np.float64), vd.astype(np.float64),
                               lens, 1 / math.sqrt(q.shape[-1]))
        assert_matches(out, lse, *want)


@pytest.mark.parametrize("bad, match", [
    (dict(q=np.zeros((2, 4))), "q"),
    (dict(k=np.zeros((2, 8, 3, 16)), v=np.zeros((2, 8, 3, 16))), "q: 4 query heads"),
    (dict(k=np.zeros((2, 8, 2, 8))), "k"),
    (dict(v=np.zeros((2, 7, 2, 16))), "v"),
    (dict(seq_lens=[1, 9]), "seq_lens"),
    (dict(seq_lens=[1, -1]), "seq_lens"),
    (dict(seq_lens=[1.0, 2.0]), "seq_lens"),
    (dict(seq_lens=[1]), "seq_lens"),
])
def test_reference_rejects_bad_inputs(bad, match):
    args = dict(q=np.zeros((2, 4, 16)), k=np.zeros((2, 8, 2, 16)), v=np.zeros((2, 8, 2, 16)),
                seq_lens=[1, 8])
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        attention_reference(**args)


# ---- split partials -----------------------------------------------------------------------------

def test_split_partials_are_the_reference_over_each_range(rng):
    tps, splits = 5, 4
    q, k, v, lens = make_inputs(rng, [0, 1, 5, 13, 20], num_kv_heads=2, group=4)
    partial_o, partial_lse2 = split_partials(q, k, v, lens, tps, splits)
    assert partial_o.shape == (5, splits, 8, 32) and partial_lse2.shape == (5, splits, 8)
    for s in range(splits):
        lo, hi = s * tps, (s + 1) * tps
        sub_lens = np.clip(lens - lo, 0, tps)
        out, lse = attention_reference(q, k[:, lo:hi], v[:, lo:hi], sub_lens)
        assert_matches(partial_o[:, s], partial_lse2[:, s] * math.log(2), out, lse)
    # Splits past a sequence's end are empty: zeros and -inf, never NaN.
    assert np.all(partial_o[2, 1:] == 0) and np.all(np.isneginf(partial_lse2[2, 1:]))


def test_split_partials_rejects_a_plan_that_drops_tokens(rng):
    q, k, v, lens = make_inputs(rng, [3, 17], num_kv_heads=1, group=1)
    with pytest.raises(ValueError, match="num_splits"):
        split_partials(q, k, v, lens, 4, 4)
    with pytest.raises(ValueError, match="tokens_per_split"):
        split_partials(q, k, v, lens, 0, 4)


# ---- merge --------------------------------------------------------------------------------------

def test_merge_of_all_empty_rows_is_zero_and_neg_inf_without_warnings(rng):
    partial_o = rng.standard_normal((3, 4, 2, 8))
    partial_lse2 = rng.standard_normal((3, 4, 2)) * 50
    partial_lse2[1] = -np.inf
    partial_lse2[2, :, 1] = -np.inf
    partial_o[1] = np.nan  # whatever an empty split holds must not leak into the result
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_partials(partial_o, partial_lse2)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))
    assert np.all(out[2, 1] == 0) and np.isneginf(lse[2, 1])
    assert np.all(np.isfinite(out[0])) and np.all(np.isfinite(lse[0]))


def test_merge_matches_direct_formula_and_honours_splits_per_seq(rng):
    partial_o = rng.standard_normal((2, 5, 3, 4))
    partial_lse2 = rng.standard_normal((2, 5, 3)) * 30
    counts = np.array([2, 5], dtype=np.int32)
    garbage = partial_o.copy()
    garbage[0, 2:] = np.nan
    out, lse = merge_partials(garbage, partial_lse2, counts)
    for b, n in enumerate(counts):
        lse_nat = partial_lse2[b, :n] * math.log(2)
        total = np.logaddexp.reduce(lse_nat, axis=0)
        weights = np.exp(lse_nat - total)  # [n, Hq]
        np.testing.assert_allclose(lse[b], total, rtol=1e-12)
        np.testing.assert_allclose(out[b], np.einsum("sh,shd->hd", weights, partial_o[b, :n]),
                                   rtol=1e-12, atol=1e-12)


def test_merge_propagates_nan_from_a_split_that_counts(rng):
    partial_o = rng.standard_normal((1, 3, 2, 4))
    partial_lse2 = rng.standard_normal((1, 3, 2))
    partial_o[0, 1, 0, 2] = np.nan
    out, _ = merge_partials(partial_o, partial_lse2)
    assert np.isnan(out[0, 0, 2]) and np.all(np.isfinite(out[0, 1]))


# ---- emulator vs reference ----------------------------------------------------------------------

EMULATOR_CASES = [
    # lens, tokens_per_split, num_splits
    ([1], 1, 1),
    ([0], 4, 1),
    ([0, 1, 2], 1, 2),
    ([37], 8, 5),               # last split partial (37 is not a multiple of 8)
    ([64, 3, 0, 17], 16, 4),
    ([640, 1, 129], 10, 64),    # many splits
    ([9, 9], 64, 1),            # dense: one split longer than any sequence
    ([300, 5], 5, 64),          # sequences shorter than the grid's splits leave empty CTAs
]


@pytest.mark.parametrize("group", [1, 4, 8, 16])
@pytest.mark.parametrize("lens, tps, splits", EMULATOR_CASES)
@pytest.mark.parametrize("q_gain", [1.0, 1e3])
def test_emulator_matches_reference(rng, group, lens, tps, splits, q_gain):
    q, k, v, lens = make_inputs(rng, lens, num_kv_heads=2, group=group, head_dim=16, q_gain=q_gain)
    counts = np.maximum(-(-lens // tps), 1).astype(np.int32)
    plan = SplitPlan("split" if splits > 1 else "dense", tps, splits, counts,
                     lens.size * 2 * splits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = emulate_split_decode(q, k, v, lens, plan)
    want = attention_reference(q, k, v, lens)
    if q_gain > 1:
        # logits ~ +-1e4: the LSE carries absolute error ~1e4 * eps; softmax is near one-hot.
        assert np.all(np.isfinite(got[0]))
        assert_matches(*got, *want, rtol=1e-9, atol=1e-8)
    else:
        assert_matches(*got, *want)


@pytest.mark.parametrize("num_sms, ctas_per_sm, chunk_size", [(8, 2, 8), (16, 1, 4), (64, 2, 16)])
def test_emulator_runs_planner_output(rng, num_sms, ctas_per_sm, chunk_size):
    lens = rng.integers(0, 400, size=int(rng.integers(1, 4)))
    lens[0] = 397  # at least one sequence long enough to be worth splitting
    q, k, v, lens = make_inputs(rng, lens, num_kv_heads=2, group=4, head_dim=16)
    plan = plan_splits(lens, 2, chunk_size=chunk_size, num_sms=num_sms, ctas_per_sm=ctas_per_sm)
    assert plan.variant == "split"
    assert_matches(*emulate_split_decode(q, k, v, lens, plan, sm_scale=0.2),
                   *attention_reference(q, k, v, lens, sm_scale=0.2))


@pytest.mark.parametrize("cluster", [2, 4, 16])
def test_merge_in_two_levels_matches_the_flat_merge(rng, cluster):
    # Rows of several clusters: each cluster merges its splits into one partial (its base-2 LSE
    # kept), then the row merges the cluster partials; clusters past a row's last split are empty.
    tps, splits = 7, 3 * cluster
    q, k, v, lens = make_inputs(rng, [tps * splits, tps * cluster + 3, 1, 0], num_kv_heads=2, group=4)
    partial_o, partial_lse2 = split_partials(q, k, v, lens, tps, splits)
    counts = np.maximum(-(-lens // tps), 1)
    clusters_used = -(-counts // cluster)
    level_o, level_lse = [], []
    for c in range(splits // cluster):
        part = slice(c * cluster, (c + 1) * cluster)
        o, lse = merge_partials(partial_o[:, part], partial_lse2[:, part], np.clip(counts - c * cluster, 0, cluster))
        level_o.append(o)
        level_lse.append(lse / math.log(2))
    got = merge_partials(np.stack(level_o, axis=1), np.stack(level_lse, axis=1), clusters_used)
    assert_matches(*got, *merge_partials(partial_o, partial_lse2, counts))
    assert_matches(*got, *attention_reference(q, k, v, lens))


def test_emulator_runs_a_plan_padded_to_whole_clusters(rng):
    # fit_clusters pads the grid past the longest row's splits: the extra splits are empty.
    from splitkv.plan import fit_clusters, fixed_plan

    lens = np.array([700, 333, 0])
    plan = fixed_plan(lens, 1, variant="split", chunk_size=4, num_splits=45)
    padded, cluster = fit_clusters(plan, lens, 1, chunk_size=4, max_cluster=16, resident_clusters=lambda c: 7,
                                   kv_bytes_per_token=1 << 20)
    assert cluster == 16 and padded.num_splits > int(padded.splits_per_seq.max())
    q, k, v, lens = make_inputs(rng, lens, num_kv_heads=1, group=4, head_dim=16)
    assert_matches(*emulate_split_decode(q, k, v, lens, padded), *attention_reference(q, k, v, lens))


# ---- the attention variants: several query tokens, sliding window, soft-cap, sinks ----------------
def _variant_by_hand(q, k, v, lens, scale, window_left, cap, sinks):
    """The variants' definitions, one query row and one token at a time."""
    batch, tokens, num_q, dim = q.shape
    group = num_q // k.shape[2]
    out, lse = np.zeros(q.shape), np.full((batch, tokens, num_q), -np.inf)
    for b in range(batch):
        for t in range(tokens):
            position = lens[b] - tokens + t
            for h in range(num_q):
                seen = [j for j in range(lens[b]) if j <= position and (window_left < 0 or j >= position - window_left)]
                if not seen:
                    continue
                logits = []
                for j in seen:
                    s = scale * float(q[b, t, h] @ k[b, j, h // group])
                    logits.append(cap * math.tanh(s / cap) if cap else s)
                m = max(logits)
                weights = [math.exp(s - m) for s in logits]
                total = sum(weights) + (math.exp(sinks[h] - m) if sinks is not None else 0.0)
                out[b, t, h] = sum(w * v[b, j, h // group] for w, j in zip(weights, seen)) / total
                lse[b, t, h] = m + math.log(sum(weights))
    return out, lse


@pytest.mark.parametrize("tokens, window_left, cap, with_sinks", [
    (1, -1, 0.0, False), (4, -1, 0.0, False), (1, 5, 0.0, False), (3, 2, 0.0, False), (1, -1, 0.7, False),
    (1, -1, 0.0, True), (5, 3, 1.5, True), (2, 0, 0.0, True), (16, 6, 30.0, False),
])
def test_variants_match_their_definitions(tokens, window_left, cap, with_sinks):
    rng = np.random.default_rng(tokens * 100 + window_left + 7)
    batch, num_kv, group, dim, max_len = 3, 2, 3, 8, 24
    q = rng.standard_normal((batch, tokens, num_kv * group, dim))
    k = rng.standard_normal((batch, max_len, num_kv, dim)) * 2
    v = rng.standard_normal((batch, max_len, num_kv, dim))
    lens = np.array([max_len, tokens + 3, tokens])
    k[1, lens[1]:] = v[1, lens[1]:] = np.nan  # past a length: never read
    sinks = rng.standard_normal(num_kv * group) * 2 if with_sinks else None
    out, lse = attention_reference(q, k, v, lens, 0.4, window_left=window_left, logits_soft_cap=cap, sinks=sinks)
    want_out, want_lse = _variant_by_hand(q, k, v, lens, 0.4, window_left, cap, sinks)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_one_query_token_is_the_decode_of_the_sequence_so_far():
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 4, 8, 16))
    k, v = rng.standard_normal((2, 40, 2, 16)), rng.standard_normal((2, 40, 2, 16))
    lens = np.array([40, 9])
    out, lse = attention_reference(q, k, v, lens)
    for t in range(4):  # token t sees the first len - 4 + t + 1 positions, as a decode of that length
        step_out, step_lse = attention_reference(q[:, t], k, v, lens - 4 + t + 1)
        np.testing.assert_allclose(out[:, t], step_out, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(lse[:, t], step_lse, rtol=1e-13, atol=1e-13)


def test_sinks_scale_the_output_and_leave_lse():
    rng = np.random.default_rng(12)
    q, k, v = rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 30, 2, 8)), rng.standard_normal((2, 30, 2, 8))
    lens, sinks = np.array([30, 0]), np.array([0.5, -1.0, 2.0, -np.inf])
    out, lse = attention_reference(q, k, v, lens)
    with_sinks, lse_sinks = attention_reference(q, k, v, lens, sinks=sinks)
    np.testing.assert_array_equal(lse_sinks, lse)
    share = np.exp(lse[0]) / (np.exp(lse[0]) + np.exp(sinks))  # the tokens' share of the denominator
    np.testing.assert_allclose(with_sinks[0], out[0] * share[:, None], rtol=1e-13)
    assert (with_sinks[1] == 0).all() and np.isneginf(lse_sinks[1]).all()  # an empty sequence stays empty


def test_a_window_past_the_sequence_and_a_huge_cap_change_nothing():
    rng = np.random.default_rng(13)
    q, k, v = rng.standard_normal((2, 3, 4, 8)), rng.standard_normal((2, 20, 1, 8)), rng.standard_normal((2, 20, 1, 8))
    lens = np.array([20, 5])
    plain = attention_reference(q, k, v, lens)
    for result in (attention_reference(q, k, v, lens, window_left=20),
                   attention_reference(q, k, v, lens, logits_soft_cap=1e9)):
        np.testing.assert_allclose(result[0], plain[0], rtol=1e-9)
        np.testing.assert_allclose(result[1], plain[1], rtol=1e-9)


@pytest.mark.parametrize("kwargs, message", [
    ({"window_left": -2}, "window_left: expected -1"), ({"window_left": 1.5}, "window_left: expected -1"),
    ({"logits_soft_cap": -1.0}, "logits_soft_cap: expected 0"), ({"logits_soft_cap": math.inf}, "logits_soft_cap"),
    ({"sinks": np.zeros(3)}, r"sinks: expected shape \(4,\)"),
])
def test_bad_variant_arguments(kwargs, message):
    q, k = np.zeros((1, 4, 8)), np.zeros((1, 5, 1, 8))
    with pytest.raises(ValueError, match=message):
        attention_reference(q, k, k, [5], **kwargs)
