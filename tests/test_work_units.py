"""The work-unit planner (`splitkv.work_units`): its tables' invariants on random batches
(hypothesis), its LPT simulation against a plain heap, and the tables executed by the NumPy emulator
against the float64 reference. No GPU."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitkv.reference import attention_reference, emulate_unit_decode
from splitkv.work_units import (NO_PARTIAL, SPLIT_WAVES, CostModel, UnitPlan, choose_kv_splits, lpt_makespan,
                                max_units, predicted_makespan, unit_tokens)

lengths = st.lists(st.one_of(st.integers(0, 40), st.integers(0, 5000), st.integers(0, 1 << 20)), min_size=1, max_size=48)


@st.composite
def problems(draw):
    return dict(seq_lens=draw(lengths), num_kv_heads=draw(st.integers(1, 8)),
                block_size=draw(st.sampled_from([1, 16, 64, 256])), slots=draw(st.sampled_from([1, 7, 64, 132, 264])))


def check_tables(plan: UnitPlan, seq_lens, num_kv_heads):
    """Every token of every row covered by exactly one unit, in block ranges that tile the row; the
    partial slots and the merge table consistent with the units."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    units = plan.units
    rows = units[:, 0].astype(np.int64) * num_kv_heads + units[:, 1]
    assert np.all((units[:, 0] >= 0) & (units[:, 0] < lens.size) & (units[:, 1] >= 0) & (units[:, 1] < num_kv_heads))
    assert np.array_equal(np.unique(rows), np.arange(lens.size * num_kv_heads)), "every row has units"
    order = np.lexsort((units[:, 2], rows))
    for row in range(lens.size * num_kv_heads):
        mine = units[order][rows[order] == row]
        blocks = -(-int(lens[row // num_kv_heads]) // plan.block_size)
        starts = np.concatenate([[0], np.cumsum(mine[:, 3])[:-1]])
        assert np.array_equal(mine[:, 2], starts), "a row's ranges follow each other"
        assert int(mine[:, 3].sum()) == blocks, "and cover its blocks exactly"
        assert len(mine) == 1 or np.all(mine[:, 3] > 0), "no empty piece of a split row"
        if len(mine) == 1:
            assert mine[0, 4] == NO_PARTIAL, "a whole row writes its output"
        else:
            assert np.all(mine[:, 4] != NO_PARTIAL)
    slots = units[:, 4][units[:, 4] != NO_PARTIAL]
    assert np.array_equal(np.sort(slots), np.arange(plan.num_partials)), "each partial slot written once"
    split_rows = {int(r) for r in rows[units[:, 4] != NO_PARTIAL]}
    assert {int(r) for r in plan.merges[:, 0]} == split_rows and len(plan.merges) == len(split_rows)
    for row, first, count in plan.merges.tolist():
        assert sorted(units[rows == row][:, 4].tolist()) == list(range(first, first + count))
    tokens = unit_tokens(plan, seq_lens)
    assert np.all(np.diff(tokens) <= 0), "units are listed longest first"


@settings(max_examples=150, deadline=None)
@given(problems())
def test_tables_cover_every_token_once_and_agree(problem):
    plan = choose_kv_splits(**problem)
    check_tables(plan, problem["seq_lens"], problem["num_kv_heads"])
    assert choose_kv_splits(**problem) == plan, "deterministic"
    # The fixed-size buffer a graph replays over holds any plan of as many rows, and gives it back.
    rows = len(problem["seq_lens"]) * problem["num_kv_heads"]
    capacity = max_units(rows, problem["slots"])
    assert len(plan.units) <= capacity and len(plan.merges) <= rows
    units, merges, partials, block_size = UnitPlan.tables_from_buffer(plan.to_buffer(capacity, rows), capacity)
    assert np.array_equal(units, plan.units) and np.array_equal(merges, plan.merges)
    assert (partials, block_size) == (plan.num_partials, plan.block_size)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_a_split_plan_is_predicted_faster_than_the_unsplit_one(problem):
    plan = choose_kv_splits(**problem)
    whole = choose_kv_splits(**problem, costs=CostModel(max_ways=1, threshold=1.0))
    assert not whole.split
    predicted, unsplit = (predicted_makespan(p, problem["seq_lens"]) for p in (plan, whole))
    assert predicted <= unsplit
    if plan.split:
        assert plan.makespan == pytest.approx(predicted) and plan.unsplit_makespan == pytest.approx(unsplit)
        assert predicted < unsplit * (1 - CostModel().threshold), "split only past the threshold"


def test_only_a_partial_wave_of_fewer_than_four_waves_is_split():
    slots = 132
    assert not choose_kv_splits([4096] * 33, 4, block_size=16, slots=slots).split  # 132 rows: one full wave
    many = SPLIT_WAVES * slots + 1
    plan = choose_kv_splits([4096] * many, 1, block_size=16, slots=slots)
    assert not plan.split and plan.makespan is None  # no split tried, nothing simulated
    assert choose_kv_splits([4096] * 3, 8, block_size=16, slots=slots).split  # 24 rows on 132 slots


def test_partial_wave_examples():
    # B=1 x 7 K/V heads: rows split as many ways as fill the slots (7 x 18 = 126 of 132).
    plan = choose_kv_splits([6096], 7, block_size=16, slots=132)
    assert len(plan.units) == 126 and plan.num_partials == 126 and len(plan.merges) == 7
    # One long sequence among short ones: the long rows split, the short ones stay whole.
    lens = [65536] + [512] * 63
    plan = choose_kv_splits(lens, 8, block_size=16, slots=132)
    whole_rows = plan.units[plan.units[:, 4] == NO_PARTIAL]
    assert set(whole_rows[:, 0].tolist()) == set(range(1, 64)) and set(plan.merges[:, 0] // 8) == {0}
    assert plan.makespan < plan.unsplit_makespan / 5


def test_threshold_and_ways_are_parameters():
    lens, heads = [6096], 7
    assert not choose_kv_splits(lens, heads, block_size=16, slots=132, costs=CostModel(threshold=0.95)).split
    plan = choose_kv_splits(lens, heads, block_size=16, slots=7, costs=CostModel(max_ways=3))
    assert not plan.split  # a full wave already
    plan = choose_kv_splits(lens, heads, block_size=16, slots=21, costs=CostModel(max_ways=3))
    assert plan.merges[:, 2].max() <= 3
    # Never more pieces than blocks: a row of 3 pages splits 3 ways at most.
    plan = choose_kv_splits([3 * 4096 - 100], 1, block_size=4096, slots=132)
    assert plan.merges[:, 2].tolist() == [3]
    # A short row is not worth the merge.
    assert not choose_kv_splits([40], 1, block_size=16, slots=132).split


def test_a_buffer_too_small_is_refused():
    plan = choose_kv_splits([6096], 7, block_size=16, slots=132)
    with pytest.raises(ValueError, match="126 units"):
        plan.to_buffer(100, 7)
    buffer = plan.to_buffer(126, 7)
    assert buffer.dtype == np.int32 and buffer.size == 4 + 126 * 5 + 7 * 3


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="block_size"):
        choose_kv_splits([10], 1, block_size=0, slots=4)
    with pytest.raises(ValueError, match="slots"):
        choose_kv_splits([10], 1, block_size=16, slots=0)
    with pytest.raises(ValueError, match="seq_lens"):
        choose_kv_splits([-1], 1, block_size=16, slots=4)
    with pytest.raises(ValueError, match="unit_overhead"):
        CostModel(unit_overhead=-1)
    with pytest.raises(ValueError, match="max_ways"):
        CostModel(max_ways=0)


def heap_lpt(costs, slots):
    loads = [0.0] * slots
    for cost in sorted(costs, reverse=True):
        heapq.heapreplace(loads, loads[0] + cost)
    return max(loads)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 50), st.integers(0, 10**6)), max_size=400), st.integers(1, 40))
def test_lpt_matches_a_plain_heap(costs, slots):
    exact = heap_lpt([float(c) for c in costs], slots)
    assert lpt_makespan(costs, slots) == exact
    # Stopped early, it still says whether the makespan reaches the mark.
    for mark in (exact / 2, exact, exact + 1):
        assert (lpt_makespan(costs, slots, stop_at=mark) >= mark) == (exact >= mark)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=5), st.sampled_from([(4, 1), (4, 2), (8, 8)]),
       st.sampled_from([1, 16, 64]), st.sampled_from([1, 3, 40]), st.integers(0, 2**31 - 1))
def test_emulated_tables_match_the_reference(seq_lens, heads, block_size, slots, seed):
    num_qo, num_kv = heads
    rng = np.random.default_rng(seed)
    max_len = max(seq_lens) + 3
    q = rng.standard_normal((len(seq_lens), num_qo, 32))
    k = rng.standard_normal((len(seq_lens), max_len, num_kv, 32))
    v = rng.standard_normal((len(seq_lens), max_len, num_kv, 32))
    k[:, max_len - 3:] = np.nan  # past every length: never read
    plan = choose_kv_splits(seq_lens, num_kv, block_size=block_size, slots=slots)
    out, lse = emulate_unit_decode(q, k, v, seq_lens, plan)
    ref_out, ref_lse = attention_reference(q, k, v, seq_lens)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_emulator_catches_a_row_no_unit_writes():
    plan = choose_kv_splits([100, 50], 2, block_size=16, slots=4)
    broken = UnitPlan(plan.block_size, plan.num_kv_heads, plan.slots, plan.units[1:], plan.merges,
                      plan.num_partials, plan.makespan, plan.unsplit_makespan)
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 4, 16)), rng.standard_normal((2, 100, 2, 16)), rng.standard_normal((2, 100, 2, 16))
    out, _ = emulate_unit_decode(q, k, v, [100, 50], broken)
    assert np.isnan(out).any()


def test_split_plan_makespan_counts_every_piece_of_every_row():
    from splitkv.work_units import split_plan_makespan

    # Two rows of 300 tokens in pieces of 128: 6 pieces (128, 128, 44 each) on 2 slots.
    assert split_plan_makespan([300], 2, 128, 2, CostModel(unit_overhead=0)) == 300
    assert split_plan_makespan([300], 2, 128, 6, CostModel(unit_overhead=10)) == 138
    assert split_plan_makespan([0, 0], 1, 64, 4, CostModel(unit_overhead=5)) == 5  # an empty row still costs a CTA


@settings(max_examples=150, deadline=None)
@given(problems())
def test_the_pruned_search_finds_the_best_candidate_simulated_in_full(problem):
    """The bounds and the early stops only skip work: every candidate simulated in full, the best
    one kept past the threshold, gives the same makespan."""
    from splitkv.work_units import _candidates, _pieces, _merge_cost, _partials

    costs = CostModel()
    plan = choose_kv_splits(**problem)
    heads, slots, block = problem["num_kv_heads"], problem["slots"], problem["block_size"]
    row_tokens = np.repeat(np.asarray(problem["seq_lens"], dtype=np.int64), heads)
    row_blocks = -(-row_tokens // block)
    row_costs = row_tokens + costs.unit_overhead
    partial_wave = row_tokens.size % slots != 0 and row_tokens.size < SPLIT_WAVES * slots
    # A row above a slot's average load (plus the threshold) is searched whatever the waves.
    skewed = row_costs.size > 0 and row_costs.max() > (1 + costs.threshold) * row_costs.sum() / slots
    if not (partial_wave or skewed):
        assert not plan.split
        return
    unsplit = lpt_makespan(row_costs, slots)
    full = [lpt_makespan(_pieces(row_tokens, row_blocks, ways, block).tokens + costs.unit_overhead, slots)
            + float(_merge_cost(_partials(ways), slots, costs))
            for ways in _candidates(row_tokens, row_blocks, slots, costs, partial_wave)]
    best = min(full, default=unsplit)
    if best < unsplit * (1 - costs.threshold):
        assert plan.split and plan.makespan == pytest.approx(best)
    else:
        assert not plan.split and plan.makespan == unsplit


@settings(max_examples=200, deadline=None)
@given(problems(), st.sampled_from([64, 128, 512, 4096]), st.booleans())
def test_routing_is_skipped_only_where_units_could_not_win(problem, per_split, dense):
    from splitkv.work_units import ROUTE_FACTOR, may_route_to_units, split_plan_makespan

    lens, heads, slots = problem["seq_lens"], problem["num_kv_heads"], problem["slots"]
    per_split = max(max(lens), 1) if dense else per_split
    if may_route_to_units(lens, heads, per_split, slots):
        return
    units = choose_kv_splits(**problem)
    assert split_plan_makespan(lens, heads, per_split, slots) <= ROUTE_FACTOR * predicted_makespan(units, lens)


@pytest.mark.parametrize("lens, heads, slots", [
    ([65536] + [512] * 32, 8, 264),       # 264 rows: whole waves, one long request among short ones
    ([65536] + [512] * 31, 8, 132),       # 256 rows: whole waves on 132 slots
    ([1_000_000] + [16] * 1000, 1, 132),  # more than SPLIT_WAVES waves
])
def test_a_long_row_among_whole_waves_of_short_ones_is_split(lens, heads, slots):
    """However the rows fill the waves, a row longer than a slot's average load is split, and the
    runtime's router then takes the units (the split planner's dense plan leaves it to one CTA)."""
    from splitkv.work_units import ROUTE_FACTOR, max_units, split_plan_makespan

    plan = choose_kv_splits(lens, heads, block_size=256, slots=slots)
    assert plan.split and plan.makespan < plan.unsplit_makespan / 4
    assert len(plan.units) <= max_units(len(lens) * heads, slots)
    tokens = unit_tokens(plan, lens)
    assert tokens.sum() == sum(lens) * heads  # every token once
    dense = split_plan_makespan(lens, heads, max(lens), slots)
    assert dense > ROUTE_FACTOR * predicted_makespan(plan, lens)


def test_balanced_whole_waves_stay_unsplit_and_bad_lengths_are_named():
    """Rows of equal length in whole waves are not searched; a plan given lengths of fewer sequences
    than it covers says so; an empty batch with no per-unit overhead plans without a warning."""
    import warnings

    plan = choose_kv_splits([4096] * 33, 8, block_size=128, slots=264)
    assert not plan.split and plan.unsplit_makespan is None
    with pytest.raises(ValueError, match="seq_lens: 1 lengths, but the plan covers 2 sequences"):
        unit_tokens(choose_kv_splits([100, 200], 1, block_size=64, slots=132), [100])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        empty = choose_kv_splits([0, 0, 0], 1, block_size=16, slots=4, costs=CostModel(unit_overhead=0))
    assert not empty.split
