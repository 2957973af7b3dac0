"""What plan() and run() launch, on the fake GPU of tests/fake_gpu.py: the programs a plan loads
and its grid, a warp per K/V head, work-unit and paged plans, the tensor maps of each cache, and
the arguments refused before anything is loaded or launched."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import launch as launching, oneshot, runtime, tensors
from splitkv.heuristics import default_spec
from splitkv.spec import MergeSpec
from tests.fake_gpu import _DeviceArray, _qkv, fake_gpu  # noqa: F401 - fake_gpu: a fixture, used by name
from tests.test_inputs import FakeCAI


def test_dense_plans_do_not_need_the_split_chunk_in_whole_dense_tiles(fake_gpu):
    # A dense program streams each row whole: the split program's chunk size says nothing about it.
    split = default_spec("sm_90", 128, 4).replace(tile_tokens=16, chunk_size=16)
    dense = default_spec("sm_90", 128, 4, variant="dense")
    assert dense.tile_tokens == 32
    attn = runtime.DecodeAttention(32, 8, 128, spec=split, dense_spec=dense)
    plan = attn.plan([10, 5], variant="dense")
    assert plan.variant == "dense" and attn._launch.spec == dense


def test_a_dense_program_of_other_row_blocks_than_the_split_one_launches_its_own(fake_gpu):
    # 16 query tokens x group 8 = 128 rows: the 4-warp split program serves them in two row blocks
    # of 64, the 8-warp dense one in one CTA; a dense plan's grid and its Q / output rows are the
    # dense program's (the split program's two blocks would address past the K/V heads).
    split = default_spec("sm_90", 128, 8).replace(kv_copy="tma", mma_m="warpgroup", warps=4, tile_tokens=16,
                                                   stages=2, chunk_size=64, cluster=1, query_tokens=16)
    dense = split.replace(variant="dense", warps=8, fused_merge=True)
    assert (split.row_blocks, dense.row_blocks) == (2, 1)
    attn = runtime.DecodeAttention(64, 8, 128, spec=split, dense_spec=dense)
    attn.plan([4096] * 3, variant="dense", query_tokens=16)
    assert attn._launch.spec.row_blocks == 1 and attn._launch.grid == (1, 8, 3)
    attn.plan([4096] * 3, variant="split", num_splits=2, query_tokens=16)
    assert attn._launch.spec.row_blocks == 2 and attn._launch.grid == (2, 16, 3)


def test_warpgroup_dense_programs_are_not_packed_a_warp_per_kv_head_unasked(fake_gpu):
    spec = default_spec("sm_90", 128, 4).replace(kv_copy="tma", mma_m="warpgroup", warps=4, tile_tokens=64, stages=3)
    attn = runtime.DecodeAttention(32, 8, 128, spec=spec)
    plan = attn.plan([1024] * 64, variant="dense")  # a batch the planner packs for warp programs
    assert plan.heads_per_cta == 1 and attn._launch.spec.mma_m == "warpgroup" and not attn._launch.spec.warp_heads


def test_units_plans_load_no_split_program(fake_gpu):
    attn = runtime.DecodeAttention(32, 8, 128, tuned=False)
    attn.plan([4096, 100], variant="units")
    decode_programs = [spec for spec, _ in fake_gpu.loads if not isinstance(spec, MergeSpec)]
    assert {spec.variant for spec in decode_programs} == {"units"}, [spec.name for spec in decode_programs]


def test_batches_of_many_rows_get_a_warp_per_kv_head(fake_gpu):
    # 64 sequences x 8 K/V heads: 512 one-row CTAs would take four waves on 132 SMs; a warp per
    # K/V head makes it 128 CTAs of four rows each.
    attn = runtime.DecodeAttention(32, 8, 128, q_dtype="fp16", kv_dtype="fp16")  # the fake arrays' type
    q, k, v = _qkv(64, 32, 8, 128, 1024)
    plan = attn.plan([1024] * 64)
    assert plan.variant == "dense" and plan.heads_per_cta == 4 and plan.num_ctas == 128
    attn.run(q, k, v, out=_DeviceArray((64, 32, 128)))
    (launch,) = fake_gpu.launches
    assert launch.spec.warp_heads and launch.spec.name.endswith("-wh")
    assert launch.grid == (1, 2, 64)
    # 16 sequences (128 rows) would leave 32 CTAs: one row per CTA, as before.
    plan = attn.plan([4096] * 16)
    assert plan.variant == "dense" and plan.heads_per_cta == 1
    attn.run(*_qkv(16, 32, 8, 128, 4096), out=_DeviceArray((16, 32, 128)))
    assert not fake_gpu.launches[-1].spec.warp_heads and fake_gpu.launches[-1].grid == (1, 8, 16)
    # The warp-per-head program is kept between plans, and follows the dense program when it changes.
    attn.plan([1024] * 64)
    assert attn._launch.spec is launch.spec
    attn.dense_spec = attn.dense_spec.replace(stages=3)
    attn.plan([1024] * 64)
    assert attn._launch.spec == attn.dense_spec.replace(warp_heads=True) != launch.spec


def test_warp_heads_can_be_forced_either_way_and_is_refused_where_it_cannot_run(fake_gpu):
    attn = runtime.DecodeAttention(32, 8, 128)
    assert attn.plan([1024] * 64, warp_heads=False).heads_per_cta == 1
    assert attn._launch.grid == (1, 8, 64) and not attn._launch.spec.warp_heads
    assert attn.plan([100] * 2, variant="dense", warp_heads=True).heads_per_cta == 4
    assert attn._launch.grid == (1, 2, 2) and attn._launch.spec.warp_heads
    with pytest.raises(ValueError, match="warp_heads: a warp per K/V head"):
        attn.plan([5000], variant="split", num_splits=4, warp_heads=True)
    with pytest.raises(TypeError, match="warp_heads"):
        attn.plan([1024] * 64, warp_heads=1)
    dense_wh = default_spec("sm_90", 128, 4, variant="dense").replace(warp_heads=True)
    with pytest.raises(ValueError, match="warp_heads is chosen per plan"):
        runtime.DecodeAttention(32, 8, 128, dense_spec=dense_wh)
    odd = runtime.DecodeAttention(12, 6, 128)  # 6 K/V heads do not fill CTAs of 4 warps
    with pytest.raises(ValueError, match="num_kv_heads 6 is not a multiple"):
        odd.plan([100] * 2, variant="dense", warp_heads=True)
    kept = odd.plan([1024] * 200)  # the planner just keeps a row per CTA
    assert kept.variant == "dense" and kept.heads_per_cta == 1


@pytest.mark.parametrize("make, error, message", [
    (lambda attn: attn.plan([5, None]), TypeError, "seq_lens: expected integer lengths"),
    (lambda attn: attn.plan([5.0, 7.0]), TypeError, "seq_lens: expected integer lengths"),
    (lambda attn: attn.plan([5, 7], max_len=9.7), TypeError, "max_len"),
    (lambda attn: attn.plan([5, 7], max_len="9"), TypeError, "max_len"),
    (lambda attn: attn.plan([1] * 70000), ValueError, "launch grid"),
    (lambda attn: runtime.DecodeAttention(8, 2, 128, sm_scale=True), TypeError, "sm_scale"),
    (lambda attn: runtime.DecodeAttention(8, 2, 128, sm_scale="0.1"), TypeError, "sm_scale"),
    (lambda attn: runtime.DecodeAttention(8, 2, 128, sm_scale=float("inf")), ValueError, "sm_scale"),
])
def test_plan_and_constructor_name_bad_scalars(fake_gpu, make, error, message):
    attn = runtime.DecodeAttention(8, 2, 128)
    with pytest.raises(error, match=message):
        make(attn)
    assert not fake_gpu.launches


def test_numpy_scalars_are_accepted_where_ints_and_floats_are(fake_gpu):
    attn = runtime.DecodeAttention(8, 2, 128, sm_scale=np.float32(0.125))
    assert attn.sm_scale == 0.125
    assert attn.plan(np.array([5, 7], dtype=np.int64), max_len=np.int32(9)).variant in ("dense", "split")


def test_paged_runs_pass_the_table_and_map_whole_pages(fake_gpu):
    from splitkv import DecodeAttention

    attn = DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16", page_size=16, kv_layout="HND")
    table = np.array([[3, 1, 9, 9], [0, 2, -1, -1]], dtype=np.int32)  # entries past the lengths never read
    attn.plan([40, 20], block_table=table)
    q = _DeviceArray((2, 8, 128))
    k, v = _DeviceArray((10, 2, 16, 128)), _DeviceArray((10, 2, 16, 128))
    attn.run(q, k, v)
    (launch,) = fake_gpu.launches
    assert launch.spec.page_size == 16 and launch.spec.kv_layout == "HND" and launch.spec.kv_copy == "tma"
    table_ptr, stride, num_pages, units = (int(launch.params[f]) for f in ("block_table", "table_stride", "num_pages", "units"))
    assert table_ptr == attn._launch.table.ptr and (stride, num_pages, units) == (4, 10, 0)
    assert int(launch.params["max_len"]) == 4 * 16  # max_len: the tokens a table row holds
    # HND: one K/V head's tokens are the map's rows, head_dim its columns; boxes of a page.
    assert fake_gpu.maps == [(k.__cuda_array_interface__["data"][0], 10 * 2 * 16, 128),
                             (v.__cuda_array_interface__["data"][0], 10 * 2 * 16, 128)]
    with pytest.raises(ValueError, match="sequence 0's page 2 is 9, outside the cache's 9 pages"):
        attn.run(q, _DeviceArray((9, 2, 16, 128)), _DeviceArray((9, 2, 16, 128)))
    with pytest.raises(ValueError, match="block_table: paged caches need one"):
        attn.plan([40, 20])
    with pytest.raises(ValueError, match="page_size"):
        DecodeAttention(8, 2, 128, page_size=12)
    with pytest.raises(ValueError, match="kv_layout"):
        DecodeAttention(8, 2, 128, kv_layout="HND", kv_dtype="fp8_e4m3")  # contiguous HND: 16-bit K/V


def test_units_plans_launch_a_cta_per_unit_and_merge_split_rows(fake_gpu):
    from splitkv import DecodeAttention
    from splitkv.work_units import max_units

    attn = DecodeAttention(32, 8, 128, q_dtype="fp16", kv_dtype="fp16")
    plan = attn.plan([6096], variant="units")  # 8 rows on 132 x 2 slots: split
    assert plan.split and attn._launch.spec.variant == "units"
    q, k, v = _qkv(1, 32, 8, 128, 6096)
    attn.run(q, k, v)
    decode, merge = fake_gpu.launches
    assert decode.grid == (len(plan.units), 1, 1) and int(decode.params["units"]) == attn._launch.units.ptr
    assert merge.spec.tables and merge.grid == (attn._launch.units.merge_blocks, 1, 1)
    buffer = attn._launch.units.array.host
    assert np.array_equal(buffer[: buffer.size], plan.to_buffer(len(plan.units), len(plan.merges)))

    # Whole rows only: no merge is launched. Fixed sizes: the same grids whatever the lengths.
    fake_gpu.launches.clear()
    attn.plan([4096] * 64, variant="units")
    attn.run(*_qkv(64, 32, 8, 128, 4096))
    assert len(fake_gpu.launches) == 1
    fake_gpu.launches.clear()
    cap = max_units(4 * 8, plan.slots)
    for lens in ([100, 5, 0, 7000], [7000, 7000, 7000, 7000]):
        attn.plan(lens, variant="units", max_units=cap)
        attn.run(*_qkv(4, 32, 8, 128, 7000))
    grids = {(launch.spec.name, launch.grid) for launch in fake_gpu.launches}
    assert len(grids) == 2  # one decode grid and one merge grid, for both plans
    with pytest.raises(ValueError, match="max_units"):
        attn.plan([7000] * 4, variant="units", max_units=1)
    with pytest.raises(ValueError, match="num_splits nor warp_heads"):
        attn.plan([7000] * 4, variant="units", num_splits=4)


def test_the_default_planner_routes_a_long_row_among_many_short_ones_to_units(fake_gpu):
    from splitkv import DecodeAttention
    from splitkv.work_units import UnitPlan

    attn = DecodeAttention(32, 8, 128, q_dtype="fp16", kv_dtype="fp16")
    # Split planner: dense, the long row on one CTA; also where the rows fill whole waves (33 x 8
    # rows on 132 slots), which the units planner once left unsplit.
    for lens in ([65536] + [512] * 63, [65536] + [512] * 32):
        plan = attn.plan(lens)
        assert isinstance(plan, UnitPlan) and plan.split and attn._launch.spec.variant == "units", attn.plan_info
    for lens in ([65536], [131072], [4096] * 16, [1024] * 64, [3000, 5, 0, 16384]):
        plan = attn.plan(lens)  # whole-row clusters, waves of dense rows, modest skew: the split planner
        assert not isinstance(plan, UnitPlan), (lens, attn.plan_info)


def test_the_short_row_rules_plan_is_judged_by_the_routing_too(fake_gpu):
    """One 8192-token row among five of 100 tokens: 48 rows reach the saturating count, so the
    short-row rule alone would run dense, the long row on one CTA per K/V head; the routing judges
    that plan (not only the wave model's) and takes the units. Balanced short rows keep the rule."""
    from splitkv import DecodeAttention
    from splitkv.work_units import UnitPlan

    attn = DecodeAttention(32, 8, 128, tuned=False)
    assert isinstance(attn.plan([8192] + [100] * 5), UnitPlan), attn.plan_info
    plan = attn.plan([4096] * 3)
    assert not isinstance(plan, UnitPlan) and plan.num_splits == 2, attn.plan_info


def test_pages_of_16_take_64_ctas_for_short_splits_and_128_for_long_ones(fake_gpu):
    """Boxed pages shorter than a tile: the short-row rule's third more bytes in flight plan one
    16k row on 8 splits of 2048 tokens (64 CTAs) where the cache were contiguous it would be the
    same; a 64k row's 8 splits would stream 4 MiB each, past the pages' bound, so the wave model
    cuts it 16 ways (128 CTAs). Pages of 1 keep twice the bytes: 16 splits at 16k."""
    from splitkv import DecodeAttention

    for page, length, splits in ((16, 16384, 8), (16, 65536, 16), (1, 16384, 16)):
        attn = DecodeAttention(32, 8, 128, page_size=page, tuned=False)
        per = length // page
        plan = attn.plan([length], block_table=np.arange(per, dtype=np.int32).reshape(1, per))
        assert plan.variant == "split" and plan.num_splits == splits, (page, length, attn.plan_info)


def test_lengths_that_may_grow_after_plan_are_never_left_to_units(fake_gpu):
    """A units plan covers the lengths it was planned for: with device lengths that may grow up to
    max_len (graph replays), the default planner keeps to the split planner, whose grid covers
    max_len, and variant='units' is refused with how to plan instead."""
    from splitkv import DecodeAttention
    from splitkv.work_units import UnitPlan

    attn = DecodeAttention(32, 8, 128, q_dtype="fp16", kv_dtype="fp16")
    lens = [60000] + [512] * 63
    assert isinstance(attn.plan(_DeviceArray((64,), "<i4", lens)), UnitPlan)  # fixed lengths: units
    plan = attn.plan(_DeviceArray((64,), "<i4", lens), max_len=65536)
    assert not isinstance(plan, UnitPlan) and attn._launch.max_len == 65536
    assert plan.tokens_per_split * plan.num_splits >= 65536
    with pytest.raises(ValueError, match="max_len: a 'units' plan covers the lengths it is planned for"):
        attn.plan(_DeviceArray((64,), "<i4", lens), max_len=65536, variant="units")
    assert isinstance(attn.plan(_DeviceArray((64,), "<i4", lens), max_len=60000, variant="units"), UnitPlan)


def test_a_plan_that_fails_leaves_the_live_plan_as_it_was(fake_gpu):
    """plan() checks everything before it writes a buffer the live plan (or a graph captured over
    it) reads: a bad block table leaves the unit tables, lengths and page table untouched."""
    from splitkv import DecodeAttention

    for variant in ("units", None):
        attn = DecodeAttention(32, 8, 128, q_dtype="fp16", kv_dtype="fp16", page_size=16)
        table = np.arange(2 * 400, dtype=np.int32).reshape(2, 400)
        attn.plan([6096, 6096], block_table=table, variant=variant)
        live = attn._launch
        held = {name: buf.host.copy() for name, buf in attn._workspace._buffers.items()}
        bad = np.zeros((4, 2), dtype=np.int32)
        bad[3, 0] = -1
        with pytest.raises(ValueError, match="sequence 3"):
            attn.plan([20, 20, 20, 20], block_table=bad, variant=variant)
        assert attn._launch is live
        for name, buf in attn._workspace._buffers.items():
            assert np.array_equal(buf.host, held[name]), (variant, name)


def test_an_hnd_quantized_cache_takes_a_scale_per_kv_head(fake_gpu):
    """[pages, Hkv, page_size, ...]: the per-head scale has Hkv values, not page_size."""
    from splitkv import DecodeAttention
    from splitkv.quantize import QuantizedKV

    hkv, page, d = 8, 4, 128
    attn = DecodeAttention(32, hkv, d, q_dtype="fp16", kv_dtype="fp8_e4m3", page_size=page, kv_layout="HND")
    attn.plan([20, 20], block_table=np.arange(10, dtype=np.int32).reshape(2, 5))
    q = _DeviceArray((2, 32, d))

    def cache(scales):
        return QuantizedKV("fp8_e4m3", _DeviceArray((10, hkv, page, d), "|u1"), None, _DeviceArray((scales,), "<f4"))
    k = cache(hkv)
    attn.run(q, k, cache(hkv))
    assert launching.read_arrays(None, k, k, None, None)[2][4] == 1  # one scale per K/V head
    with pytest.raises(ValueError, match="k.scale"):
        attn.run(q, cache(page), cache(page))


def test_nvfp4_tensor_maps_view_the_values_as_bytes(fake_gpu):
    """NVFP4 values pack two per byte: the maps' rows are a token's heads of 64 bytes (head_dim 128),
    in byte elements, read in one 64-byte box per row."""
    from splitkv import DecodeAttention
    from splitkv.quantize import QuantizedKV

    hkv, d, length = 8, 128, 300
    attn = DecodeAttention(32, hkv, d, kv_dtype="nvfp4", tuned=False)
    attn.plan([length, length])
    assert attn._launch.spec.kv_copy == "tma" and attn._launch.spec.tma_box_bytes == 64

    def cache():
        return QuantizedKV("nvfp4", _DeviceArray((2, length, hkv, d // 2), "|u1"),
                           _DeviceArray((2, length, hkv, d // 16), "|u1"), _DeviceArray((1,), "<f4"))
    k, v = cache(), cache()
    attn.run(_DeviceArray((2, 32, d), "<u2"), k, v)
    assert fake_gpu.maps == [(k.values.__cuda_array_interface__["data"][0], 2 * length, hkv * d // 2),
                             (v.values.__cuda_array_interface__["data"][0], 2 * length, hkv * d // 2)]


def test_a_device_table_may_leave_pages_the_lengths_do_not_use_yet(fake_gpu):
    """With device lengths that may grow to max_len, validation checks the pages today's lengths use;
    the table must still be wide enough for max_len."""
    from splitkv import DecodeAttention

    attn = DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16", page_size=16)
    table = _DeviceArray((2, 4), "<i4")
    table.host = np.array([[0, -1, -1, -1], [1, -1, -1, -1]], np.int32)
    attn.plan(_DeviceArray((2,), "<i4", [10, 10]), max_len=64, block_table=table)
    assert attn._launch.max_len == 64
    with pytest.raises(ValueError, match="block_table: holds 4 pages of 16 tokens"):
        attn.plan(_DeviceArray((2,), "<i4", [10, 10]), max_len=65, block_table=table)


def test_a_units_plan_of_an_empty_cache_maps_a_stand_in_tile(fake_gpu):
    from splitkv import DecodeAttention

    attn = DecodeAttention(32, 8, 128, q_dtype="fp16", kv_dtype="fp16")
    attn.plan([0, 0], variant="units")
    attn.run(*_qkv(2, 32, 8, 128, 0))
    stand_in = attn._launch.empty_kv_ptr
    assert attn._launch.spec.kv_copy == "tma" and stand_in and {ptr for ptr, *_ in fake_gpu.maps} == {stand_in}


def test_run_refuses_results_that_overlap_the_inputs_every_call(fake_gpu):
    """out and lse are written while other CTAs read q, k and v: a result overlapping any of them,
    or the two overlapping each other, is refused (also on the fast path of a validated layout,
    where only the pointers are read)."""
    q, k, v = _qkv(2, 8, 2, 128, 1024)
    attn = runtime.DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16", tuned=False)
    attn.plan([5, 700])
    out, lse = _DeviceArray(q.shape), _DeviceArray((2, 8), "<f4")
    attn.run(q, k, v, out=out, lse=lse)  # apart: runs, and the layout is now validated
    launched = len(fake_gpu.launches)
    for bad, name in ((FakeCAI(q.shape, ptr=_ptr(k) + 4096), "out: overlaps k"),
                      (FakeCAI(q.shape, ptr=_ptr(q)), "out: overlaps q"),
                      (FakeCAI(q.shape, ptr=_ptr(v) + _nbytes(v) - 16), "out: overlaps v")):
        with pytest.raises(ValueError, match=name):
            attn.run(q, k, v, out=bad, lse=lse)
    with pytest.raises(ValueError, match="out: overlaps lse"):
        attn.run(q, k, v, out=out, lse=FakeCAI((2, 8), "<f4", ptr=_ptr(out) + 64))
    assert len(fake_gpu.launches) == launched  # nothing launched for them
    neighbour = FakeCAI(q.shape, ptr=_ptr(v) + _nbytes(v))  # right after v: apart
    attn.run(q, k, v, out=neighbour, lse=lse)
    assert len(fake_gpu.launches) == launched + 1


def _ptr(x) -> int:
    return x.__cuda_array_interface__["data"][0]


def _nbytes(x) -> int:
    cai = x.__cuda_array_interface__
    return int(np.prod(cai["shape"])) * np.dtype(cai["typestr"]).itemsize


def test_unaligned_lse_lengths_and_tables_and_big_endian_data_are_refused():
    """Pointers of 4-byte elements off their alignment (a bare interface may point anywhere) and
    big-endian data are refused by name before anything reads them."""
    q = tensors.describe(FakeCAI((2, 8, 128)), "q")
    with pytest.raises(ValueError, match="lse: expected a data pointer aligned to its 4-byte elements"):
        tensors.check_decode_inputs(q, tensors.describe(FakeCAI((2, 1024, 2, 128)), "k"),
                                    tensors.describe(FakeCAI((2, 1024, 2, 128)), "v"),
                                    lse=tensors.describe(FakeCAI((2, 8), "<f4", ptr=0x7000_0002), "lse"))
    with pytest.raises(ValueError, match="seq_lens: expected a data pointer aligned"):
        tensors.check_seq_lens(FakeCAI((2,), "<i4", ptr=0x7000_0002), 2, 1024)
    with pytest.raises(ValueError, match="block_table: expected a data pointer aligned"):
        tensors.check_block_table_info(tensors.describe(FakeCAI((2, 4), "<i4", ptr=0x7000_0006), "block_table"), 2)
    for typestr in (">f2", ">V2", ">i4"):
        with pytest.raises(TypeError, match="big-endian"):
            tensors.describe(FakeCAI((2, 8, 128), typestr), "q")


def test_bad_arguments_are_named_before_the_device_is_touched(fake_gpu, monkeypatch):
    """Unknown dtypes name their argument (no KeyError from deep inside, no device query first); a
    scale the programs would get as inf or 0 in float32 is refused; decode() with the 'HND' page
    layout but no block table is refused rather than read as 'NHD'."""
    import cupy

    def no_device(*args, **kwargs):
        raise AssertionError("the device was queried before the arguments were checked")

    monkeypatch.setattr(cupy.cuda, "Device", no_device)
    for kwargs, message in ((dict(q_dtype="fp32"), "q_dtype: expected one of"),
                            (dict(kv_dtype="int8"), "kv_dtype: expected one of"),
                            (dict(sm_scale=1e39), "sm_scale: 1e\\+39 x log2\\(e\\) is outside"),
                            (dict(sm_scale=1e-50), "sm_scale: 1e-50 x log2\\(e\\) is outside")):
        with pytest.raises(ValueError, match=message):
            runtime.DecodeAttention(32, 8, 128, **kwargs)
    monkeypatch.undo()
    q, k, v = _qkv(2, 8, 2, 128, 1024)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads 1024"):  # read as [B, Hkv, L, D]
        oneshot.decode(q, k, v, [5, 7], kv_layout="HND")
