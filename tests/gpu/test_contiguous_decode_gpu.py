"""GPU correctness of the decode programs over contiguous caches against a float64 reference
(marker: gpu): lengths, ragged batches, head dims and groups, CTA shapes, clusters and merges,
the K/V copy paths, the MMA layouts, a warp per K/V head and Q and K/V of different types.

Every case draws fresh random inputs, poisons the output with NaN before the call and checks
every element. The reference runs in float64 on the GPU (CuPy) over the exact bf16/fp16 values
the kernel reads, so the only error measured is the kernel's own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from splitkv import DecodeAttention  # noqa: E402
from splitkv.heuristics import default_spec  # noqa: E402

from decode_checks import _rng, check_close, fresh_seed, poisoned, random_values, reference  # noqa: E402

pytestmark = pytest.mark.gpu


def run_case(head_dim, group, lens, *, variant=None, num_splits=None, dtype="bf16", num_kv_heads=2,
             max_len=None, spec_changes=None, q_scale=1.0, nan_tail=False, expect_cluster=None, warp_heads=None):
    lens = [int(n) for n in lens]
    max_len = max_len or max(max(lens), 1)
    batch = len(lens)
    seed = int(_rng(head_dim, group, tuple(lens), variant, dtype).integers(2**31))
    num_qo = num_kv_heads * group
    q, q64 = random_values((batch, num_qo, head_dim), dtype, seed, q_scale)
    k, k64 = random_values((batch, max_len, num_kv_heads, head_dim), dtype, seed + 1)
    v, v64 = random_values((batch, max_len, num_kv_heads, head_dim), dtype, seed + 2)
    if nan_tail:  # the cache past each length holds NaN: none of it may reach the output
        nan_bits = 0x7FC0 if dtype == "bf16" else np.float16(np.nan).view(np.uint16)
        for b, n in enumerate(lens):
            k.view(cupy.uint16)[b, n:] = nan_bits
            v.view(cupy.uint16)[b, n:] = nan_bits
    spec = None
    if spec_changes:
        spec = default_spec("sm_90", head_dim, group, dtype, dtype).replace(**spec_changes)
    # A case about the planner's layouts takes the built-in programs (tuned=False): the layout it
    # checks follows from their largest cluster, which a tuned table may set otherwise.
    attn = DecodeAttention(num_qo, num_kv_heads, head_dim, q_dtype=dtype, kv_dtype=dtype, spec=spec,
                           tuned=expect_cluster is None)
    plan = attn.plan(lens, variant=variant, num_splits=num_splits, warp_heads=warp_heads)
    if warp_heads is not None:  # the layout the test is about was really planned
        assert attn._launch.spec.warp_heads == warp_heads and (plan.heads_per_cta > 1) == warp_heads, attn.plan_info
    if expect_cluster == "several":  # rows of more than one cluster each
        assert 1 < attn._launch.spec.cluster < plan.num_splits, attn.plan_info
    elif expect_cluster == "whole_row":  # one cluster per row, of any size
        assert 1 < attn._launch.spec.cluster == plan.num_splits, attn.plan_info
    elif expect_cluster is not None:  # the layout the test is about was really planned
        assert attn._launch.spec.cluster == expect_cluster, attn.plan_info
    out = poisoned((batch, num_qo, head_dim), dtype)
    lse = cupy.full((batch, num_qo), cupy.nan, dtype=cupy.float32)
    attn.run(q, k, v, out=out, lse=lse)
    ref_out, ref_lse = reference(q64, k64, v64, lens, 1.0 / math.sqrt(head_dim))
    label = f"D={head_dim} G={group} {dtype} lens={lens[:4]}{'...' if batch > 4 else ''} {attn.plan_info}"
    check_close(out, lse, ref_out, ref_lse, lens, dtype, label)
    return plan


LENGTHS = [1, 7, 129, 1000, 4096, 65536, 131072, 1000 + 77]  # the last is no multiple of any chunk
HEAD_DIMS = [64, 96, 128, 256]
GROUPS = [1, 2, 4, 8, 16]


@pytest.mark.parametrize("variant", ["dense", "split"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_single_sequence_lengths(head_dim, group, variant):
    # The longest lengths run with one K/V head, which keeps their float64 reference quick.
    for n in LENGTHS:
        plan = run_case(head_dim, group, [n], variant=variant, num_splits=8 if n > 1000 else 3,
                        num_kv_heads=1 if n >= 65536 else 2)
        assert plan.variant == variant


@pytest.mark.parametrize("variant", ["dense", "split"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_ragged_batches(head_dim, group, variant):
    rng = _rng("ragged", head_dim, group, variant)
    lens8 = [0, 1, 7, 129, 1077, 4096, int(rng.integers(1, 5000)), int(rng.integers(1, 5000))]
    run_case(head_dim, group, lens8, variant=variant, num_splits=6)
    lens64 = rng.integers(0, 2048, size=64)
    lens64[:3] = [0, 1, 2047]
    run_case(head_dim, group, lens64, variant=variant, num_splits=5, num_kv_heads=1)


@pytest.mark.parametrize("group", [1, 4, 8, 16])
def test_planner_choice_and_extreme_logits(group):
    # The planner's own choice, and logits of magnitude ~1e3 that overflow a naive exp.
    run_case(128, group, [65536], num_kv_heads=8 // min(group, 8))
    run_case(128, group, [4096], num_kv_heads=8 // min(group, 8))  # short splits: a cluster merge
    run_case(128, group, [3000, 5, 0, 4096], q_scale=300.0)


@pytest.mark.parametrize("changes", [
    {"fused_merge": False, "cluster": 1},
    {"fused_merge": False, "cluster": 4},
    {"fused_merge": False, "cluster": 8},  # rows of 8 splits keep their cluster: no separate merge
    {"cluster": 1},
    {"cluster": 2},
    {"cluster": 8},
    {"warps": 8, "tile_tokens": 16, "chunk_size": 128},
    {"warps": 2, "tile_tokens": 64, "chunk_size": 128, "stages": 2},
    {"warps": 4, "tile_tokens": 16, "stages": 4, "chunk_size": 64},
    {"warps": 1, "tile_tokens": 32, "stages": 3, "chunk_size": 64},
    {"kv_copy": "cp_async"},
    {"kv_copy": "cp_async", "cluster": 1},
    {"kv_copy": "cp_async", "cluster": 4, "stages": 3},
    {"kv_copy": "cp_async", "warps": 8, "tile_tokens": 16, "chunk_size": 128},
    {"mma_m": "tokens", "kv_copy": "cp_async"},
    {"mma_m": "tokens", "warps": 8, "tile_tokens": 16, "chunk_size": 128, "cluster": 1},
    {"mma_m": "tokens", "warps": 2, "tile_tokens": 64, "chunk_size": 128, "kv_copy": "cp_async"},
    {"kv_copy": "tma"},
    {"kv_copy": "tma", "cluster": 1},
    {"kv_copy": "tma", "warps": 8, "tile_tokens": 16, "stages": 3, "chunk_size": 128},
    {"kv_copy": "tma", "mma_m": "tokens", "warps": 2, "tile_tokens": 64, "chunk_size": 128},
    {"kv_copy": "tma", "cluster": 4, "stages": 3},
])
def test_cta_shapes_clusters_and_separate_merge(changes):
    # 8 and 16 splits: one cluster per row, or rows spanning several clusters merged through
    # global memory (cluster 1, 2, 4 and 8 of 16 splits).
    for variant, splits in (("dense", None), ("split", 8), ("split", 16)):
        run_case(128, 4, [1, 777, 5000, 0], variant=variant, num_splits=splits, spec_changes=changes)


@pytest.mark.parametrize("variant", ["dense", "split"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_tensor_copies(head_dim, variant):
    # K/V tiles as swizzled boxes through tensor maps: head_dims of one, two and four boxes, groups
    # 1 to 16, fp16 too, NaN past ragged lengths (the boxes fetch whole tiles past them), one long
    # row. (Boxes reaching past the end of the tensor, zero-filled by the copy engine, are the
    # single-sequence tests' tails, e.g. length 7 or 1077, now that tensor maps are the default.)
    for group in (1, 4, 16):
        run_case(head_dim, group, [0, 1, 33, 1077, 4096, 3], variant=variant, num_splits=5, nan_tail=True,
                 max_len=4100, spec_changes={"kv_copy": "tma"})
    run_case(head_dim, 2, [1000, 77], variant=variant, num_splits=3, dtype="fp16", spec_changes={"kv_copy": "tma"})
    run_case(head_dim, 8, [65536], variant=variant, num_splits=16, num_kv_heads=1, spec_changes={"kv_copy": "tma"})


def test_tensor_maps_follow_the_cache():
    # One DecodeAttention over two caches in turn: each call must read the cache it is given
    # (the tensor maps are kept per cache address), including the first one again.
    group, dim, lens = 4, 128, [700, 2000]
    spec = default_spec("sm_90", dim, group).replace(kv_copy="tma")
    attn = DecodeAttention(2 * group, 2, dim, spec=spec)
    attn.plan(lens, variant="split", num_splits=4)
    q, q64 = random_values((2, 2 * group, dim), "bf16", fresh_seed(51))
    caches = [tuple(random_values((2, 2048, 2, dim), "bf16", fresh_seed(52 + 2 * i + j)) for j in range(2)) for i in range(2)]
    for i in (0, 1, 0):
        (k, k64), (v, v64) = caches[i]
        out = poisoned((2, 2 * group, dim), "bf16")
        attn.run(q, k, v, out=out)
        ref_out, _ = reference(q64, k64, v64, lens, 1 / math.sqrt(dim))
        check_close(out, None, ref_out, None, lens, "bf16", f"cache {i}")


@pytest.mark.parametrize("variant", ["dense", "split"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_tokens_on_the_mma_rows(head_dim, variant):
    # K and V as the MMAs' A operands (16 tokens per MMA), Q and P as B (the heads as columns):
    # every head_dim, groups 1 to 8, lengths ending mid-tile, NaN past the lengths, one long row.
    changes = {"mma_m": "tokens"}
    for group in (1, 2, 4, 8):
        run_case(head_dim, group, [0, 1, 7, 33, 1077, 4096], variant=variant, num_splits=5, spec_changes=changes,
                 nan_tail=True, max_len=4200)
    run_case(head_dim, 4, [65536], variant=variant, num_splits=16, num_kv_heads=1, spec_changes=changes)
    run_case(head_dim, 8, [3000, 5, 0, 4096], spec_changes=changes, q_scale=300.0)  # extreme logits


@pytest.mark.parametrize("kv_copy", ["cp_async", "tma"])
@pytest.mark.parametrize("variant", ["dense", "split"])
def test_nan_in_the_cache_past_the_length_never_leaks(variant, kv_copy):
    # The first tiles are fetched before the length is known, so rows past it reach shared memory.
    for head_dim, group in ((128, 4), (64, 16), (256, 1)):
        run_case(head_dim, group, [0, 1, 17, 100, 1000, 250], max_len=1100, variant=variant, num_splits=4,
                 spec_changes={"kv_copy": kv_copy}, nan_tail=True)


@pytest.mark.parametrize("head_dim, group", [(128, 4), (64, 16), (256, 8), (96, 1)])
@pytest.mark.parametrize("cluster, splits, lens", [(16, 32, [65536, 5000, 0]), (16, 64, [65536]),
                                                   (8, 32, [65536, 129]), (2, 64, [65536, 3000])])
def test_rows_of_several_clusters(head_dim, group, cluster, splits, lens):
    # Each cluster merges its splits in shared memory and writes one partial; the row's last CTA
    # merges those. Shorter rows leave whole clusters empty; NaN past the lengths. (Few rows, so
    # that every cluster is resident at once, as the planner requires.)
    run_case(head_dim, group, lens, variant="split", num_splits=splits, num_kv_heads=1, max_len=65536,
             spec_changes={"cluster": cluster}, nan_tail=True, expect_cluster=cluster)
    run_case(head_dim, group, [65536], variant="split", num_splits=splits, num_kv_heads=1,
             spec_changes={"cluster": cluster, "kv_copy": "cp_async"}, q_scale=100.0, expect_cluster=cluster)


@pytest.mark.parametrize("head_dim, group", [(128, 4), (64, 8), (256, 2)])
@pytest.mark.parametrize("lens, num_kv_heads", [([20000], 5), ([20000], 6), ([20000], 7), ([65536], 8),
                                                ([20000, 9000], 5), ([20000, 9000], 6), ([20000, 0], 7),
                                                ([9000, 20000], 8)])
def test_whole_row_clusters_of_any_size(head_dim, group, lens, num_kv_heads):
    # 5 to 16 rows over about half the SMs: one cluster per row of 4 to 14 CTAs (on an H200: 14,
    # 12, 10, 8, 7, 6, 5 and 4; powers of two first), ragged rows leaving CTAs that stream nothing but still merge.
    plan = run_case(head_dim, group, lens, num_kv_heads=num_kv_heads, expect_cluster="whole_row")
    print(f"{len(lens)} x {num_kv_heads} rows: clusters of {plan.num_splits}")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 4, 8, 16])
def test_a_warp_per_kv_head(head_dim, group):
    # Each warp streams its own K/V head of the CTA's sequence; ragged sequences, empty ones included.
    lens = [0, 1, 7, 129, 1000, 1000 + 77, 4096, 33]
    run_case(head_dim, group, lens, variant="dense", num_kv_heads=8, warp_heads=True)
    run_case(head_dim, group, lens[1:4], variant="dense", num_kv_heads=4, warp_heads=True, nan_tail=True)


@pytest.mark.parametrize("kv_copy", ["cp_async", "tma"])
def test_planner_gives_batches_of_many_rows_a_warp_per_kv_head(kv_copy):
    # 64 ragged sequences x 8 K/V heads: the planner's own choice, 128 CTAs of four rows each
    # where that still fills a wave (132 SMs); on a GPU of more SMs, 512 one-row CTAs.
    from splitkv.plan import WARP_HEADS_SHARE

    lens = _rng("many rows", kv_copy).integers(0, 1500, size=64)
    plan = run_case(128, 4, lens, num_kv_heads=8, spec_changes={"kv_copy": kv_copy}, warp_heads=None)
    num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    packed = 128 >= WARP_HEADS_SHARE * num_sms
    assert plan.variant == "dense" and plan.heads_per_cta == (4 if packed else 1)
    assert plan.num_ctas == (128 if packed else 512)
    run_case(128, 4, lens, variant="dense", num_kv_heads=8, spec_changes={"kv_copy": kv_copy}, warp_heads=False)
    run_case(64, 2, lens, variant="dense", num_kv_heads=8, dtype="fp16", warp_heads=True)


def test_planner_takes_several_clusters_for_rows_of_many_splits():
    # One K/V head over a long context: more splits than one cluster, merged in two levels.
    plan = run_case(128, 8, [65536], num_kv_heads=1, expect_cluster="several")
    assert plan.variant == "split"


@pytest.mark.parametrize("fused_merge", [True, False])
def test_merge_of_many_splits(fused_merge):
    # More than 32 splits per row: the merge runs over several groups of 32 log-sum-exps and
    # several batches of 16 partials, rescaling what it has summed when a later group's max is larger.
    changes = {"fused_merge": fused_merge, "cluster": 1}
    run_case(128, 4, [5000, 3000, 0, 2500], variant="split", num_splits=40, spec_changes=changes)
    run_case(64, 8, [9000, 70], variant="split", num_splits=70, spec_changes=changes, q_scale=30.0)
    # The planner's own choice for a short, wide row of head_dim 256.
    plan = run_case(256, 8, [16384], num_kv_heads=2)
    print(f"D=256, 16k, 2 K/V heads: {plan.num_splits} splits, {plan.num_ctas} CTAs")
    assert plan.variant == "split" and plan.num_splits > 1


def test_cluster_merge_is_used_where_it_fits():
    # 8 splits of 2 rows: two clusters of 8, resident at once on any sm_90 part.
    attn_probe = run_case(128, 4, [3000, 1500], variant="split", num_splits=8)
    assert attn_probe.num_splits == 8
    attn = DecodeAttention(8, 2, 128)
    attn.plan([3000, 1500], variant="split", num_splits=8)
    assert attn._launch.spec.cluster == 8, attn.plan_info
    # 16 rows of 16 splits cannot all be resident with one CTA per SM: global merge instead.
    attn.plan([4096] * 8, variant="split", num_splits=16)
    fits = attn._max_active_clusters(16)
    print(f"clusters of 16 resident at once: {fits}")
    assert attn._launch.spec.cluster == (16 if fits is not None and fits >= 16 else 1)


@pytest.mark.parametrize("q_dtype, kv_dtype", [("fp16", "bf16"), ("bf16", "fp16")])
def test_q_and_kv_of_different_types(q_dtype, kv_dtype):
    # Q is converted to the K/V type for the MMAs; the output comes back in Q's type.
    lens = [3000, 1, 0, 777]
    q, q64 = random_values((4, 8, 128), q_dtype, fresh_seed(61))
    k, k64 = random_values((4, 3000, 2, 128), kv_dtype, fresh_seed(62))
    v, v64 = random_values((4, 3000, 2, 128), kv_dtype, fresh_seed(63))
    for variant, splits in (("dense", None), ("split", 6)):
        attn = DecodeAttention(8, 2, 128, q_dtype=q_dtype, kv_dtype=kv_dtype)
        attn.plan(lens, variant=variant, num_splits=splits)
        out = poisoned((4, 8, 128), q_dtype)
        lse = cupy.full((4, 8), cupy.nan, dtype=cupy.float32)
        attn.run(q, k, v, out=out, lse=lse)
        ref_out, ref_lse = reference(q64, k64, v64, lens, 1.0 / math.sqrt(128))
        check_close(out, lse, ref_out, ref_lse, lens, q_dtype, f"q {q_dtype} kv {kv_dtype} {attn.plan_info}",
                    tol_dtype="bf16")


def test_fp16():
    run_case(128, 4, [1, 1500, 40000], variant="split", num_splits=9, dtype="fp16")
    run_case(64, 8, [300, 0], variant="dense", dtype="fp16")
