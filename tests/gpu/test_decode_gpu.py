"""GPU correctness of the decode programs against a float64 reference (marker: gpu).

Every case draws fresh random inputs, poisons the output with NaN before the call and checks
every element. The reference runs in float64 on the GPU (CuPy) over the exact bf16/fp16 values
the kernel reads, so the only error measured is the kernel's own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import seeds

cupy = pytest.importorskip("cupy")

import splitkv  # noqa: E402
from splitkv import DecodeAttention, KernelSpec  # noqa: E402
from splitkv.heuristics import default_spec  # noqa: E402

pytestmark = pytest.mark.gpu

#: bf16: 8 significant bits in P and in the output; fp16: 11.
REL_TOL = {"bf16": 1e-2, "fp16": 3e-3}
#: A generator per key, from the run's seed (tests/seeds.py; SPLITKV_TEST_SEED replays a run).
_rng = seeds.rng


def fresh_seed(n: int) -> int:
    """Seed ``n`` of this run: a test's numbered inputs are a new draw every run (as `_rng`'s are;
    SPLITKV_TEST_SEED replays a run)."""
    return int(_rng("numbered seed", n).integers(2**31))


# ---- random inputs as the kernel sees them ---------------------------------------------------------
def random_values(shape, dtype: str, seed: int, scale: float = 1.0):
    """(device array in the kernel's storage type, float64 device copy of the exact values)."""
    gen = cupy.random.default_rng(seed)
    x = gen.standard_normal(shape, dtype=cupy.float32) * scale
    if dtype == "fp16":
        stored = x.astype(cupy.float16)
        return stored, stored.astype(cupy.float64)
    bits = x.view(cupy.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    stored = rounded.astype(cupy.uint16)
    return stored, (stored.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)


def to_float64(stored, dtype: str):
    if dtype == "fp16":
        return stored.astype(cupy.float64)
    return (stored.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)


def poisoned(shape, dtype: str):
    """An output buffer full of NaN (bf16 NaN bits in CuPy's uint16 storage)."""
    if dtype == "bf16":
        return cupy.full(shape, 0x7FC0, dtype=cupy.uint16)
    return cupy.full(shape, cupy.nan, dtype=cupy.float16)


def reference(q64, k64, v64, lens, sm_scale):
    """float64 attention per sequence: out [B, Hq, D], natural-log lse [B, Hq]."""
    batch, num_qo, dim = q64.shape
    num_kv = k64.shape[2]
    group = num_qo // num_kv
    out = cupy.zeros((batch, num_qo, dim), cupy.float64)
    lse = cupy.full((batch, num_qo), -cupy.inf, cupy.float64)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        qg = q64[b].reshape(num_kv, group, dim)
        scores = cupy.einsum("hgd,lhd->hgl", qg, k64[b, :n]) * sm_scale
        m = scores.max(axis=2, keepdims=True)
        p = cupy.exp(scores - m)
        total = p.sum(axis=2, keepdims=True)
        out[b] = (cupy.einsum("hgl,lhd->hgd", p, v64[b, :n]) / total).reshape(num_qo, dim)
        lse[b] = (m + cupy.log(total)).reshape(num_qo)
    return out, lse


def check_close(out, lse, ref_out, ref_lse, lens, dtype, label, tol_dtype=None):
    out_dtype, dtype = dtype, tol_dtype or dtype  # the bound follows the type the products are taken in
    out64 = to_float64(out, out_dtype)
    assert bool(cupy.isfinite(out64).all()), f"{label}: non-finite output (unwritten or NaN)"
    err = out64 - ref_out
    rel = float(cupy.linalg.norm(err) / max(float(cupy.linalg.norm(ref_out)), 1e-30))
    # Element-wise: within the format's rounding of the element plus a share of its row's scale.
    row_scale = cupy.abs(ref_out).max(axis=2, keepdims=True)
    bound = REL_TOL[dtype] * (cupy.abs(ref_out) + row_scale)
    worst = float((cupy.abs(err) - bound).max())
    print(f"{label}: rel err {rel:.2e}")
    assert rel < REL_TOL[dtype], f"{label}: relative error {rel:.3e}"
    assert worst <= 0, f"{label}: an element is off by {worst:.3e} beyond its bound"
    empty = np.flatnonzero(np.asarray(lens) == 0)
    if empty.size:
        assert bool((out64[empty] == 0).all()), f"{label}: empty sequence must give zeros"
    if lse is not None:
        lse_h, ref_h = cupy.asnumpy(lse).astype(np.float64), cupy.asnumpy(ref_lse)
        finite = np.isfinite(ref_h)
        assert np.array_equal(np.isneginf(lse_h), ~finite), f"{label}: lse -inf exactly for empty rows"
        # Absolute, per row, so that a lost tile breaks it (at 131072 random tokens a 32-token
        # tile moves the LSE by about 2.4e-4, twice the bound there): the float32 sums of up
        # to 2^17 exponentials and the approximate exp2 and log2 (2e-5), and the float32
        # roundings of the scaled logits, which grow with them (2^-17 of |lse|: the dot's
        # accumulation over head_dim products, the scale, the max, the merges). Where Q is
        # converted to another type for the MMAs (``tol_dtype``) the logits carry its rounding
        # (bf16: 2^-9 of each product), so the bound follows their magnitude as before.
        magnitude = np.abs(ref_h[finite])
        if tol_dtype is not None and tol_dtype != out_dtype:
            lse_bound = 1e-3 * np.maximum(1.0, magnitude.max(initial=1.0))
        else:
            lse_bound = 2e-5 + 2.0 ** -17 * magnitude
        lse_err = np.abs(lse_h[finite] - ref_h[finite])
        over = np.flatnonzero(lse_err > lse_bound)
        if finite.any():
            print(f"{label}: lse err {lse_err.max():.2e} ({(lse_err / lse_bound).max():.2f} of its bound)")
        assert over.size == 0, (f"{label}: lse off by {lse_err[over[0]]:.3e} at |lse| {magnitude[over[0]]:.3g}, bound "
                                f"{np.broadcast_to(lse_bound, lse_err.shape)[over[0]]:.2e} ({over.size} rows over)")


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


def test_return_lse_and_default_path():
    q, q64 = random_values((3, 8, 128), "bf16", fresh_seed(11))
    k, k64 = random_values((3, 2000, 2, 128), "bf16", fresh_seed(12))
    v, v64 = random_values((3, 2000, 2, 128), "bf16", fresh_seed(13))
    lens = [2000, 1, 999]
    out, lse = splitkv.decode(q, k, v, lens, return_lse=True)
    ref_out, ref_lse = reference(q64, k64, v64, lens, 1 / math.sqrt(128))
    check_close(out, lse, ref_out, ref_lse, lens, "bf16", "decode() default")
    # seq_lens=None means every sequence is full; a device int32 array is read back to plan.
    out_full = splitkv.decode(q, k, v)
    ref_full, _ = reference(q64, k64, v64, [2000] * 3, 1 / math.sqrt(128))
    check_close(out_full, None, ref_full, None, [2000] * 3, "bf16", "decode() seq_lens=None")
    out_dev = splitkv.decode(q, k, v, cupy.asarray(lens, dtype=cupy.int32), sm_scale=0.05)
    ref_dev, _ = reference(q64, k64, v64, lens, 0.05)
    check_close(out_dev, None, ref_dev, None, lens, "bf16", "decode() device seq_lens, sm_scale")


def test_empty_cache_and_empty_batch():
    # k.shape[1] == 0 (every length 0): zeros and lse = -inf, through the tensor maps' stand-in tile
    # on sm_90+; B = 0: empty results and no launch.
    q, _ = random_values((2, 8, 128), "bf16", fresh_seed(21))
    k = cupy.zeros((2, 0, 2, 128), dtype=cupy.uint16)
    out = poisoned((2, 8, 128), "bf16")
    splitkv.decode(q, k, k, out=out)
    assert int(cupy.count_nonzero(out)) == 0  # every element written, as +0.0 (bf16 bits 0)
    attn = DecodeAttention(8, 2, 128)
    attn.plan([0, 0])
    out, lse = poisoned((2, 8, 128), "bf16"), cupy.full((2, 8), cupy.nan, dtype=cupy.float32)
    attn.run(q, k, k, out=out, lse=lse)
    assert int(cupy.count_nonzero(out)) == 0
    assert bool(cupy.all(cupy.isneginf(lse)))
    empty_q = cupy.zeros((0, 8, 128), dtype=cupy.uint16)
    out, lse = splitkv.decode(empty_q, k[:0], k[:0], return_lse=True)
    assert out.shape == (0, 8, 128) and lse.shape == (0, 8)


@pytest.mark.parametrize("changes, num_kv, lens, variant", [
    ({}, 4, [3000, 17, 8000, 0], "split"),
    ({"kv_copy": "cp_async"}, 4, [3000, 17, 8000, 0], "split"),
    ({"kv_copy": "cp_async"}, 1, [8000, 17, 3000, 0], "split"),
    ({"kv_copy": "tma"}, 4, [3000, 17, 8000, 0], "split"),
    ({}, 4, [3000, 17, 8000, 0], "dense, a warp per K/V head")])
def test_cuda_graph_capture_and_replay(changes, num_kv, lens, variant):
    # The merge counters must be back at zero after every launch; with one K/V head the 8000-token
    # row spans several clusters, so the merge counter is reset by the last CTA of a two-level merge.
    group, dim = 4, 128
    q, q64 = random_values((4, num_kv * group, dim), "bf16", fresh_seed(21))
    k, k64 = random_values((4, 8192, num_kv, dim), "bf16", fresh_seed(22))
    v, v64 = random_values((4, 8192, num_kv, dim), "bf16", fresh_seed(23))
    device_lens = cupy.asarray(lens, dtype=cupy.int32)
    spec = default_spec("sm_90", dim, group).replace(**changes)
    attn = DecodeAttention(num_kv * group, num_kv, dim, spec=spec)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # the inputs were written on the default stream, which `stream` does not wait for
    # Reads the lengths and zeroes the counters on `stream`. One K/V head: 32 splits of 256 tokens,
    # more than the resident clusters of 16, 8 or 4 hold for 4 rows, so pairs of splits.
    if variant == "split":
        plan = attn.plan(device_lens, variant="split", num_splits=32 if num_kv == 1 else None, stream=stream)
    else:
        plan = attn.plan(device_lens, variant="dense", warp_heads=True, stream=stream)
        assert attn._launch.spec.warp_heads and plan.heads_per_cta == 4, attn.plan_info
    assert plan.variant == variant.split(",")[0]
    if num_kv == 1:
        assert 1 < attn._launch.spec.cluster < plan.num_splits, attn.plan_info
    out = cupy.empty((4, num_kv * group, dim), cupy.uint16)
    lse = cupy.empty((4, num_kv * group), cupy.float32)
    with stream:
        attn.run(q, k, v, out=out, lse=lse)  # warm: nothing left to load lazily
        stream.begin_capture()
        attn.run(q, k, v, out=out, lse=lse)
        graph = stream.end_capture()
    for replay, new_lens in enumerate([lens, [2999, 8000, 1, 4000]]):
        # New data and (within the plan) new lengths, written in place; poisoned outputs.
        device_lens.set(np.asarray(new_lens, np.int32))
        q[...], q64[...] = random_values(q.shape, "bf16", 30 + replay)
        k[...], k64[...] = random_values(k.shape, "bf16", 40 + replay)
        out[...] = poisoned(out.shape, "bf16")
        lse.fill(cupy.nan)
        cupy.cuda.Device().synchronize()  # the writes above ran on the default stream
        graph.launch(stream)
        stream.synchronize()
        ref_out, ref_lse = reference(q64, k64, v64, new_lens, 1 / math.sqrt(dim))
        check_close(out, lse, ref_out, ref_lse, new_lens, "bf16", f"graph replay {replay}")


def test_torch_tensors_and_stream():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 5000, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 5000, 8, 128, device="cuda", dtype=torch.bfloat16)
    lens = [5000, 1234]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out, lse = splitkv.decode(q, k, v, lens, return_lse=True)
    side.synchronize()
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == q.shape
    ref_out, ref_lse = reference(cupy.asarray(q.double()), cupy.asarray(k.double()), cupy.asarray(v.double()),
                                 lens, 1 / math.sqrt(128))
    out_bits = cupy.asarray(out.view(torch.int16)).view(cupy.uint16)
    check_close(out_bits, cupy.asarray(lse), ref_out, ref_lse, lens, "bf16", "torch on a side stream")


class InterfaceOnly:
    """Exposes an array only through __cuda_array_interface__, as an unknown library would."""

    def __init__(self, array):
        self.__cuda_array_interface__ = array.__cuda_array_interface__
        self._keep = array


class DLPackOnly:
    """Exposes an array only through the DLPack protocol."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


@pytest.mark.parametrize("wrap", [InterfaceOnly, DLPackOnly])
def test_foreign_arrays_without_copies(wrap):
    q, q64 = random_values((2, 8, 128), "fp16", fresh_seed(51))
    k, k64 = random_values((2, 3000, 2, 128), "fp16", fresh_seed(52))
    v, v64 = random_values((2, 3000, 2, 128), "fp16", fresh_seed(53))
    lens = [3000, 1234]
    out, lse = splitkv.decode(wrap(q), wrap(k), wrap(v), lens, return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.shape == q.shape and out.dtype == cupy.float16
    ref_out, ref_lse = reference(q64, k64, v64, lens, 1 / math.sqrt(128))
    check_close(out, lse, ref_out, ref_lse, lens, "fp16", f"{wrap.__name__} inputs")
    given = poisoned(q.shape, "fp16")
    attn = DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16")
    attn.plan(lens)
    assert attn.run(wrap(q), wrap(k), wrap(v), out=wrap(given)) is not None
    check_close(given, None, ref_out, None, lens, "fp16", f"{wrap.__name__} out=")


def test_bad_inputs_raise():
    q, _ = random_values((2, 8, 128), "bf16", fresh_seed(1))
    k, _ = random_values((2, 100, 2, 128), "bf16", fresh_seed(2))
    with pytest.raises(ValueError, match="seq_lens"):
        splitkv.decode(q, k, k, [101, 3])
    with pytest.raises(ValueError, match="k"):
        splitkv.decode(q, k[:, :, :, :64], k[:, :, :, :64], [1, 2])
    with pytest.raises(ValueError, match="v"):
        splitkv.decode(q, k, k[:, ::2], [1, 2])


def test_layout_cache_still_checks_alignment_and_foreign_lse():
    # After one validated call, a misaligned out, or an lse seen only through
    # __cuda_array_interface__ with the wrong size, must still be refused.
    q, _ = random_values((2, 8, 128), "bf16", fresh_seed(3))
    k, _ = random_values((2, 300, 2, 128), "bf16", fresh_seed(4))
    attn = DecodeAttention(8, 2, 128)
    attn.plan([300, 20])
    lse = cupy.empty((2, 8), cupy.float32)
    attn.run(q, k, k, out=cupy.empty((2, 8, 128), cupy.uint16), lse=lse)
    shifted = cupy.empty(2 * 8 * 128 + 1, cupy.uint16)[1:].reshape(2, 8, 128)  # 2 bytes off
    with pytest.raises(ValueError, match="out"):
        attn.run(q, k, k, out=shifted, lse=lse)  # the same layout as the first call but for alignment
    attn.run(q, k, k, out=cupy.empty((2, 8, 128), cupy.uint16), lse=InterfaceOnly(lse))
    with pytest.raises(ValueError, match="lse"):
        attn.run(q, k, k, out=cupy.empty((2, 8, 128), cupy.uint16), lse=InterfaceOnly(cupy.empty(3, cupy.float32)))


def test_lengths_may_grow_up_to_max_len():
    # A plan made with max_len covers lengths rewritten in place up to it (CUDA-graph replays).
    q, q64 = random_values((1, 8, 128), "bf16", fresh_seed(5))
    k, k64 = random_values((1, 8192, 2, 128), "bf16", fresh_seed(6))
    v, v64 = random_values((1, 8192, 2, 128), "bf16", fresh_seed(7))
    device_lens = cupy.asarray([1000], dtype=cupy.int32)
    attn = DecodeAttention(8, 2, 128)
    attn.plan(device_lens, max_len=8192)
    for n in (1000, 5000, 8192):
        device_lens.fill(n)
        out = poisoned((1, 8, 128), "bf16")
        attn.run(q, k, v, out=out)
        ref_out, ref_lse = reference(q64, k64, v64, [n], 1 / math.sqrt(128))
        check_close(out, None, ref_out, ref_lse, [n], "bf16", f"grown to {n}: {attn.plan_info}")


def test_spec_mismatch_is_refused():
    with pytest.raises(ValueError, match="spec"):
        DecodeAttention(8, 2, 128, spec=KernelSpec(head_dim=64, group_size=4))


# ---- streams and devices ----------------------------------------------------------------------------
_SPIN = cupy.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}''', "spin")


def _busy(stream, ms: float = 100.0):
    """Keeps ``stream`` busy for about ``ms``: work queued after it there waits that long."""
    rate_khz = cupy.cuda.Device().attributes["ClockRate"]
    with stream:
        _SPIN((1,), (1,), (np.int64(ms * rate_khz),))


@pytest.mark.gpu_exclusive  # races the host against a busy kernel: the GPU to itself in a parallel run
def test_plan_and_run_on_different_streams_are_ordered():
    # plan() writes the lengths on one stream, run() launches on another: each must see the
    # other's work in call order, although a busy kernel holds back the stream that goes first.
    q, q64 = random_values((2, 8, 128), "bf16", fresh_seed(61))
    k, k64 = random_values((2, 4000, 2, 128), "bf16", fresh_seed(62))
    v, v64 = random_values((2, 4000, 2, 128), "bf16", fresh_seed(63))
    planner, runner = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # the inputs were written on the default stream
    attn = DecodeAttention(8, 2, 128)
    lens_a, lens_b, lens_c = [4000, 4000], [1500, 3999], [2500, 10]
    # Warm: every kernel the guarded calls below launch has been launched once (the plans'
    # programs, the poisoning fill, the busy kernel), and the layout validated. A kernel's first
    # launch loads its module (CUDA's lazy loading), which can wait for the busy kernel and leave
    # nothing to test: run alone, this test failed that way, and passed after other tests.
    for lens in (lens_b, lens_c, lens_a):
        attn.plan(lens, stream=planner)
        attn.run(q, k, v, out=poisoned((2, 8, 128), "bf16"), stream=runner)
    _busy(runner, 0.0)
    cupy.cuda.Device().synchronize()

    # The run is held back: the next plan must not overwrite its lengths before it reads them.
    attn.plan(lens_a, stream=planner)
    _busy(runner)
    out_a = poisoned((2, 8, 128), "bf16")
    attn.run(q, k, v, out=out_a, stream=runner)
    attn.plan(lens_b, stream=planner)
    assert not runner.done, "the busy kernel ended before the next plan was queued: nothing was tested"
    runner.synchronize()
    planner.synchronize()

    # The plan's writes are held back: the run on the other stream must wait for them.
    _busy(planner)
    attn.plan(lens_c, stream=planner)
    out_c = poisoned((2, 8, 128), "bf16")
    attn.run(q, k, v, out=out_c, stream=runner)
    assert not planner.done, "the busy kernel ended before the run was queued: nothing was tested"
    runner.synchronize()

    # Captured on another stream than the plan's, the wait becomes a node of the graph.
    attn.plan(lens_b, stream=planner)
    out_g = poisoned((2, 8, 128), "bf16")
    runner.begin_capture()
    attn.run(q, k, v, out=out_g, stream=runner)
    graph = runner.end_capture()
    graph.launch(runner)
    runner.synchronize()
    for out, lens, label in ((out_a, lens_a, "run before the next plan"), (out_c, lens_c, "run after a held-back plan"),
                             (out_g, lens_b, "graph captured on the run's stream")):
        ref_out, _ = reference(q64, k64, v64, lens, 1 / math.sqrt(128))
        check_close(out, None, ref_out, None, lens, "bf16", f"{label}: {attn.plan_info}")


@pytest.mark.gpu_exclusive  # races the host against a busy kernel: the GPU to itself in a parallel run
def test_run_waits_for_the_stream_an_interface_names():
    # An array seen only through __cuda_array_interface__ whose producer still writes it on its
    # own stream ('stream' in the interface): the kernel must read the finished values.
    q_old, _ = random_values((2, 8, 128), "bf16", fresh_seed(71))
    q_new, q64 = random_values((2, 8, 128), "bf16", fresh_seed(72))
    k, k64 = random_values((2, 3000, 2, 128), "bf16", fresh_seed(73))
    v, v64 = random_values((2, 3000, 2, 128), "bf16", fresh_seed(74))
    producer, runner = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    _busy(producer)
    with producer:
        q_old[...] = q_new  # lands after the busy kernel
    shared = InterfaceOnly(q_old)
    shared.__cuda_array_interface__ = {**q_old.__cuda_array_interface__, "stream": producer.ptr}
    attn = DecodeAttention(8, 2, 128)
    lens = [3000, 777]
    attn.plan(lens, stream=runner)
    out = poisoned((2, 8, 128), "bf16")
    attn.run(shared, k, v, out=out, stream=runner)
    assert not producer.done, "the busy kernel ended before the run was queued: nothing was tested"
    runner.synchronize()
    ref_out, _ = reference(q64, k64, v64, lens, 1 / math.sqrt(128))
    check_close(out, None, ref_out, None, lens, "bf16", "q written on the producer's stream")


def test_torch_tensors_on_a_second_gpu():
    # CuPy's current device stays 0 while the tensors live on GPU 1: decode() and an instance
    # built for device 1 must compile, plan and launch there.
    torch = pytest.importorskip("torch")
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    gen = torch.Generator(device="cuda:1").manual_seed(81)
    q, k, v = (torch.randn(shape, device="cuda:1", generator=gen).to(torch.bfloat16)
               for shape in ((2, 32, 128), (2, 3000, 8, 128), (2, 3000, 8, 128)))
    lens = [3000, 1111]
    assert cupy.cuda.Device().id == 0
    out = splitkv.decode(q, k, v, lens)
    attn = DecodeAttention(32, 8, 128, device=1)
    attn.plan(lens, stream=torch.cuda.current_stream(1))
    out2 = attn.run(q, k, v)
    torch.cuda.synchronize(1)
    assert out.device == q.device and out2.device == q.device and cupy.cuda.Device().id == 0
    with cupy.cuda.Device(1):
        ref_out, _ = reference(cupy.asarray(q.double()), cupy.asarray(k.double()), cupy.asarray(v.double()),
                               lens, 1 / math.sqrt(128))
        for result, label in ((out, "decode() on GPU 1"), (out2, "DecodeAttention(device=1)")):
            bits = cupy.asarray(result.view(torch.int16)).view(cupy.uint16)
            check_close(bits, None, ref_out, None, lens, "bf16", label)
