"""Planner invariants over random batches, and its input errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitkv.plan import SplitPlan, describe, plan_splits

lens_lists = st.lists(st.integers(0, 200_000), min_size=1, max_size=64)
# Short batches of short sequences on a small GPU reach the split path far more often.
short_lens_lists = st.lists(st.integers(0, 5_000), min_size=1, max_size=8)


@st.composite
def problems(draw):
    lens = draw(st.one_of(lens_lists, short_lens_lists))
    return dict(
        seq_lens=np.array(lens, dtype=draw(st.sampled_from([np.int32, np.int64]))),
        num_kv_heads=draw(st.integers(1, 16)),
        chunk_size=draw(st.one_of(st.sampled_from([16, 32, 64, 128, 256, 512]), st.integers(1, 1000))),
        num_sms=draw(st.one_of(st.sampled_from([108, 132]), st.integers(1, 200))),
        ctas_per_sm=draw(st.integers(1, 4)),
        max_splits=draw(st.one_of(st.none(), st.integers(1, 128))),
    )


def run(problem):
    p = dict(problem)
    return plan_splits(p.pop("seq_lens"), p.pop("num_kv_heads"), **p)


@settings(max_examples=300, deadline=None)
@given(problems())
def test_every_token_is_covered_exactly_once(problem):
    plan = run(problem)
    tps = plan.tokens_per_split
    assert plan.splits_per_seq.dtype == np.int32
    assert plan.splits_per_seq.shape == problem["seq_lens"].shape
    assert np.all(plan.splits_per_seq >= 1)
    for n, count in zip(problem["seq_lens"].tolist(), plan.splits_per_seq.tolist()):
        starts = [s * tps for s in range(count)]
        ends = [min((s + 1) * tps, n) for s in range(count)]
        if n == 0:
            assert count == 1
            continue
        # Contiguous, non-empty ranges from 0 to n: each token lands in exactly one split.
        assert starts[0] == 0 and ends[-1] == n
        assert all(lo < hi for lo, hi in zip(starts, ends))
        assert all(hi == lo for hi, lo in zip(ends[:-1], starts[1:]))


@settings(max_examples=300, deadline=None)
@given(problems())
def test_grid_shape_and_limits(problem):
    plan = run(problem)
    lens = problem["seq_lens"]
    units = lens.size * problem["num_kv_heads"]
    slots = problem["num_sms"] * problem["ctas_per_sm"]
    chunk = problem["chunk_size"]

    assert plan.tokens_per_split % chunk == 0 and plan.tokens_per_split >= chunk
    assert plan.num_splits == int(plan.splits_per_seq.max()) >= 1
    assert plan.num_ctas == units * plan.num_splits
    if problem["max_splits"] is not None:
        assert plan.num_splits <= problem["max_splits"]
    if units >= slots or int(lens.max()) <= chunk:
        assert plan.variant == "dense"
    if plan.variant == "dense":
        assert plan.num_splits == 1
        assert plan.tokens_per_split >= int(lens.max())
    else:
        assert plan.variant == "split"
        assert plan.num_splits >= 2
        assert plan.num_ctas <= 2 * slots


@settings(max_examples=100, deadline=None)
@given(problems())
def test_deterministic_and_leaves_input_alone(problem):
    before = problem["seq_lens"].copy()
    first = run(problem)
    as_list = dict(problem, seq_lens=problem["seq_lens"].tolist())
    assert run(problem) == first
    assert run(as_list) == first
    assert hash(run(problem)) == hash(first)
    np.testing.assert_array_equal(problem["seq_lens"], before)
    assert not first.splits_per_seq.flags.writeable


def test_long_single_sequence_fills_one_wave():
    # 8 K/V heads of one 32k sequence on 132 SMs x 2: 8 units would leave the GPU almost idle.
    plan = plan_splits([32768], 8, chunk_size=256, num_sms=132, ctas_per_sm=2)
    slots = 264
    assert plan.variant == "split"
    assert 0.9 * slots <= plan.num_ctas <= slots
    assert "split" in describe(plan) and str(plan.num_ctas) in describe(plan)


def test_ragged_batch_uses_one_split_length():
    plan = plan_splits([10_000, 100, 0, 2_500], 2, chunk_size=64, num_sms=32, ctas_per_sm=1)
    assert plan.variant == "split"
    expected = np.maximum(-(-np.array([10_000, 100, 0, 2_500]) // plan.tokens_per_split), 1)
    np.testing.assert_array_equal(plan.splits_per_seq, expected)
    assert plan.splits_per_seq[0] > plan.splits_per_seq[3] >= plan.splits_per_seq[1] == 1


def test_dense_cases():
    full = plan_splits([50_000] * 64, 8, chunk_size=256, num_sms=132, ctas_per_sm=1)
    short = plan_splits([256, 3], 1, chunk_size=256, num_sms=132, ctas_per_sm=1)
    capped = plan_splits([50_000], 1, chunk_size=256, num_sms=132, ctas_per_sm=1, max_splits=1)
    empty = plan_splits([0, 0], 1, chunk_size=64, num_sms=132, ctas_per_sm=1)
    for plan in (full, short, capped, empty):
        assert plan.variant == "dense" and plan.num_splits == 1
        assert describe(plan).startswith("dense")
    assert empty.tokens_per_split == 64 and list(empty.splits_per_seq) == [1, 1]


GOOD = dict(seq_lens=[5, 300], num_kv_heads=2, chunk_size=32, num_sms=8, ctas_per_sm=1)


@pytest.mark.parametrize("arg, bad", [
    ("seq_lens", [5, -1]),
    ("seq_lens", []),
    ("seq_lens", [[5, 6]]),
    ("seq_lens", [5.0, 6.0]),
    ("num_kv_heads", 0),
    ("num_kv_heads", 2.0),
    ("chunk_size", 0),
    ("chunk_size", -64),
    ("num_sms", 0),
    ("ctas_per_sm", 0),
    ("ctas_per_sm", True),
    ("max_splits", 0),
])
def test_bad_arguments_name_themselves(arg, bad):
    args = dict(GOOD, **{arg: bad})
    with pytest.raises(ValueError, match=arg):
        plan_splits(args.pop("seq_lens"), args.pop("num_kv_heads"), **args)


def test_plan_rejects_unknown_variant():
    with pytest.raises(ValueError, match="variant"):
        SplitPlan("fused", 64, 1, np.ones(1, np.int32), 1)
