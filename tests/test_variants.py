"""The attention variants on the CPU: their arguments checked, the programs they compile into
(`KernelSpec.with_variant`: names, row blocks, the MMA layout), the tokens the planner sees with a
window (against the programs' own formula), and what plan() and run() launch for them on the fake
GPU of tests/fake_gpu.py: the grid's row blocks, the fields of the programs' arguments, the
workspace, and the sinks' array."""

from __future__ import annotations

import math

import numpy as np
import pytest

from splitkv import runtime
from splitkv.choices import WARP_ROWS
from splitkv.codegen.compile import compile_cubin
from splitkv.heuristics import default_spec
from splitkv.params import DECODE
from splitkv.spec import KernelSpec, MergeSpec
from splitkv.variants import PLAIN, check_variant
from tests.fake_gpu import _DeviceArray, _qkv, fake_gpu  # noqa: F401 - fake_gpu: a fixture, used by name

SPLIT = default_spec("sm_90", 128, 4, "bf16", "bf16", "split")


@pytest.mark.parametrize("args, error, match", [
    ((0, -1, 0.0, False), ValueError, "query_tokens"),
    ((17, -1, 0.0, False), ValueError, "query_tokens"),
    ((1.0, -1, 0.0, False), TypeError, "query_tokens"),
    ((1, -2, 0.0, False), ValueError, "window_left"),
    ((1, True, 0.0, False), TypeError, "window_left"),
    ((1, -1, -1.0, False), ValueError, "logits_soft_cap"),
    ((1, -1, float("nan"), False), ValueError, "logits_soft_cap"),
    ((1, -1, 1e39, False), ValueError, "logits_soft_cap"),
    ((1, -1, "30", False), TypeError, "logits_soft_cap"),
    ((1, -1, 0.0, 1), TypeError, "sinks"),
])
def test_bad_variant_arguments_are_refused_by_name(args, error, match):
    with pytest.raises(error, match=match):
        check_variant(*args)


def test_the_variant_of_plain_arguments_is_plain():
    assert check_variant(1, -1, 0.0, False) == PLAIN and PLAIN.is_plain
    assert PLAIN.of(SPLIT) is SPLIT
    v = check_variant(4, 100, 30, True)
    assert v.compiled == (4, True, True, True) and math.isclose(v.soft_cap_log2, 30 / math.log(2))


@pytest.mark.parametrize("group, tokens, slices, blocks, rows", [
    (4, 1, 1, 1, 4), (4, 4, 1, 1, 16), (8, 2, 1, 1, 16), (8, 4, 2, 1, 32), (7, 4, 2, 1, 28), (5, 5, 2, 1, 25),
    (16, 16, 4, 4, 64), (1, 16, 1, 1, 16), (3, 7, 2, 1, 21), (4, 12, 4, 1, 48), (16, 5, 4, 2, 40),
])
def test_row_slices_and_blocks_cover_the_rows(group, tokens, slices, blocks, rows):
    """Rows past a warp's 16 take row slices (a power of two, up to the CTA's four warps here), rows
    past those further row blocks, evenly."""
    spec = default_spec("sm_90", 128, group, "bf16", "bf16", "split").with_variant(query_tokens=tokens)
    assert (spec.row_slices, spec.row_blocks, spec.cta_rows) == (slices, blocks, rows)
    assert spec.row_blocks * spec.cta_rows >= group * tokens > (spec.row_blocks - 1) * spec.cta_rows
    assert WARP_ROWS * spec.row_slices // 2 < spec.cta_rows <= WARP_ROWS * spec.row_slices or spec.row_slices == 1
    assert spec.token_streams * spec.row_slices == spec.warps
    assert spec.ring_bytes == spec.token_streams * spec.stages * 2 * spec.tile_bytes
    assert spec.mma_rows == (8 if rows <= 8 else 16)
    # Tokens on the MMA rows hold the rows as 8 columns: past 8 rows the heads layout takes over.
    assert spec.mma_m == ("tokens" if group * tokens <= 8 else "heads")


def test_variant_programs_are_named_and_validated():
    spec = SPLIT.with_variant(query_tokens=4, window=True, soft_cap=True, sinks=True)
    assert spec.name == SPLIT.name.replace("-mt", "") + "-q4-win-cap-sink"
    assert SPLIT.with_variant().name == SPLIT.name and not SPLIT.has_variant
    with pytest.raises(ValueError, match="warp_heads"):
        SPLIT.as_dense().replace(warp_heads=True, query_tokens=2)
    with pytest.raises(ValueError, match="units"):
        SPLIT.as_units().replace(warps=1).with_variant(query_tokens=8)  # 32 rows in one warp: two row blocks
    with pytest.raises(ValueError, match="mma_m"):
        SPLIT.replace(query_tokens=4)  # 16 rows on the 8 columns of mma_m='tokens'
    with pytest.raises(TypeError, match="window"):
        SPLIT.replace(window=1)


def test_tables_and_results_hold_plain_programs_as_before():
    assert set(SPLIT.to_dict()) == set(KernelSpec.__dataclass_fields__) - {"query_tokens", "window", "soft_cap", "sinks"}
    spec = SPLIT.with_variant(query_tokens=2, sinks=True)
    assert KernelSpec.from_dict(spec.to_dict()) == spec


def _window_begin_as_the_programs_do(length, tokens, window, align):
    """merge.cuh's window_begin, transcribed."""
    if window < 0:
        return 0
    first = max(length - tokens - window, 0)
    return first - first % align


@pytest.mark.parametrize("tokens, window, align", [(1, 0, 32), (4, 100, 32), (16, 4095, 16), (2, 10**6, 64)])
def test_the_planner_sees_the_tokens_the_programs_stream(tokens, window, align):
    variant = check_variant(tokens, window, 0.0, False)
    lengths = np.arange(tokens, 20000, 37, dtype=np.int64)
    begins = variant.window_begin(lengths, align)
    assert [int(b) for b in begins] == [_window_begin_as_the_programs_do(int(n), tokens, window, align)
                                        for n in lengths]
    planned = variant.planned_lengths(lengths, align)
    # Every query's window lies inside the tokens streamed, and no more than a tile precedes it.
    first_query_start = np.maximum(lengths - tokens - window, 0)
    assert (begins <= first_query_start).all() and (first_query_start - begins < align).all()
    assert (planned == lengths - begins).all() and (planned <= window + tokens + align).all()


def test_a_window_plans_only_the_window(fake_gpu):
    attn = runtime.DecodeAttention(32, 8, 128, tuned=False, q_dtype="fp16", kv_dtype="fp16")
    short = attn.plan([4096])
    windowed = attn.plan([65536], window_left=4095)
    # The window's 4096 tokens (and at most a tile before them) plan as a 4096-token sequence does.
    assert (windowed.variant, windowed.num_splits) == (short.variant, short.num_splits)
    assert windowed.tokens_per_split <= short.tokens_per_split + SPLIT.tile_tokens
    q, k, v = _qkv(1, 32, 8, 128, 65536)
    attn.run(q, k, v, out=_DeviceArray((1, 32, 128)))
    params = fake_gpu.launches[-1].params
    assert params["window_left"] == 4095 and params["soft_cap_log2"] == 0.0 and params["sinks"] == 0


def test_query_tokens_launch_row_blocks_and_size_the_workspace(fake_gpu):
    # 16 query heads x 16 tokens per K/V head: 256 rows, past the 8 warps' 128 rows: two row blocks.
    attn = runtime.DecodeAttention(64, 4, 128, tuned=False, q_dtype="fp16", kv_dtype="fp16")
    plan = attn.plan([30000, 20000], query_tokens=16, logits_soft_cap=50.0, sinks=True, variant="split", num_splits=4)
    spec = attn._launch.spec
    assert (spec.query_tokens, spec.row_slices, spec.row_blocks, spec.cta_rows, spec.soft_cap, spec.sinks) == (
        16, 8, 2, 128, True, True)
    assert plan.num_splits == 4 and attn._launch.grid == (4, 4 * 2, 2)
    partial_o, partial_lse, counters = attn._launch.workspace
    assert partial_lse.size >= 2 * 4 * 4 * 2 * 128 and partial_o.size >= partial_lse.size * 128
    q = _DeviceArray((2, 16, 64, 128))
    _, k, v = _qkv(2, 64, 4, 128, 30000)
    sinks = _DeviceArray((64,), "<f4")
    attn.run(q, k, v, out=_DeviceArray((2, 16, 64, 128)), sinks=sinks)
    params = fake_gpu.launches[-1].params
    assert params["sinks"] == sinks.__cuda_array_interface__["data"][0]
    assert math.isclose(params["soft_cap_log2"], 50.0 / math.log(2), rel_tol=1e-6)
    with pytest.raises(ValueError, match="sinks=True"):
        attn.run(q, k, v, out=_DeviceArray((2, 16, 64, 128)))
    with pytest.raises(ValueError, match="sinks"):
        attn.run(q, k, v, out=_DeviceArray((2, 16, 64, 128)), sinks=_DeviceArray((64,), "<f2"))
    with pytest.raises(ValueError, match="query token"):
        attn.run(*_qkv(2, 64, 4, 128, 30000), out=_DeviceArray((2, 64, 128)), sinks=sinks)


def test_variants_never_reach_the_units_program_they_cannot_serve(fake_gpu):
    attn = runtime.DecodeAttention(32, 8, 128, tuned=False)
    ragged = [60000] + [64] * 40  # routed to units without a variant
    assert attn.plan(ragged).__class__.__name__ == "UnitPlan"
    assert attn.plan(ragged, window_left=1000).__class__.__name__ == "SplitPlan"
    assert attn.plan(ragged, query_tokens=8).__class__.__name__ == "UnitPlan"  # 32 rows: two row slices
    assert attn._launch.spec.row_slices == 2 and attn._launch.spec.row_blocks == 1
    assert attn.plan(ragged, query_tokens=2, sinks=True).__class__.__name__ == "UnitPlan"
    assert attn._launch.spec.query_tokens == 2 and attn._launch.spec.variant == "units"
    wide = runtime.DecodeAttention(64, 4, 128, tuned=False)  # 16 x 16 rows per K/V head: two row blocks
    assert wide.plan(ragged, query_tokens=16).__class__.__name__ == "SplitPlan"


def test_plans_of_several_tokens_take_no_warp_per_kv_head(fake_gpu):
    attn = runtime.DecodeAttention(32, 8, 128, tuned=False)
    assert attn.plan([1024] * 64).heads_per_cta == 4
    assert attn.plan([1024] * 64, query_tokens=2).heads_per_cta == 1
    with pytest.raises(ValueError, match="warp_heads"):
        attn.plan([1024] * 64, query_tokens=2, warp_heads=True)


@pytest.mark.parametrize("changes", [
    dict(query_tokens=4, window=True, soft_cap=True, sinks=True),
    dict(query_tokens=8, window=True),
    dict(query_tokens=3, sinks=True, cluster=8),
])
def test_variant_programs_compile_without_spills(changes):
    for base in (SPLIT, SPLIT.as_dense(), default_spec("sm_90", 256, 8, "bf16", "fp8_e4m3", "split"),
                 default_spec("sm_90", 64, 16, "bf16", "nvfp4", "dense", page_size=16)):
        if base.variant == "dense" and "cluster" in changes:
            continue
        spec = base.with_variant(changes["query_tokens"], changes.get("window", False), changes.get("soft_cap", False),
                                 changes.get("sinks", False))
        if "cluster" in changes:
            spec = spec.replace(cluster=changes["cluster"])
        result = compile_cubin(spec)
        # Quantized K/V at head_dim 256 with 16 rows per warp hold 128 accumulators and 64 registers
        # of Q beside the unpacked K/V at the 255-register limit: there ptxas spills a few words
        # (the one-token shapes and 16-bit K/V do not).
        at_limit = spec.head_dim == 256 and spec.kv_dtype != "bf16" and spec.mma_rows == 16
        assert result.spill_bytes <= (128 if at_limit else 0), spec.name
    for tables in (False, True):
        assert compile_cubin(MergeSpec(head_dim=256, tables=tables)).spill_bytes == 0


def test_the_decode_struct_holds_the_variants_run_time_values():
    for name in ("sinks", "window_left", "soft_cap_log2"):
        assert name in DECODE.offset


def test_batch_invariant_plans_split_each_sequence_by_its_own_length(fake_gpu):
    from splitkv.plan import BATCH_INVARIANT_TOKENS

    attn = runtime.DecodeAttention(32, 8, 128)
    spec_before = attn.split_spec
    for lens in ([5000], [5000, 300, 70000], [300] * 64 + [5000], [1]):
        plan = attn.plan(lens, deterministic=True)
        assert plan.variant == "split" and plan.tokens_per_split == BATCH_INVARIANT_TOKENS
        assert list(plan.splits_per_seq) == [max(1, -(-n // BATCH_INVARIANT_TOKENS)) for n in lens]
        spec = attn._launch.spec
        # One program whatever the workload: the instance's own, in no cluster, merged in split order.
        assert spec == spec_before.replace(cluster=1) and attn.tuned_entry is None
        assert attn._launch.grid == (plan.num_splits, 8, len(lens))
    with pytest.raises(ValueError, match="deterministic"):
        attn.plan([5000], deterministic=True, num_splits=3)
    with pytest.raises(TypeError, match="deterministic"):
        attn.plan([5000], deterministic=1)
    # With a window, the window's tokens are split alike.
    plan = attn.plan([70000, 100], deterministic=True, window_left=4000)
    assert plan.tokens_per_split == BATCH_INVARIANT_TOKENS and plan.splits_per_seq[0] == -(-(4000 + 1 + 31) // 1024)


def test_a_given_shape_of_several_tokens_serves_its_own_tokens(fake_gpu):
    """Row slices share rings, so a shape of 8 tokens (two slices, four stages) may hold more rings
    than one token's would: an instance given it plans its own tokens with it, and says why it
    cannot plan one token."""
    eight = default_spec("sm_90", 128, 4, query_tokens=8)
    assert eight.row_slices == 2 and eight.stages == 4
    with pytest.raises(ValueError, match="shared memory"):
        eight.with_variant(1)
    attn = runtime.DecodeAttention(32, 8, 128, spec=eight)
    attn.plan([30000], query_tokens=8)
    assert attn._launch.spec == eight
    attn.plan([30000], query_tokens=8, logits_soft_cap=30.0)
    assert attn._launch.spec == eight.with_variant(8, soft_cap=True)
    with pytest.raises(ValueError, match="serves 8 query token"):
        attn.plan([30000])
