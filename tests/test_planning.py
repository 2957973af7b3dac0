"""The planning policy (`splitkv.planning.choose_plan`) on the CPU: its rules, and that
`DecodeAttention.plan` launches what it chooses (on the fake H200 of tests/fake_gpu.py)."""

import subprocess
import sys
import types

import numpy as np
import pytest

from splitkv import planning
from splitkv.heuristics import default_spec, few_splits_max_bytes, resident_ctas_per_sm, saturating_ctas
from splitkv.plan import SplitPlan, fit_clusters, plan_splits_unchecked
from splitkv.work_units import UnitPlan
from tests.fake_gpu import fake_gpu  # noqa: F401 - a fixture, used by name

SMS = 132
HEADS = 8
REGISTERS = 96  # what the fake GPU's compiler reports
SPLIT = default_spec("sm_90", 128, 4, "bf16", "bf16").replace(variant="split")
DENSE = default_spec("sm_90", 128, 4, "bf16", "bf16", "dense")
PROGRAMS = planning.Programs(SPLIT, DENSE)


def _gpu(saturating=saturating_ctas(SPLIT), resident_clusters=lambda cluster: SMS // cluster):
    return planning.GpuFacts(SMS, resident_ctas_per_sm(SPLIT, REGISTERS), saturating, few_splits_max_bytes(SPLIT),
                             resident_clusters)


def _choose(lens, programs=PROGRAMS, gpu=None, **kwargs):
    lens = np.asarray(lens, dtype=np.int64)
    return planning.choose_plan(lens, int(lens.max()), HEADS, programs, gpu or _gpu(), **kwargs)


def _waves(lens, gpu):
    lens = np.asarray(lens, dtype=np.int64)
    return plan_splits_unchecked(lens, int(lens.max()), HEADS, SPLIT.chunk_size, SMS, gpu.ctas_per_sm)


def test_rows_that_fill_the_gpu_run_dense_with_a_warp_per_kv_head():
    choice = _choose([4096] * 64)  # 512 rows on 132 SMs
    assert choice.plan.variant == "dense" and choice.plan.heads_per_cta > 1
    assert choice.spec == DENSE.replace(warp_heads=True) and not choice.merge
    unpacked = _choose([4096] * 64, warp_heads=False)
    assert unpacked.plan.heads_per_cta == 1 and unpacked.spec == DENSE


def test_few_rows_split_into_clusters_that_merge_in_place():
    choice = _choose([131072])
    assert choice.plan.variant == "split" and choice.plan.num_splits > 1
    assert choice.spec == SPLIT.replace(cluster=choice.spec.cluster) and choice.spec.cluster > 1
    assert not choice.merge  # the cluster (and the fused merge) merge: no merge program
    assert choice.plan.tokens_per_split % choice.spec.tile_tokens == 0


def test_clusters_shrink_to_what_is_resident():
    roomy = _choose([131072])
    tight = _choose([131072], gpu=_gpu(resident_clusters=lambda cluster: SMS if cluster <= 2 else 0))
    assert roomy.spec.cluster > 2 >= tight.spec.cluster
    lens = np.asarray([131072], dtype=np.int64)
    expected = fit_clusters(_waves(lens, _gpu()), lens, HEADS, chunk_size=SPLIT.chunk_size, max_cluster=SPLIT.cluster,
                            resident_clusters=lambda cluster: SMS if cluster <= 2 else 0,
                            kv_bytes_per_token=SPLIT.kv_bytes_per_token, multi_cluster=SPLIT.fused_merge)
    assert (tight.plan, tight.spec.cluster) == expected


def test_the_short_row_rule_takes_fewer_longer_splits_than_the_wave_model():
    lens = [4096] * 4
    gpu = _gpu()
    ruled = _choose(lens, gpu=gpu).plan
    waves = _choose(lens, gpu=_gpu(saturating=None)).plan  # no saturating count: the wave model alone
    assert ruled.num_splits < waves.num_splits
    assert waves.num_splits == _waves(lens, gpu).num_splits
    # Rows the rule keeps dense where the wave model splits them.
    assert _choose([8192] * 8).plan.variant == "dense"
    assert _choose([8192] * 8, gpu=_gpu(saturating=None)).plan.variant == "split"


def test_a_tuned_program_measured_by_the_wave_model_keeps_it():
    measured = types.SimpleNamespace(planner="waves", spec=SPLIT)
    tuned = planning.Programs(SPLIT, DENSE, tuned=measured)
    assert _choose([4096] * 4, tuned).plan == _choose([4096] * 4, gpu=_gpu(saturating=None)).plan
    # An entry of another split program says nothing of this one: the rule applies.
    other = planning.Programs(SPLIT, DENSE, tuned=types.SimpleNamespace(planner="waves", spec=DENSE))
    assert _choose([4096] * 4, other).plan == _choose([4096] * 4).plan


def test_a_tuned_dense_program_that_serves_these_rows_forces_dense():
    forced = planning.Programs(SPLIT, DENSE, tuned_forces_dense=True)
    assert _choose([4096] * 4).plan.variant == "split"
    assert _choose([4096] * 4, forced).plan.variant == "dense"
    assert _choose([4096] * 4, forced, variant="split").plan.variant == "split"  # an override still wins


def test_a_long_row_among_short_ones_goes_to_units():
    lens = [65536] + [64] * 31
    choice = _choose(lens)
    assert isinstance(choice.plan, UnitPlan) and choice.spec == SPLIT.as_units() and choice.merge
    # Lengths that may grow after the plan cannot be covered by units.
    assert isinstance(_choose(lens, may_grow=True).plan, SplitPlan)
    # Equal rows gain nothing from units.
    assert isinstance(_choose([65536] * 2).plan, SplitPlan)


def test_units_requests_refuse_what_units_cannot_honour():
    with pytest.raises(ValueError, match="neither num_splits nor warp_heads"):
        _choose([4096], variant="units", num_splits=2)
    with pytest.raises(ValueError, match="may not grow up to max_len=4096"):
        _choose([4096], variant="units", may_grow=True)
    assert isinstance(_choose([4096], variant="units").plan, UnitPlan)


def test_the_choice_is_deterministic_and_uses_the_callers_programs():
    made = []

    def in_clusters(cluster):
        made.append(cluster)
        return SPLIT.replace(cluster=cluster)

    kept = planning.Programs(SPLIT, DENSE, in_clusters=in_clusters)
    first, second = _choose([131072, 300], kept), _choose([131072, 300], kept)
    assert first == second and made == [first.spec.cluster] * 2


def test_planning_needs_no_device_library():
    code = "import sys, splitkv.planning; sys.exit('cupy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


SWEEP = [[1], [0, 0], [64] * 2, [4096] * 4, [4096] * 64, [8192] * 8, [131072], [131072, 300],
         [65536] + [64] * 31, [1000, 20000, 3, 70000], [2048] * 16, [32768] * 33]


@pytest.mark.parametrize("variant", [None, "split", "dense", "units"])
def test_the_runtime_launches_what_the_planner_chooses(fake_gpu, variant):
    from splitkv import DecodeAttention

    attn = DecodeAttention(32, HEADS, 128, tuned=False)
    gpu = _gpu()
    for lens in SWEEP:
        planned = attn.plan(lens, variant=variant)
        choice = _choose(lens, gpu=gpu if variant != "units" else planning.GpuFacts(
            SMS, resident_ctas_per_sm(SPLIT.as_units(), REGISTERS)), variant=variant)
        assert planned == choice.plan, lens
        assert attn._launch.spec == choice.spec, lens
        assert (attn._launch.merge_fn is not None) == choice.merge, lens


@pytest.mark.parametrize("tokens, group, one_token_shape", [(16, 16, False), (8, 16, True), (16, 8, True)])
def test_row_blocks_of_one_kv_head_stream_as_many_splits_as_the_bytes_need(tokens, group, one_token_shape):
    """Rows of several row blocks per K/V head (query heads x tokens past every warp's 16) have
    every block's CTA read the same K/V bytes: a long row gets the splits one block per head
    would get (up to one wave), not 1 / row_blocks of them (the wave model plans them: see
    `heuristics.saturating_ctas`). The built-in shape of 256 rows, and the 4-warp one-token shape
    an instance keeps for 128."""
    if one_token_shape:
        split = default_spec("sm_90", 128, group).with_variant(query_tokens=tokens)
        dense = default_spec("sm_90", 128, group, variant="dense").with_variant(query_tokens=tokens)
    else:
        split = default_spec("sm_90", 128, group, query_tokens=tokens)
        dense = default_spec("sm_90", 128, group, variant="dense", query_tokens=tokens)
    assert split.row_blocks > 1
    gpu = planning.GpuFacts(SMS, resident_ctas_per_sm(split, REGISTERS), saturating_ctas(split),
                            few_splits_max_bytes(split))
    one_block = _choose([32768]).plan  # one token, one row block per head
    for length in (4096, 32768, 65536):
        lens = np.array([length], dtype=np.int64)
        plan = planning.choose_plan(lens, length, HEADS * split.row_blocks, planning.Programs(split, dense), gpu,
                                    allow_units=False).plan
        assert plan.variant == "split" and plan.num_ctas <= SMS * gpu.ctas_per_sm, (length, plan)  # one wave
        # as many CTAs as one block per head streams with, or a wave's worth of whole rows
        assert plan.num_ctas >= min(one_block.num_ctas * split.row_blocks, SMS - SMS % (HEADS * split.row_blocks)), plan
