"""Planner invariants over random batches, and its input errors."""

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from splitkv.plan import (DENSE_SM_SHARE, FEW_SPLITS_MAX_BYTES, WARP_HEADS_SHARE, dense_regardless, SplitPlan, describe, fit_clusters, fixed_plan,
                          pack_heads, plan_splits, wants_packed_heads, whole_row_ctas)

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
        **draw(st.one_of(st.just({}), st.fixed_dictionaries(
            # the short-row rule: CTAs that saturate the memory system, bytes per token
            dict(saturating_ctas=st.integers(1, 300), kv_bytes_per_token=st.sampled_from([72, 128, 256, 512, 1024]),
                 max_split_bytes=st.one_of(st.none(), st.sampled_from([1 << 20, 3 << 19, 4 << 20])))))),
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


def test_rows_that_give_nearly_every_sm_a_cta_run_dense_even_with_room_for_more():
    # 16 x 8 and 32 x 8 rows on 132 SMs holding 3 split CTAs each: dense (one CTA per SM streams
    # near the bandwidth); 96 rows leave a quarter of the SMs idle, so those still split.
    assert 128 >= DENSE_SM_SHARE * 132
    for batch in (16, 32):
        plan = plan_splits([4096] * batch, 8, chunk_size=128, num_sms=132, ctas_per_sm=3)
        assert plan.variant == "dense" and plan.num_ctas == batch * 8
    assert plan_splits([4096] * 12, 8, chunk_size=128, num_sms=132, ctas_per_sm=3).variant == "split"


def short_rows(lens, num_kv_heads, saturating, bytes_per_token=512, ctas_per_sm=2):
    return plan_splits(lens, num_kv_heads, chunk_size=128, num_sms=132, ctas_per_sm=ctas_per_sm,
                       saturating_ctas=saturating, kv_bytes_per_token=bytes_per_token)


def test_short_rows_take_the_fewest_splits_that_saturate_a_power_of_two_first():
    # 3 x 8 rows of 4096 tokens: 48 CTAs reach 47 at 2 splits, 94 at 4 (a power of two, 96 CTAs).
    assert (short_rows([4096] * 3, 8, 47).num_splits, short_rows([4096] * 3, 8, 94).num_splits) == (2, 4)
    # 32 rows: 94 CTAs are reached at 3 splits; 4 still fit on the SMs one each (128), so 4.
    assert short_rows([4096], 32, 94).num_splits == 4
    # 40 rows: 3 splits reach 94 (120 CTAs); 4 would not fit one per SM (160), so 3.
    assert short_rows([4096] * 5, 8, 94).num_splits == 3
    # The wave model (every resident CTA a slot) cuts the same rows 11 ways.
    assert plan_splits([4096] * 3, 8, chunk_size=128, num_sms=132, ctas_per_sm=2).num_splits == 11


def test_short_rows_that_saturate_alone_run_dense():
    plan = short_rows([4096] * 6, 8, 47)
    assert plan.variant == "dense" and plan.num_ctas == 48


def test_long_splits_go_to_the_wave_model():
    # 2 splits of 16384 tokens x 512 bytes (8 MiB) exceed FEW_SPLITS_MAX_BYTES; at 16384 tokens (4 MiB) they do not.
    wave = plan_splits([32768] * 3, 8, chunk_size=128, num_sms=132, ctas_per_sm=2)
    assert short_rows([32768] * 3, 8, 47) == wave and wave.num_splits == 11
    assert short_rows([16384] * 3, 8, 47).num_splits == 2
    assert FEW_SPLITS_MAX_BYTES == 8192 * 512
    # Rows that saturate alone but are long: the wave model too.
    assert short_rows([16384] * 6, 8, 47) == plan_splits([16384] * 6, 8, chunk_size=128, num_sms=132, ctas_per_sm=2)


def test_the_caller_bounds_the_short_row_rules_splits():
    # 1 x 8 rows of 24k tokens, 63 saturating CTAs: 8 splits of 3072 tokens (1.5 MiB at 512 bytes a
    # token) pass a 1.5 MiB bound; 32k tokens' 4096 (2 MiB) do not, and the wave model plans them.
    bounded = dict(chunk_size=128, num_sms=132, ctas_per_sm=1, saturating_ctas=63, kv_bytes_per_token=512,
                   max_split_bytes=3 << 19)
    assert plan_splits([24576], 8, **bounded).num_splits == 8
    wave = plan_splits([32768], 8, chunk_size=128, num_sms=132, ctas_per_sm=1)
    assert plan_splits([32768], 8, **bounded) == wave and wave.num_splits == 16
    del bounded["max_split_bytes"]  # FEW_SPLITS_MAX_BYTES by default
    assert plan_splits([32768], 8, **bounded).num_splits == 8
    with pytest.raises(ValueError, match="max_split_bytes"):
        plan_splits([4096], 8, **bounded, max_split_bytes=0)


def test_ragged_short_rows_count_the_ctas_they_launch():
    # One row of 4096 and two of 100 tokens, 8 K/V heads: 4 splits give 8 x 4 + 16 x 1 = 48 CTAs.
    plan = short_rows([4096, 100, 100], 8, 47)
    assert plan.num_splits == 4 and plan.splits_per_seq.tolist() == [4, 1, 1]


def test_rows_too_short_to_saturate_are_left_to_the_wave_model():
    plan = short_rows([512], 8, 47)  # 4 chunks: 32 CTAs at most, short of 47
    assert plan == plan_splits([512], 8, chunk_size=128, num_sms=132, ctas_per_sm=2) and plan.num_splits == 4


def test_empty_rows_do_not_count_as_streaming_ctas():
    # One row of 8192 tokens and five empty ones, 8 K/V heads: 48 rows, but 8 stream; dense would
    # leave 8 CTAs streaming 4 MiB each. The rule takes 8 splits (64 streaming CTAs) instead.
    plan = short_rows([8192] + [0] * 5, 8, 47)
    assert plan.variant == "split" and plan.splits_per_seq.tolist() == [8, 1, 1, 1, 1, 1]


def test_the_power_of_two_preference_counts_the_splits_chunk_rounding_leaves():
    # 16 rows of 2561 tokens, 94 saturating CTAs: 6 splits of 512 tokens give 96 CTAs, the fewest
    # that reach it; candidates 7 to 10 all round to 7 splits of 384 (not a power of two, though
    # candidate 8 is), and 11 or more splits take more CTAs than SMs. So 6.
    plan = short_rows([2561] * 2, 8, 94, bytes_per_token=256)
    assert plan.num_splits == 6 and plan.num_ctas == 96


def test_the_short_row_rule_needs_both_of_its_arguments():
    with pytest.raises(ValueError, match="both or neither"):
        plan_splits([4096], 8, chunk_size=128, num_sms=132, ctas_per_sm=2, saturating_ctas=47)
    with pytest.raises(ValueError, match="saturating_ctas"):
        short_rows([4096], 8, 0)


@given(problems(), st.integers(1, 8))
@settings(max_examples=300, deadline=None)
def test_pack_heads_invariants(problem, warps):
    plan = run(problem)
    heads = problem["num_kv_heads"]
    if plan.variant != "dense" or warps < 2 or heads % warps:
        with pytest.raises(ValueError, match="warp_heads"):
            pack_heads(plan, heads, warps=warps)
        return
    # A dense plan whose CTAs each take `warps` whole rows; nothing else changes.
    packed = pack_heads(plan, heads, warps=warps)
    assert packed.heads_per_cta == warps and packed.num_ctas * warps == plan.num_ctas
    assert packed != plan and dataclasses.replace(packed, heads_per_cta=1, num_ctas=plan.num_ctas) == plan
    assert f"{warps} K/V heads per CTA" in describe(packed)


@given(problems(), st.integers(1, 8))
@settings(max_examples=300, deadline=None)
def test_the_planner_packs_heads_only_where_a_wave_stays_full(problem, warps):
    plan = run(problem)
    heads, sms = problem["num_kv_heads"], problem["num_sms"]
    wanted = wants_packed_heads(plan, heads, warps=warps, num_sms=sms)
    packable = plan.variant == "dense" and warps >= 2 and heads % warps == 0
    assert wanted == (packable and plan.num_ctas // warps >= WARP_HEADS_SHARE * sms)
    if wanted:  # and what it wants, pack_heads can do
        assert pack_heads(plan, heads, warps=warps).num_ctas >= WARP_HEADS_SHARE * sms


def test_the_planner_packs_the_batches_that_still_fill_a_wave():
    def dense(batch, length):
        return plan_splits([length] * batch, 8, chunk_size=128, num_sms=132, ctas_per_sm=1)
    assert wants_packed_heads(dense(64, 1024), 8, warps=4, num_sms=132)  # 128 CTAs
    assert wants_packed_heads(dense(128, 512), 8, warps=4, num_sms=132)  # 256 CTAs
    assert not wants_packed_heads(dense(16, 4096), 8, warps=4, num_sms=132)  # 32 CTAs: too few
    assert not wants_packed_heads(dense(64, 1024), 6, warps=4, num_sms=132)  # heads not a multiple
    split = plan_splits([65536], 8, chunk_size=128, num_sms=132, ctas_per_sm=1)
    assert split.variant == "split" and not wants_packed_heads(split, 8, warps=4, num_sms=132)


def test_plans_that_differ_only_in_heads_per_cta_differ():
    plan = plan_splits([1024] * 64, 8, chunk_size=128, num_sms=132, ctas_per_sm=1)
    other = dataclasses.replace(plan, heads_per_cta=4)  # same CTA count on purpose: only the field differs
    assert plan != other and len({plan, other}) == 2
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="heads_per_cta"):
            dataclasses.replace(plan, heads_per_cta=bad)
    split = plan_splits([65536], 8, chunk_size=128, num_sms=132, ctas_per_sm=1)
    with pytest.raises(ValueError, match="heads_per_cta"):
        dataclasses.replace(split, heads_per_cta=4)
    with pytest.raises(ValueError, match="at least 2"):
        pack_heads(plan, 8, warps=1)


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


# ---- fit_clusters: cluster size and re-splitting, against a fake occupancy table -----------------

#: Resident clusters of each size on an H200 with one CTA per SM (as the driver reported).
_H200_ONE_CTA_PER_SM = {2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15, 9: 9, **{c: 7 for c in range(10, 17)}}
_H200_WHOLE_ROW = whole_row_ctas(132)


def _fit(lens, heads, splits, *, resident=_H200_ONE_CTA_PER_SM.get, may_resplit=True, bytes_per_token=512):
    plan = fixed_plan(lens, heads, variant="split", chunk_size=128, num_splits=splits)
    return plan, fit_clusters(plan, lens, heads, chunk_size=128, max_cluster=16, resident_clusters=resident,
                              kv_bytes_per_token=bytes_per_token, may_resplit=may_resplit)


def test_whole_row_clusters_over_about_half_the_sms():
    assert _H200_WHOLE_ROW == (64, 72)
    for lens, heads, splits, expected in [
        ([65536], 8, 16, (8, 8192)),        # 8 rows: clusters of 8 on 64 SMs, not 16 splits and the global merge
        ([524288], 8, 12, (8, 65536)),      # (9 would fit too, but a power of two goes first)
        ([20000], 5, 8, (14, 1536)),        # 5 rows: no power of two in the share, so clusters of 14
        ([4096], 8, 16, (8, 512)),           # 9 chunks of 128 do not fit 4096 tokens better than 8
        ([1024], 8, 8, (8, 128)),
        ([65536, 30000], 8, 8, (4, 16384)),  # 16 rows: clusters of 4 on 64 SMs
        ([65536], 4, 24, (16, 4096)),        # 4 rows: clusters of 16
    ]:
        plan = fixed_plan(lens, heads, variant="split", chunk_size=128, num_splits=splits)
        chosen, cluster = fit_clusters(plan, lens, heads, chunk_size=128, max_cluster=16,
                                       resident_clusters=_H200_ONE_CTA_PER_SM.get, kv_bytes_per_token=512,
                                       whole_row_ctas=_H200_WHOLE_ROW)
        assert (cluster, chosen.tokens_per_split) == expected, (lens, heads)
        assert chosen.num_splits == cluster and chosen.num_ctas == len(lens) * heads * cluster


@pytest.mark.parametrize("lens, heads", [([65536], 32), ([65536] * 4, 8), ([16384], 2), ([65536], 1), ([200], 8)])
def test_no_whole_row_clusters_outside_the_share_or_for_short_rows(lens, heads):
    # 32 rows would need pairs (under the smallest size), 1-2 rows too few SMs even in clusters
    # of 16, 200 tokens too few chunks: the other rules decide, as without whole-row clusters.
    plan = fixed_plan(lens, heads, variant="split", chunk_size=128, num_splits=4)
    args = dict(chunk_size=128, max_cluster=16, resident_clusters=_H200_ONE_CTA_PER_SM.get, kv_bytes_per_token=512)
    assert fit_clusters(plan, lens, heads, **args, whole_row_ctas=_H200_WHOLE_ROW) == fit_clusters(plan, lens, heads, **args)


def test_whole_row_clusters_need_every_row_resident_and_a_free_choice():
    plan = fixed_plan([65536], 8, variant="split", chunk_size=128, num_splits=16)
    args = dict(chunk_size=128, max_cluster=16, kv_bytes_per_token=512, whole_row_ctas=_H200_WHOLE_ROW)
    chosen, cluster = fit_clusters(plan, [65536], 8, resident_clusters={**_H200_ONE_CTA_PER_SM, 8: 7}.get, **args)
    assert cluster == 9  # 8 clusters of 8 no longer resident: 8 of 9
    assert fit_clusters(plan, [65536], 8, resident_clusters=lambda c: None, **args) == (plan, 1)
    assert fit_clusters(plan, [65536], 8, resident_clusters=_H200_ONE_CTA_PER_SM.get, may_resplit=False,
                        **args) == (plan, 1)


def test_cluster_when_the_split_count_fits():
    plan, (chosen, cluster) = _fit([1024], 8, 8)
    assert cluster == 8 and chosen == plan


def test_no_cluster_when_clusters_are_not_all_resident_and_splits_are_long():
    # 8 rows of 16 splits: only 7 clusters of 16 are resident; 8 splits of 8192 tokens stream too long.
    plan, (chosen, cluster) = _fit([65536], 8, 16)
    assert cluster == 1 and chosen == plan


def test_short_splits_are_traded_for_a_cluster():
    plan, (chosen, cluster) = _fit([4096], 8, 16)
    assert plan.num_splits == 16
    assert cluster == 8 and chosen.num_splits == 8 and chosen.tokens_per_split == 512


def test_forced_plans_are_not_resplit():
    plan, (chosen, cluster) = _fit([4096], 8, 16, may_resplit=False)
    assert cluster == 1 and chosen == plan


def test_unknown_occupancy_means_no_cluster():
    plan, (chosen, cluster) = _fit([1024], 8, 8, resident=lambda c: None)
    assert cluster == 1 and chosen == plan


def test_non_power_of_two_split_counts():
    # 6 splits become 4 of 768 tokens: 192 KiB each at 256 bytes per token, under the limit...
    plan, (chosen, cluster) = _fit([3000], 2, 6, bytes_per_token=256)
    assert plan.num_splits == 6
    assert cluster == 4 and chosen.num_splits == 4
    # ...but 384 KiB at 512 bytes per token: the six splits stay, merged through global memory.
    plan, (chosen, cluster) = _fit([3000], 2, 6, bytes_per_token=512)
    assert cluster == 1 and chosen == plan


def test_rows_of_many_splits_run_as_several_clusters():
    # One K/V head, 64 long splits: as many clusters of 16 as are resident but one (6 of 7), each
    # leaving one partial for the last CTA; chunk rounding gives 86 splits, padded to 96.
    plan, (chosen, cluster) = _fit([65536], 1, 64)
    assert cluster == 16 and chosen.num_splits == 96 and chosen.num_ctas == 96
    assert int(chosen.splits_per_seq.max()) == 86 and chosen.tokens_per_split == 768
    # 128 splits become 96 in clusters of 16 (not 128 in 64 pairs).
    plan, (chosen, cluster) = _fit([524288], 1, 128)
    assert cluster == 16 and chosen.num_splits == 96
    # Two rows: three clusters of 16 each (47 splits, padded to 48).
    plan, (chosen, cluster) = _fit([65536], 2, 45)
    assert cluster == 16 and chosen.num_splits == 48 and int(chosen.splits_per_seq.max()) == 47
    assert int(chosen.splits_per_seq.max()) * chosen.tokens_per_split >= 65536
    # Four rows: two clusters of 16 per row would not leave one spare; three of 8 per row do.
    plan, (chosen, cluster) = _fit([65536, 65536], 2, 32)
    assert cluster == 8 and chosen.num_splits == 24 and chosen.num_ctas == 4 * 24
    # A forced plan keeps its count, which must be a multiple of the cluster (43 once rounded: none).
    plan, (chosen, cluster) = _fit([65536], 2, 45, may_resplit=False)
    assert cluster == 1 and chosen == plan
    plan, (chosen, cluster) = _fit([65536], 2, 32, may_resplit=False)
    assert cluster == 16 and chosen == plan
    # No split under a chunk: a row of 2 x 16 chunks gets two clusters of 16 at most.
    plan, (chosen, cluster) = _fit([4096], 1, 32, bytes_per_token=1 << 20)
    assert cluster == 16 and chosen.num_splits == 32 and chosen.tokens_per_split == 128


def test_several_clusters_per_row_need_the_fused_merge_and_more_splits_than_a_cluster():
    plan = fixed_plan([65536], 1, variant="split", chunk_size=128, num_splits=64)
    assert fit_clusters(plan, [65536], 1, chunk_size=128, max_cluster=16, resident_clusters=_H200_ONE_CTA_PER_SM.get,
                        kv_bytes_per_token=512, multi_cluster=False) == (plan, 1)
    # 16 splits of 8 rows: no single cluster fits and a row has no more splits than one cluster.
    plan, (chosen, cluster) = _fit([65536], 8, 16)
    assert cluster == 1 and chosen == plan


def test_dense_plans_have_no_cluster():
    plan = fixed_plan([100, 50], 2, variant="dense", chunk_size=128)
    assert fit_clusters(plan, [100, 50], 2, chunk_size=128, max_cluster=16, resident_clusters=lambda c: 99,
                        kv_bytes_per_token=512) == (plan, 1)


@settings(max_examples=300, deadline=None)
@given(problems(), st.sampled_from([1, 2, 4, 8, 9, 16]), st.booleans(), st.booleans(),
       st.fixed_dictionaries({c: st.one_of(st.none(), st.integers(0, 80)) for c in range(2, 17)}),
       st.one_of(st.none(), st.sampled_from([(64, 72), (8, 40), (1, 300)])))
def test_fit_clusters_invariants(problem, max_cluster, may_resplit, multi_cluster, resident_table, whole_row):
    # Whatever the occupancy table says: a cluster size divides the grid, every row's tokens are
    # still covered, all clusters of the grid are resident, and a forced plan keeps its splits.
    plan = run(problem)
    lens = problem["seq_lens"]
    rows = lens.size * problem["num_kv_heads"]
    chosen, cluster = fit_clusters(plan, lens, problem["num_kv_heads"], chunk_size=problem["chunk_size"],
                                   max_cluster=max_cluster, resident_clusters=resident_table.get,
                                   kv_bytes_per_token=512, may_resplit=may_resplit, multi_cluster=multi_cluster,
                                   whole_row_ctas=whole_row)
    if plan.variant == "dense":
        assert (chosen, cluster) == (plan, 1)
        return
    assert chosen.variant == "split" and 1 <= cluster <= max_cluster
    if cluster & (cluster - 1):  # sizes other than powers of two come from whole-row clusters alone
        assert whole_row is not None and chosen.num_splits == cluster
        assert whole_row[0] <= rows * cluster <= whole_row[1]
    assert chosen.num_splits % cluster == 0 and chosen.num_ctas == rows * chosen.num_splits
    assert int(chosen.splits_per_seq.max()) <= chosen.num_splits
    assert chosen.num_splits - int(chosen.splits_per_seq.max()) < max(cluster, 1)  # padding: under one cluster
    assert np.all(chosen.splits_per_seq * chosen.tokens_per_split >= lens)
    assert chosen.tokens_per_split % problem["chunk_size"] == 0
    if cluster > 1:
        held = resident_table[cluster]
        assert held is not None and rows * chosen.num_splits // cluster <= held
        if chosen.num_splits > cluster:
            assert multi_cluster  # several clusters per row only where the fused merge is there
    if not may_resplit:
        assert chosen.tokens_per_split == plan.tokens_per_split and chosen.num_splits == plan.num_splits


@settings(max_examples=300, deadline=None)
@given(problems())
def test_the_short_row_rule_keeps_to_its_split_bound(problem):
    """Where the short-row rule's plan is not the wave model's, no split streams more than the bound
    (``max_split_bytes``, by default FEW_SPLITS_MAX_BYTES) of K/V."""
    assume("saturating_ctas" in problem)
    waves = run({k: v for k, v in problem.items()
                 if k not in ("saturating_ctas", "kv_bytes_per_token", "max_split_bytes")})
    plan = run(problem)
    bound = problem.get("max_split_bytes") or FEW_SPLITS_MAX_BYTES
    if plan != waves:
        assert plan.tokens_per_split * problem["kv_bytes_per_token"] <= bound


@settings(max_examples=200, deadline=None)
@given(problems())
def test_dense_regardless_means_dense_under_both_rules(problem):
    p = dict(problem)
    lens = p["seq_lens"]
    regardless = dense_regardless(lens.size * p["num_kv_heads"], int(lens.max()), chunk_size=p["chunk_size"],
                                  num_sms=p["num_sms"], ctas_per_sm=p["ctas_per_sm"])
    if regardless:
        assert run(problem).variant == "dense"
        waves = {k: v for k, v in problem.items() if k not in ("saturating_ctas", "kv_bytes_per_token")}
        assert run(waves).variant == "dense"
