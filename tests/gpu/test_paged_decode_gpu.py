"""GPU correctness of the decode programs on paged K/V caches (marker: gpu).

Every case lays a random contiguous cache out as pages in a random order (with spare pages, and
table entries past what the lengths need left as garbage), runs the paged program and compares it
with the float64 reference over the same values, and with the contiguous program on the same data:
the two must agree bit for bit, since they stream the same tiles through the same math. Outputs
are poisoned first; the unread parts of pages hold NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import splitkv  # noqa: E402
from splitkv import DecodeAttention, QuantizedKV  # noqa: E402
from splitkv.heuristics import default_spec  # noqa: E402
from splitkv.paged import paginate  # noqa: E402

from decode_checks import _rng, check_close, fresh_seed, poisoned, random_values, reference, to_float64  # noqa: E402

pytestmark = pytest.mark.gpu

#: bf16 NaN, and an E4M3 NaN code (NVFP4 values have none; its block-scale NaN is the same code).
NAN_CODE = {"bf16": 0x7FC0, "fp8_e4m3": 0x7F, "nvfp4": 0x7F}


def paged_copy(array, lens, page_size, layout, rng, spare_pages=3, nan_code=None):
    """``array`` [B, L, Hkv, X] (device) as pages in a random order: (pages, block table). The rows
    of each sequence's last page past its length, and the spare pages, hold ``nan_code`` (or NaN
    bits for 16-bit K/V), which no output may show."""
    host = cupy.asnumpy(array)
    batch, length = host.shape[:2]
    per_seq = -(-length // page_size)
    order = rng.permutation(batch * per_seq + spare_pages)
    pages, table = paginate(host, page_size, layout, order=order, spare_pages=spare_pages)
    if nan_code is not None:
        tokens_first = pages if layout == "NHD" else pages.transpose(0, 2, 1, 3)  # a view
        used = set(table.ravel().tolist())
        for p in range(pages.shape[0]):
            if p not in used:
                tokens_first[p] = nan_code
        for b, n in enumerate(lens):
            tail = np.arange(n, per_seq * page_size)
            tokens_first[table[b, tail // page_size], tail % page_size] = nan_code
    return cupy.asarray(pages), table


def paged_kv(kv, lens, page_size, layout, seed, kv_dtype):
    """K or V (an array, or a QuantizedKV) laid out as pages in the order ``seed`` draws: (paged K
    or V, block table)."""
    if not isinstance(kv, QuantizedKV):
        pages, table = paged_copy(kv, lens, page_size, layout, np.random.default_rng(seed), nan_code=NAN_CODE[kv_dtype])
        return pages, table
    values, table = paged_copy(kv.values, lens, page_size, layout, np.random.default_rng(seed), nan_code=NAN_CODE[kv_dtype])
    scales = None
    if kv.block_scales is not None:  # the same order: one table serves values and scales
        scales, _ = paged_copy(kv.block_scales, lens, page_size, layout, np.random.default_rng(seed),
                               nan_code=NAN_CODE[kv_dtype])
    return QuantizedKV(kv.kv_dtype, values, scales, kv.scale), table


def with_garbage_columns(table, rng, extra=2):
    """The table with ``extra`` more columns of entries no length reads (out of range, negative)."""
    garbage = rng.choice([-1, 1 << 30, -(1 << 30)], size=(table.shape[0], extra))
    return np.ascontiguousarray(np.concatenate([table, garbage], axis=1).astype(np.int32))


def random_qkv(rng, lens, num_qo, num_kv, head_dim, kv_dtype):
    """Random q, K and V of a batch (K and V quantized for a quantized kv_dtype) and the float64
    values the reference reads: (q, q64, k, v, k64, v64)."""
    seed = int(rng.integers(2**31))
    batch, max_len = len(lens), max(max(lens), 1)
    q, q64 = random_values((batch, num_qo, head_dim), "bf16", seed)
    k, k64 = random_values((batch, max_len, num_kv, head_dim), "bf16", seed + 1)
    v, v64 = random_values((batch, max_len, num_kv, head_dim), "bf16", seed + 2)
    if kv_dtype != "bf16":
        k, v = splitkv.quantize_kv(k, kv_dtype), splitkv.quantize_kv(v, kv_dtype)
        k64, v64 = cupy.asarray(k.dequantize_reference()), cupy.asarray(v.dequantize_reference())
    return q, q64, k, v, k64, v64


def paged_pair(k, v, lens, page_size, layout, rng, kv_dtype):
    """K and V laid out as pages in one random order: (K pages, V pages, their block table with
    garbage columns past what the lengths read)."""
    order_seed = int(rng.integers(2**31))  # K and V share the page order, so one table serves both
    k_pages, table = paged_kv(k, lens, page_size, layout, order_seed, kv_dtype)
    v_pages, v_table = paged_kv(v, lens, page_size, layout, order_seed, kv_dtype)
    assert np.array_equal(table, v_table)
    return k_pages, v_pages, with_garbage_columns(table, rng)


def run_against_reference(attn, q, k, v, refs, lens, label):
    """attn.run into poisoned out and lse, checked against the float64 reference over ``refs`` (q64,
    k64, v64); returns out and the label, which names the plan."""
    q64, k64, v64 = refs
    batch, num_qo, head_dim = q64.shape
    out = poisoned((batch, num_qo, head_dim), "bf16")
    lse = cupy.full((batch, num_qo), cupy.nan, dtype=cupy.float32)
    attn.run(q, k, v, out=out, lse=lse)
    ref_out, ref_lse = reference(q64, k64, v64, lens, 1.0 / math.sqrt(head_dim))
    label = f"{label} {attn.plan_info}"
    check_close(out, lse, ref_out, ref_lse, lens, "bf16", label)
    return out, label


def run_paged(head_dim, group, lens, page_size, layout, *, kv_dtype="bf16", variant=None, num_splits=None,
              num_kv=2, spec_changes=None, warp_heads=None, device_table=True):
    """One paged case against the reference and against the contiguous program; returns the paged
    instance."""
    lens = [int(n) for n in lens]
    batch, num_qo = len(lens), num_kv * group
    rng = _rng("paged", head_dim, group, tuple(lens), page_size, layout, kv_dtype, variant)
    q, q64, k, v, k64, v64 = random_qkv(rng, lens, num_qo, num_kv, head_dim, kv_dtype)
    k_pages, v_pages, table = paged_pair(k, v, lens, page_size, layout, rng, kv_dtype)
    spec = None
    if spec_changes:
        spec = default_spec("sm_90", head_dim, group, "bf16", kv_dtype).replace(**spec_changes)
    attn = DecodeAttention(num_qo, num_kv, head_dim, kv_dtype=kv_dtype, spec=spec, page_size=page_size,
                           kv_layout=layout)
    plan = attn.plan(lens, block_table=cupy.asarray(table) if device_table else table, variant=variant,
                     num_splits=num_splits, warp_heads=warp_heads)
    launched = attn._launch.spec
    assert launched.page_size == page_size and launched.kv_layout == layout, attn.plan_info
    if spec_changes:
        assert all(getattr(launched, name) == value for name, value in spec_changes.items()
                   if name not in ("variant", "cluster")), attn.plan_info
    out, label = run_against_reference(attn, q, k_pages, v_pages, (q64, k64, v64), lens,
                                       f"paged p{page_size} {layout} {kv_dtype} D={head_dim} G={group} lens={lens[:4]}")

    # The contiguous program of the same CTA shape and copies on the same data, with the same plan.
    flat = DecodeAttention(num_qo, num_kv, head_dim, kv_dtype=kv_dtype,
                           spec=attn.split_spec.replace(page_size=0, kv_layout="NHD"),
                           dense_spec=attn.dense_spec.replace(page_size=0, kv_layout="NHD"))
    if variant is None:
        return attn  # the planner's choice: pages shorter than a tile plan without whole-row clusters
    flat_plan = flat.plan(lens, variant=variant, num_splits=num_splits, warp_heads=warp_heads)
    flat_out = poisoned((batch, num_qo, head_dim), "bf16")
    flat.run(q, k, v, out=flat_out)
    assert flat_plan == plan and flat._launch.spec == launched.replace(page_size=0, kv_layout="NHD"), \
        f"{label}: the contiguous program was planned otherwise: {flat.plan_info}"
    assert bool((flat_out == out).all()), f"{label}: paged and contiguous outputs differ"
    return attn


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 8, 16, 64, 256])
@pytest.mark.parametrize("variant", ["dense", "split"])
def test_page_sizes_layouts_and_ragged_batches(page_size, layout, variant):
    run_paged(128, 4, [0, 7, 1077, 2048 + 33, 300], page_size, layout, variant=variant, num_splits=5)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("page_size, layout", [(1, "NHD"), (16, "HND"), (64, "NHD")])
@pytest.mark.parametrize("variant", ["dense", "split"])
def test_quantized_pages(kv_dtype, page_size, layout, variant):
    run_paged(128, 4, [0, 7, 1077, 2048 + 33, 300], page_size, layout, kv_dtype=kv_dtype, variant=variant,
              num_splits=5)


@pytest.mark.parametrize("head_dim, group", [(64, 1), (96, 8), (256, 16), (256, 4)])
@pytest.mark.parametrize("page_size", [4, 32])
def test_head_dims_and_groups(head_dim, group, page_size):
    run_paged(head_dim, group, [1, 129, 3000], page_size, "NHD", variant="split", num_splits=3)
    run_paged(head_dim, group, [1, 129, 3000], page_size, "HND", variant="dense")


def test_planner_choice_long_rows():
    run_paged(128, 4, [65536], 16, "NHD", num_kv=8)
    run_paged(128, 4, [65536], 64, "NHD", num_kv=8, variant="split", num_splits=8)  # whole-row clusters of 8
    run_paged(128, 8, [70000, 5, 0, 16384], 64, "HND", num_kv=2)
    run_paged(128, 4, [40000], 1, "NHD", num_kv=2, kv_dtype="fp8_e4m3")


@pytest.mark.parametrize("changes", [{"cluster": 4}, {"fused_merge": False, "cluster": 1}, {"stages": 3},
                                     {"warps": 8, "tile_tokens": 16, "chunk_size": 128},
                                     {"kv_copy": "cp_async"}])
def test_cta_shapes_and_merges(changes):
    run_paged(128, 4, [5000, 33, 0, 2500], 16, "NHD", variant="split", num_splits=8, spec_changes=changes)


def test_warp_heads_and_host_tables():
    run_paged(128, 4, [700] * 40, 16, "NHD", num_kv=8, variant="dense", warp_heads=True)
    run_paged(128, 4, [0, 7, 1077], 32, "HND", variant="split", num_splits=3, device_table=False)


def test_graph_replay_after_new_lengths_and_pages():
    """A graph captured once replays for lengths and page entries rewritten in place."""
    head_dim, group, num_kv, page_size = 128, 4, 2, 16
    rng = np.random.default_rng(int(_rng("paged graph").integers(2**31)))
    batch, capacity = 3, 4096
    per_seq = capacity // page_size
    num_pages = batch * per_seq + 5
    k, k64 = random_values((num_pages, page_size, num_kv, head_dim), "bf16", int(rng.integers(2**31)))
    v, v64 = random_values((num_pages, page_size, num_kv, head_dim), "bf16", int(rng.integers(2**31)))
    q, q64 = random_values((batch, num_kv * group, head_dim), "bf16", int(rng.integers(2**31)))
    lens = cupy.asarray([100, 4000, 1], dtype=cupy.int32)
    table = cupy.asarray(rng.permutation(num_pages)[: batch * per_seq].reshape(batch, per_seq).astype(np.int32))
    attn = DecodeAttention(num_kv * group, num_kv, head_dim, page_size=page_size)
    attn.plan(lens, max_len=capacity, block_table=table)
    out = poisoned((batch, num_kv * group, head_dim), "bf16")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        attn.run(q, k, v, out=out)  # validated before capture
        stream.begin_capture()
        attn.run(q, k, v, out=out)
        graph = stream.end_capture()
    for step in range(3):
        new_lens = [int(x) for x in rng.integers(0, capacity + 1, size=batch)]
        lens.set(np.asarray(new_lens, dtype=np.int32))
        table.set(rng.permutation(num_pages)[: batch * per_seq].reshape(batch, per_seq).astype(np.int32))
        out.fill(0x7FC0)
        graph.launch(stream)
        stream.synchronize()
        host_table = cupy.asnumpy(table)
        gathered_k = cupy.stack([k64[host_table[b]].reshape(capacity, num_kv, head_dim) for b in range(batch)])
        gathered_v = cupy.stack([v64[host_table[b]].reshape(capacity, num_kv, head_dim) for b in range(batch)])
        ref_out, _ = reference(q64, gathered_k, gathered_v, new_lens, 1.0 / math.sqrt(head_dim))
        check_close(out, None, ref_out, None, new_lens, "bf16", f"graph replay {step} lens={new_lens}")


def test_bad_tables_are_refused_and_never_read_outside():
    head_dim, num_kv, page_size = 128, 2, 16
    seed = int(_rng("bad tables").integers(2**31))
    k, k64 = random_values((10, page_size, num_kv, head_dim), "bf16", seed)
    v, v64 = random_values((10, page_size, num_kv, head_dim), "bf16", seed + 1)
    q, q64 = random_values((2, 8, head_dim), "bf16", seed + 2)
    attn = DecodeAttention(8, num_kv, head_dim, page_size=page_size)
    good = np.array([[3, 4, 9], [0, 1, 2]], dtype=np.int32)
    with pytest.raises(ValueError, match="sequence 1 of 60 tokens needs 4 pages"):
        attn.plan([20, 60], block_table=good)
    with pytest.raises(ValueError, match="sequence 0's page 1 is -3"):
        attn.plan([20, 5], block_table=np.array([[3, -3, 9], [0, 1, 2]], dtype=np.int32))
    attn.plan([40, 5], block_table=cupy.asarray([[3, 4, 10], [0, 1, 2]], dtype=cupy.int32))
    with pytest.raises(ValueError, match="sequence 0's page 2 is 10, outside the cache's 10 pages"):
        attn.run(q, k, v)
    with pytest.raises(ValueError, match="block_table: paged caches need one"):
        attn.plan([40, 5])
    with pytest.raises(ValueError, match="pages of 16 tokens, but this instance reads pages of 8"):
        other = DecodeAttention(8, num_kv, head_dim, page_size=8)
        other.plan([20, 5], block_table=good)
        other.run(q, k, v)
    # Unchecked (validate=False): entries far outside the cache are clamped into it on the device.
    wild = cupy.asarray([[3, 1 << 30, -7], [0, 1, 2]], dtype=cupy.int32)
    attn.plan([40, 5], block_table=wild, validate=False)
    out = poisoned(q.shape, "bf16")
    attn.run(q, k, v, out=out)
    cupy.cuda.Device().synchronize()  # no fault
    # Sequence 0 read clamped pages (whatever they hold, finite); sequence 1's table was sound: its
    # 5 tokens are rows 0..4 of page 0.
    assert bool(cupy.isfinite(to_float64(out[0], "bf16")).all())
    ref_out, ref_lse = reference(q64[1:], k64[:1, :5], v64[:1, :5], [5], 1.0 / math.sqrt(head_dim))
    check_close(out[1:], None, ref_out, ref_lse, [5], "bf16", "sound row beside a wild one")


def test_one_shot_decode_and_torch():
    head_dim, group, num_kv, page_size = 128, 4, 2, 16
    lens = [300, 17]
    rng = np.random.default_rng(int(_rng("paged one-shot").integers(2**31)))
    q, q64 = random_values((2, num_kv * group, head_dim), "bf16", fresh_seed(5))
    k, k64 = random_values((2, 320, num_kv, head_dim), "bf16", fresh_seed(6))
    v, v64 = random_values((2, 320, num_kv, head_dim), "bf16", fresh_seed(7))
    order = rng.permutation(2 * 20)
    k_pages, table = paginate(cupy.asnumpy(k), page_size, "HND", order=order)
    v_pages, _ = paginate(cupy.asnumpy(v), page_size, "HND", order=order)
    ref_out, ref_lse = reference(q64, k64, v64, lens, 1.0 / math.sqrt(head_dim))
    out, lse = splitkv.decode(q, cupy.asarray(k_pages), cupy.asarray(v_pages), lens, block_table=table,
                              kv_layout="HND", return_lse=True)
    check_close(out, lse, ref_out, ref_lse, lens, "bf16", "decode(block_table=...) HND")
    torch = pytest.importorskip("torch")
    as_torch = lambda a: torch.as_tensor(cupy.asnumpy(a).view(np.int16)).view(torch.bfloat16).cuda()  # noqa: E731
    out_t = splitkv.decode(as_torch(q), as_torch(cupy.asarray(k_pages)), as_torch(cupy.asarray(v_pages)),
                           torch.tensor(lens, dtype=torch.int32, device="cuda"),
                           block_table=torch.as_tensor(table).cuda(), kv_layout="HND")
    out_back = cupy.asarray(out_t.view(torch.int16).cpu().numpy().view(np.uint16))
    assert bool((out_back == out).all()), "torch and CuPy paged decode differ"
