"""GPU correctness of the attention variants (marker: gpu): several query tokens per sequence
(causal among them), a sliding window, a logits soft-cap and attention sinks, alone and together,
with GQA, every program layout (dense, split with each merge, clusters, units, a warp per K/V
head), paged and quantized caches, return_lse and CUDA graphs, against the float64 reference
(`splitkv.reference.attention_reference`).

Inputs are fresh random draws with needles: tokens whose logit dominates their row, placed on
the boundaries the variants draw (the first token a window keeps and the one before it, the
token after a query's own position, which only later queries see), each with a V row of its own
sign pattern. Whatever a kernel gets wrong at a boundary moves a row's output by most of its
scale, far past the bounds. Outputs are poisoned with NaN before every call.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import splitkv  # noqa: E402
from splitkv import DecodeAttention  # noqa: E402
from splitkv.heuristics import default_spec  # noqa: E402
from splitkv.paged import paginate  # noqa: E402
from splitkv.reference import attention_reference  # noqa: E402

import needles  # noqa: E402
from decode_checks import _rng, check_close, poisoned, to_float64  # noqa: E402

pytestmark = pytest.mark.gpu


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values exact in bf16 as their uint16 bits."""
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def needle_positions(length: int, query_tokens: int, window_left: int) -> list[int]:
    """Tokens on the boundaries the variants draw for a sequence of ``length``: each query's own
    position and the one after it (the causal edge), each query's first window token and the one
    before it (the window's edge), the first and last token."""
    positions = {0, length - 1}
    for t in range(query_tokens):
        p = length - query_tokens + t
        positions.update((p, p + 1))
        if window_left >= 0:
            positions.update((p - window_left, p - window_left - 1))
    return sorted(x for x in positions if 0 <= x < length)


def make_inputs(lens, query_tokens, num_qo, num_kv, head_dim, window_left, seed, *, max_len=None):
    """q [B, T, Hq, D], k and v [B, L, Hkv, D] (float32 values exact in bf16), with needles on the
    variants' boundaries: q shares direction e_0, ordinary K rows have K[0] = 0, a needle's K row
    is needle_k e_0 (logit about needles.NEEDLE_LOGIT) with a V row of +-V_CODE."""
    rng = np.random.default_rng(seed)
    batch, max_len = len(lens), max_len or max(max(lens), 1)
    sm_scale = 1.0 / math.sqrt(head_dim)
    q = rng.standard_normal((batch, query_tokens, num_qo, head_dim)).astype(np.float32) * needles.Q_REST_STD
    q[..., 0] = needles.NEEDLE_Q
    k = rng.standard_normal((batch, max_len, num_kv, head_dim)).astype(np.float32)
    k[..., 0] = 0
    v = rng.standard_normal((batch, max_len, num_kv, head_dim)).astype(np.float32)
    for b, n in enumerate(lens):
        for p in needle_positions(n, query_tokens, window_left):
            for h in range(num_kv):
                # Needles of one row differ a little in logit, so no two tie.
                k[b, p, h] = 0
                k[b, p, h, 0] = needles.needle_k(head_dim, sm_scale) * (1 - 0.03 * rng.random())
                v[b, p, h] = needles.needle_code(seed, b, h, p, head_dim)
    return tuple(needles.round_to(x, "bf16") for x in (q, k, v))


def check_variant(attn, q, k, v, q64, k64, v64, lens, *, window_left=-1, cap=0.0, sinks=None, label=""):
    """run() into poisoned out and lse, checked against the float64 reference."""
    batch, tokens, num_qo, head_dim = q64.shape
    out = poisoned((batch, tokens, num_qo, head_dim), "bf16")
    lse = cupy.full((batch, tokens, num_qo), cupy.nan, dtype=cupy.float32)
    sinks_dev = None if sinks is None else cupy.asarray(sinks, dtype=cupy.float32)
    attn.run(q, k, v, out=out, lse=lse, sinks=sinks_dev)
    ref_out, ref_lse = attention_reference(q64, k64, v64, lens, 1.0 / math.sqrt(head_dim), window_left=window_left,
                                           logits_soft_cap=cap, sinks=sinks)
    label = f"{label} {attn.plan_info}"
    flat_lens = np.repeat(np.asarray(lens), tokens)
    check_close(out.reshape(batch * tokens, num_qo, head_dim), lse.reshape(batch * tokens, num_qo),
                cupy.asarray(ref_out.reshape(batch * tokens, num_qo, head_dim)),
                ref_lse.reshape(batch * tokens, num_qo), flat_lens, "bf16", label)
    return out, lse


def run_variant(lens, *, query_tokens=1, window_left=-1, cap=0.0, sinks=False, head_dim=128, group=4, num_kv=2,
                variant=None, num_splits=None, kv_dtype="bf16", page_size=None, kv_layout="NHD", spec_changes=None,
                warp_heads=None, expect=None):
    lens = [int(n) for n in lens]
    num_qo = num_kv * group
    seed = int(_rng("variants", tuple(lens), query_tokens, window_left, cap, sinks, head_dim, group, variant,
                    kv_dtype, page_size, kv_layout, str(spec_changes)).integers(2**31))
    q32, k32, v32 = make_inputs(lens, query_tokens, num_qo, num_kv, head_dim, window_left, seed)
    q = cupy.asarray(to_bf16_bits(q32))
    k = cupy.asarray(to_bf16_bits(k32))
    v = cupy.asarray(to_bf16_bits(v32))
    k64, v64 = k32.astype(np.float64), v32.astype(np.float64)
    if kv_dtype != "bf16":
        k, v = splitkv.quantize_kv(k, kv_dtype), splitkv.quantize_kv(v, kv_dtype)
        k64, v64 = np.asarray(k.dequantize_reference(), np.float64), np.asarray(v.dequantize_reference(), np.float64)
    table = None
    if page_size:
        order = np.random.default_rng(seed).permutation(len(lens) * -(-k64.shape[1] // page_size) + 2)
        if kv_dtype != "bf16":
            pytest.skip("paged quantized caches are covered by the one-token tests")
        k_pages, table = paginate(cupy.asnumpy(k), page_size, kv_layout, order=order, spare_pages=2)
        v_pages, _ = paginate(cupy.asnumpy(v), page_size, kv_layout, order=order, spare_pages=2)
        k, v = cupy.asarray(k_pages), cupy.asarray(v_pages)
    spec = None
    if spec_changes:
        spec = default_spec("sm_90", head_dim, group, "bf16", kv_dtype, page_size=page_size or 0,
                            kv_layout=kv_layout if page_size else "NHD").replace(**spec_changes)
    attn = DecodeAttention(num_qo, num_kv, head_dim, kv_dtype=kv_dtype, spec=spec, page_size=page_size,
                           kv_layout=kv_layout if page_size else "NHD")
    sink_values = None
    if sinks:
        sink_values = np.random.default_rng(seed + 1).normal(0.0, 3.0, num_qo).astype(np.float32)
        sink_values[0] = 40.0  # a sink that outweighs the needles: that head's output is near 0
    attn.plan(lens, block_table=table, variant=variant, num_splits=num_splits, warp_heads=warp_heads,
              query_tokens=query_tokens, window_left=window_left, logits_soft_cap=cap, sinks=sinks)
    launched = attn._launch.spec
    assert (launched.query_tokens, launched.window, launched.soft_cap, launched.sinks) == (
        query_tokens, window_left >= 0, cap > 0, sinks), attn.plan_info
    if expect is not None:
        assert expect(attn), attn.plan_info
    q64 = q32.astype(np.float64)
    label = (f"T={query_tokens} w={window_left} cap={cap} sinks={sinks} D={head_dim} G={group} {kv_dtype} "
             f"p={page_size} {kv_layout} lens={lens[:4]}")
    check_variant(attn, q, k, v, q64, k64, v64, lens, window_left=window_left, cap=cap, sinks=sink_values,
                  label=label)
    return attn


COMBINATIONS = [  # (query_tokens, window_left, cap, sinks)
    (1, 200, 0.0, False), (1, -1, 30.0, False), (1, -1, 0.0, True), (2, -1, 0.0, False), (4, -1, 0.0, False),
    (4, 300, 0.0, False), (3, 1000, 50.0, True), (8, 130, 20.0, True), (16, 2000, 0.0, False),
    (1, 0, 0.0, False), (2, 37, 30.0, True),
]


@pytest.mark.parametrize("variant, num_splits", [(None, None), ("dense", None), ("split", 5)])
@pytest.mark.parametrize("query_tokens, window_left, cap, sinks", COMBINATIONS)
def test_variants_and_combinations(query_tokens, window_left, cap, sinks, variant, num_splits):
    run_variant([3000, 17, 4096, 1500], query_tokens=query_tokens, window_left=window_left, cap=cap, sinks=sinks,
                variant=variant, num_splits=num_splits)


@pytest.mark.parametrize("group, query_tokens", [(1, 4), (7, 2), (7, 4), (16, 2), (5, 5), (8, 3), (4, 12), (16, 5),
                                                  (16, 16)])
def test_groups_and_row_slices_and_blocks(group, query_tokens):
    # Rows past 16 take row slices of 16 sharing each ring: 7 x 4 = 28, 16 x 2 = 32, 5 x 5 = 25 and
    # 8 x 3 = 24 two slices (padding rows in the second), 4 x 12 = 48 four (the last all padding),
    # 16 x 5 = 80 eight (three of padding); 16 x 16 = 256 rows two row blocks of eight slices.
    for variant, num_splits in ((None, None), ("dense", None), ("split", 3)):
        run_variant([2500, 900], query_tokens=query_tokens, window_left=700, cap=30.0, sinks=True, group=group,
                    variant=variant, num_splits=num_splits)


@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_head_dims(head_dim):
    run_variant([2000, 333], query_tokens=4, window_left=500, cap=30.0, sinks=True, head_dim=head_dim)
    run_variant([2000, 333], query_tokens=2, window_left=-1, sinks=True, head_dim=head_dim, variant="split",
                num_splits=4)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "nvfp4"])
def test_quantized_caches(kv_dtype):
    run_variant([3000, 64], query_tokens=4, window_left=800, cap=30.0, sinks=True, kv_dtype=kv_dtype)
    run_variant([3000, 64], query_tokens=2, sinks=True, kv_dtype=kv_dtype, variant="split", num_splits=6)
    # 32 rows: two row slices share each ring (the block scales copied by the first).
    run_variant([3000, 64], query_tokens=8, window_left=900, sinks=True, kv_dtype=kv_dtype, variant="split",
                num_splits=3, expect=lambda attn: attn._launch.spec.row_slices == 2)


@pytest.mark.parametrize("page_size, kv_layout", [(16, "NHD"), (16, "HND"), (1, "NHD"), (64, "HND")])
def test_paged_caches(page_size, kv_layout):
    run_variant([2100, 50, 999], query_tokens=3, window_left=400, cap=30.0, sinks=True, page_size=page_size,
                kv_layout=kv_layout)
    run_variant([2100, 50, 999], query_tokens=2, window_left=-1, sinks=True, page_size=page_size,
                kv_layout=kv_layout, variant="split", num_splits=3)
    run_variant([2100, 50, 999], query_tokens=8, window_left=600, cap=30.0, page_size=page_size,
                kv_layout=kv_layout, expect=lambda attn: attn._launch.spec.row_slices == 2)


def test_clusters_and_the_merges():
    cluster = lambda attn: attn._launch.spec.cluster > 1  # noqa: E731
    run_variant([40000], query_tokens=4, window_left=20000, cap=30.0, sinks=True, num_kv=8, expect=cluster)
    run_variant([60000, 100], query_tokens=2, window_left=-1, sinks=True, num_kv=1, group=8, expect=cluster)
    # The separate merge program, and the global merge without clusters.
    for fused in (False, True):
        run_variant([9000, 4000], query_tokens=4, window_left=3000, cap=30.0, sinks=True, variant="split",
                    num_splits=7, spec_changes=dict(cluster=1, fused_merge=fused))
        run_variant([9000, 4000], query_tokens=8, window_left=-1, sinks=True, variant="split", num_splits=7,
                    spec_changes=dict(cluster=1, fused_merge=fused))  # 32 rows: two row slices
    # Row slices in a cluster (the 4-warp one-token shape kept: two slices of two warps' rings),
    # with tensor maps and with per-lane copies.
    for kv_copy in ("tma", "cp_async"):
        run_variant([30000, 3000], query_tokens=8, window_left=-1, cap=30.0, sinks=True, variant="split",
                    num_splits=8, spec_changes=dict(cluster=4, kv_copy=kv_copy),
                    expect=lambda attn: attn._launch.spec.cluster == 4 and attn._launch.spec.row_slices == 2)


# ---- warpgroup MMAs (sm_90a wgmma): 64 rows per warpgroup of four warps sharing one ring ---------
WARPGROUP = dict(mma_m="warpgroup", kv_copy="tma", tile_tokens=64, stages=3)


def warpgroup_launched(attn):
    return attn._launch.spec.mma_m == "warpgroup"


@pytest.mark.parametrize("group, query_tokens, warps", [(4, 16, 4), (8, 8, 4), (8, 16, 8), (4, 4, 4), (7, 4, 4),
                                                         (4, 1, 4), (16, 16, 8)])
def test_warpgroup_mmas(group, query_tokens, warps):
    # 4 x 16 = 64 rows: one warpgroup exactly; 8 x 16 = 128 two warpgroups on one ring; 4 x 4 = 16,
    # 7 x 4 = 28 and one token: padding rows; 16 x 16 = 256 two row blocks of two warpgroups.
    changes = dict(WARPGROUP, warps=warps)
    for variant, num_splits in ((None, None), ("dense", None), ("split", 3)):
        run_variant([2500, 900, 40], query_tokens=query_tokens, window_left=700, cap=30.0, sinks=True, group=group,
                    variant=variant, num_splits=num_splits, spec_changes=changes, expect=warpgroup_launched)
    run_variant([3000, 17, 4096, 1500], query_tokens=query_tokens, group=group, spec_changes=changes,
                expect=warpgroup_launched)


@pytest.mark.parametrize("case", ["d64", "t32", "s2", "paged16", "paged64-hnd", "cluster", "units"])
def test_warpgroup_mmas_layouts(case):
    changes, extra = dict(WARPGROUP), {}
    if case == "d64":
        extra = dict(head_dim=64)
    elif case == "t32":
        changes.update(tile_tokens=32, stages=4)
    elif case == "s2":  # two stages: a tile in flight while one computes
        changes.update(stages=2)
    elif case == "paged16":
        extra = dict(page_size=16, kv_layout="NHD")
    elif case == "paged64-hnd":
        extra = dict(page_size=64, kv_layout="HND")
    elif case == "cluster":
        changes.update(cluster=4)
        extra = dict(variant="split", num_splits=8,
                     expect=lambda attn: warpgroup_launched(attn) and attn._launch.spec.cluster == 4)
    elif case == "units":  # (units plans take no window)
        extra = dict(variant="units", window_left=-1)
    run = dict(query_tokens=16, window_left=900, cap=30.0, sinks=True, spec_changes=changes,
               expect=warpgroup_launched)
    run.update(extra)
    second = dict(run, query_tokens=8, window_left=-1, cap=0.0, sinks=False)
    lens = [30000, 3000] if case == "cluster" else [20000, 30, 40, 500, 17] if case == "units" else [2100, 50, 999]
    run_variant(lens, **run)
    run_variant(lens, **second)


def test_units_and_a_warp_per_kv_head():
    units = lambda attn: attn._launch.spec.variant == "units"  # noqa: E731
    run_variant([20000, 30, 40, 500, 7], query_tokens=2, cap=30.0, sinks=True, variant="units", expect=units)
    run_variant([20000, 30, 40, 500, 7], query_tokens=4, sinks=True, group=4, variant="units", expect=units)
    run_variant([20000, 30, 40, 500, 8], query_tokens=8, cap=30.0, group=4, variant="units",
                expect=lambda attn: units(attn) and attn._launch.spec.row_slices == 2)  # 32 rows: two slices
    packed = lambda attn: attn._launch.spec.warp_heads  # noqa: E731
    run_variant([700] * 8, window_left=300, cap=30.0, sinks=True, num_kv=8, variant="dense", warp_heads=True,
                expect=packed)


def test_graph_replay_with_lengths_rewritten():
    """A captured graph over a windowed, multi-token plan replays lengths rewritten in place up to
    the plan's max_len, each replay against the reference."""
    lens, max_len, num_qo, num_kv, head_dim, tokens, window = [3000, 1200], 6000, 8, 2, 128, 4, 1500
    q32, k32, v32 = make_inputs(lens, tokens, num_qo, num_kv, head_dim, window, 7, max_len=max_len)
    q, k, v = (cupy.asarray(to_bf16_bits(x)) for x in (q32, k32, v32))
    sinks = np.random.default_rng(3).normal(0, 2, num_qo).astype(np.float32)
    attn = DecodeAttention(num_qo, num_kv, head_dim)
    device_lens = cupy.asarray(lens, dtype=cupy.int32)
    attn.plan(device_lens, max_len=max_len, query_tokens=tokens, window_left=window, logits_soft_cap=25.0, sinks=True)
    out = cupy.zeros((2, tokens, num_qo, head_dim), cupy.uint16)
    lse = cupy.zeros((2, tokens, num_qo), cupy.float32)
    sinks_dev = cupy.asarray(sinks)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        attn.run(q, k, v, out=out, lse=lse, sinks=sinks_dev)  # compiled and validated before capture
        stream.begin_capture()
        attn.run(q, k, v, out=out, lse=lse, sinks=sinks_dev)
        graph = stream.end_capture()
    for new_lens in ([3000, 1200], [5999, 4], [6000, 2500]):
        device_lens.set(np.asarray(new_lens, np.int32))
        out.fill(0x7FC0)
        lse.fill(cupy.nan)
        graph.launch(stream)
        stream.synchronize()
        ref_out, ref_lse = attention_reference(q32.astype(np.float64), k32.astype(np.float64), v32.astype(np.float64),
                                               new_lens, 1 / math.sqrt(head_dim), window_left=window,
                                               logits_soft_cap=25.0, sinks=sinks)
        check_close(out.reshape(2 * tokens, num_qo, head_dim), lse.reshape(2 * tokens, num_qo),
                    cupy.asarray(ref_out.reshape(2 * tokens, num_qo, head_dim)), ref_lse.reshape(2 * tokens, num_qo),
                    np.repeat(new_lens, tokens), "bf16", f"graph replay lens={new_lens} {attn.plan_info}")


def test_one_shot_decode_and_torch():
    lens, num_qo, num_kv, head_dim, tokens, window = [1800, 77], 8, 2, 128, 3, 600
    q32, k32, v32 = make_inputs(lens, tokens, num_qo, num_kv, head_dim, window, 11)
    sinks = np.random.default_rng(5).normal(0, 2, num_qo).astype(np.float32)
    ref_out, ref_lse = attention_reference(q32.astype(np.float64), k32.astype(np.float64), v32.astype(np.float64),
                                           lens, 1 / math.sqrt(head_dim), window_left=window, logits_soft_cap=30.0,
                                           sinks=sinks)
    q, k, v = (cupy.asarray(to_bf16_bits(x)) for x in (q32, k32, v32))
    out, lse = splitkv.decode(q, k, v, lens, window_left=window, logits_soft_cap=30.0, sinks=cupy.asarray(sinks),
                              return_lse=True)
    assert out.shape == (2, tokens, num_qo, head_dim) and lse.shape == (2, tokens, num_qo)
    check_close(out.reshape(2 * tokens, num_qo, head_dim), lse.reshape(2 * tokens, num_qo),
                cupy.asarray(ref_out.reshape(2 * tokens, num_qo, head_dim)), ref_lse.reshape(2 * tokens, num_qo),
                np.repeat(lens, tokens), "bf16", "decode() cupy")
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.from_numpy(x).to("cuda", torch.bfloat16) for x in (q32, k32, v32))
    t_out = splitkv.decode(tq, tk, tv, torch.tensor(lens, dtype=torch.int32, device="cuda"), window_left=window,
                           logits_soft_cap=30.0, sinks=torch.from_numpy(sinks).cuda())
    assert t_out.shape == tq.shape and t_out.dtype == torch.bfloat16
    got = t_out.float().cpu().numpy().astype(np.float64)
    err = np.abs(got - ref_out).max() / np.abs(ref_out).max()
    assert err < 2e-2, f"decode() torch: max error {err:.3e} of the output's scale"


def test_refusals():
    attn = DecodeAttention(8, 2, 128)
    q32, k32, v32 = make_inputs([100], 2, 8, 2, 128, -1, 1)
    q, k, v = (cupy.asarray(to_bf16_bits(x)) for x in (q32, k32, v32))
    attn.plan([100], query_tokens=2, sinks=True)
    with pytest.raises(ValueError, match="sinks=True"):
        attn.run(q, k, v)
    with pytest.raises(ValueError, match="sinks"):
        attn.run(q, k, v, sinks=cupy.zeros(7, cupy.float32))  # not [Hq]
    with pytest.raises(ValueError, match="query token"):
        attn.run(q[:, :1], k, v, sinks=cupy.zeros(8, cupy.float32))
    attn.plan([100])
    with pytest.raises(ValueError, match="without sinks"):
        attn.run(q[:, 0], k, v, sinks=cupy.zeros(8, cupy.float32))
    with pytest.raises(ValueError, match="at least 2"):
        attn.plan([100, 1], query_tokens=2)
    with pytest.raises(ValueError, match="units"):
        attn.plan([100], window_left=10, variant="units")
    with pytest.raises(ValueError, match="window_left"):
        attn.plan([100], window_left=-2)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        attn.plan([100], logits_soft_cap=float("inf"))
    with pytest.raises(ValueError, match="query_tokens"):
        attn.plan([100], query_tokens=17)


def test_plain_attention_is_unchanged_by_the_variants_code():
    """A plan without variants launches the plain programs (no variant compiled in), and a
    window longer than every sequence gives what no window gives, bit for bit."""
    lens = [5000, 300]
    q32, k32, v32 = make_inputs(lens, 1, 8, 2, 128, -1, 21)
    q, k, v = (cupy.asarray(to_bf16_bits(x[:, 0] if x is q32 else x)) for x in (q32, k32, v32))
    attn = DecodeAttention(8, 2, 128)
    attn.plan(lens)
    assert not attn._launch.spec.has_variant
    plain = attn.run(q, k, v)
    attn.plan(lens, window_left=10**6)
    windowed = attn.run(q, k, v)
    assert bool((to_float64(plain, "bf16") == to_float64(windowed, "bf16")).all())


# ---- transformers' cache layout: [B, Hkv, L, D], and views of a longer cache read in place ------
@pytest.mark.parametrize("head_dim, variant, num_splits", [(128, None, None), (128, "dense", None), (128, "split", 6),
                                                           (96, None, None), (256, "split", 3), (64, None, None)])
def test_hnd_caches_and_views_of_longer_caches(head_dim, variant, num_splits):
    """K/V as [B, Hkv, L, D] (contiguous, and a [:, :, :L] view of a cache of 2L + 8 tokens), and
    NHD views [:, :L] of a longer [B, S, Hkv, D] cache: each against the float64 reference, and bit
    for bit the output of the same plan over a contiguous NHD copy."""
    lens, num_qo, num_kv, tokens, window = [1500, 40, 999], 8, 2, 2, 600
    q32, k32, v32 = make_inputs(lens, tokens, num_qo, num_kv, head_dim, window, 31 + head_dim)
    ref_out, ref_lse = attention_reference(q32.astype(np.float64), k32.astype(np.float64), v32.astype(np.float64),
                                           lens, 1 / math.sqrt(head_dim), window_left=window)
    q = cupy.asarray(to_bf16_bits(q32))
    batch, length = k32.shape[:2]
    plan = dict(query_tokens=tokens, window_left=window, variant=variant, num_splits=num_splits)

    def run(layout, k, v):
        attn = DecodeAttention(num_qo, num_kv, head_dim, kv_layout=layout)
        attn.plan(lens, **plan)
        out = poisoned((batch, tokens, num_qo, head_dim), "bf16")
        lse = cupy.full((batch, tokens, num_qo), cupy.nan, dtype=cupy.float32)
        attn.run(q, k, v, out=out, lse=lse)
        label = f"{layout} k {k.shape} strides {k.strides} {attn.plan_info}"
        check_close(out.reshape(-1, num_qo, head_dim), lse.reshape(-1, num_qo),
                    cupy.asarray(ref_out.reshape(-1, num_qo, head_dim)), ref_lse.reshape(-1, num_qo),
                    np.repeat(lens, tokens), "bf16", label)
        return out, label

    k_nhd, v_nhd = (cupy.asarray(to_bf16_bits(x)) for x in (k32, v32))
    base, _ = run("NHD", k_nhd, v_nhd)
    k_hnd, v_hnd = (cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k_nhd, v_nhd))
    longer = 2 * length + 8

    def nhd_view(x):
        held = cupy.full((batch, longer, num_kv, head_dim), 0x7FC0, cupy.uint16)  # NaN past L: never read
        held[:, :length] = x
        return held[:, :length]

    def hnd_view(x):
        held = cupy.full((batch, num_kv, longer, head_dim), 0x7FC0, cupy.uint16)
        held[:, :, :length] = x
        return held[:, :, :length]

    for layout, k, v in (("HND", k_hnd, v_hnd), ("HND", hnd_view(k_hnd), hnd_view(v_hnd)),
                         ("NHD", nhd_view(k_nhd), nhd_view(v_nhd))):
        out, label = run(layout, k, v)
        assert bool((out == base).all()), f"{label}: not the bits of the contiguous NHD cache's output"


def test_torch_cache_views_and_decode():
    torch = pytest.importorskip("torch")
    lens, num_qo, num_kv, head_dim, length, longer = [700, 333], 8, 2, 128, 700, 1024
    q32, k32, v32 = make_inputs(lens, 3, num_qo, num_kv, head_dim, -1, 41)
    ref_out, _ = attention_reference(*(x.astype(np.float64) for x in (q32, k32, v32)), lens, 1 / math.sqrt(head_dim))
    cache_k = torch.full((2, num_kv, longer, head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
    cache_v = cache_k.clone()
    cache_k[:, :, :length] = torch.from_numpy(k32).cuda().transpose(1, 2)
    cache_v[:, :, :length] = torch.from_numpy(v32).cuda().transpose(1, 2)
    q = torch.from_numpy(q32).to("cuda", torch.bfloat16)
    for view in (length, length - 100):  # the view's length changes the stride-free extent, not the stride
        lens_now = [min(n, view) for n in lens]
        ref = attention_reference(*(x.astype(np.float64) for x in (q32, k32, v32)), lens_now, 1 / math.sqrt(head_dim))[0]
        out = splitkv.decode(q, cache_k[:, :, :view], cache_v[:, :, :view], lens_now, kv_layout="HND")
        err = np.abs(out.float().cpu().numpy() - ref).max() / np.abs(ref).max()
        assert err < 2e-2, f"torch HND view of {view} tokens: max error {err:.3e} of the output's scale"
    assert ref_out.shape == out.shape


@pytest.mark.parametrize("variant_args", [dict(), dict(query_tokens=2, window_left=3000, logits_soft_cap=30.0)])
def test_deterministic_plans_are_batch_invariant(variant_args):
    """plan(deterministic=True): one sequence's output and lse are the same bits alone, among other
    sequences of every length, and at another place in the batch; and right against float64."""
    num_qo, num_kv, head_dim = 8, 2, 128
    tokens = variant_args.get("query_tokens", 1)
    length = 5000
    q32, k32, v32 = make_inputs([length], tokens, num_qo, num_kv, head_dim, variant_args.get("window_left", -1), 51)
    rng = np.random.default_rng(52)
    attn = DecodeAttention(num_qo, num_kv, head_dim)
    results = []
    for others, place in (([], 0), ([300] * 7, 7), ([70000, 17, 1500], 1), ([40] * 40, 20)):
        lens = list(others)
        lens.insert(place, length)
        cache = max(lens)
        k = rng.standard_normal((len(lens), cache, num_kv, head_dim)).astype(np.float32)
        v = rng.standard_normal((len(lens), cache, num_kv, head_dim)).astype(np.float32)
        q = rng.standard_normal((len(lens), tokens, num_qo, head_dim)).astype(np.float32)
        k[place, :length], v[place, :length], q[place] = k32[0], v32[0], q32[0]
        kq, vq, qq = (cupy.asarray(to_bf16_bits(needles.round_to(x, "bf16"))) for x in (k, v, q))
        attn.plan(lens, deterministic=True, sinks=False, **variant_args)
        out = poisoned((len(lens), tokens, num_qo, head_dim), "bf16")
        lse = cupy.full((len(lens), tokens, num_qo), cupy.nan, dtype=cupy.float32)
        attn.run(qq, kq, vq, out=out, lse=lse)
        results.append((cupy.asnumpy(out[place]), cupy.asnumpy(lse[place]), attn.plan_info))
    ref_out, ref_lse = attention_reference(q32.astype(np.float64), k32.astype(np.float64), v32.astype(np.float64),
                                           [length], 1 / math.sqrt(head_dim),
                                           window_left=variant_args.get("window_left", -1),
                                           logits_soft_cap=variant_args.get("logits_soft_cap", 0.0))
    check_close(cupy.asarray(results[0][0]).reshape(tokens, num_qo, head_dim), cupy.asarray(results[0][1]),
                cupy.asarray(ref_out[0]), ref_lse[0], [length] * tokens, "bf16", f"deterministic {results[0][2]}")
    for out, lse, info in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(lse, results[0][1], equal_nan=True), (
            f"not batch-invariant: {info} against {results[0][2]}")
