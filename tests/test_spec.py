"""KernelSpec validation: every bad choice raises with the field's name."""

import numpy as np
import pytest

from splitkv.arch import ARCHS, arch_number, parse_arch
from splitkv.choices import HEAD_DIMS
from splitkv.heuristics import default_spec
from splitkv.spec import KernelSpec, MergeSpec


@pytest.mark.parametrize("arch, expected", [("sm90", "sm_90"), ("sm_90", "sm_90"), (90, "sm_90"),
                                            ("SM_100a", "sm_100a"), ("80", "sm_80")])
def test_arch_spellings(arch, expected):
    assert parse_arch(arch) == expected


@pytest.mark.parametrize("arch", ["sm_75", "hopper", "sm_9x", "", "sm_1000", "sm_95", "sm_80a"])
def test_bad_arch(arch):
    with pytest.raises(ValueError, match="arch"):
        parse_arch(arch)


@pytest.mark.parametrize("field, value", [
    ("head_dim", 80), ("group_size", 0), ("group_size", 17), ("q_dtype", "fp32"), ("kv_dtype", "int8"),
    ("variant", "paged"), ("warps", 3), ("tile_tokens", 8), ("stages", 1), ("chunk_size", 0),
    ("chunk_size", 48), ("kv_copy", "tensor"), ("kv_copy", "bulk"), ("mma_m", "dims"),
])
def test_bad_field_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        KernelSpec(**{field: value})


def test_shared_memory_limit():
    with pytest.raises(ValueError, match="shared memory"):
        KernelSpec(head_dim=256, warps=8, tile_tokens=64, stages=4, chunk_size=64)


def test_fused_merge_must_be_bool():
    with pytest.raises(TypeError, match="fused_merge"):
        KernelSpec(fused_merge=1)


def test_names_differ_per_field():
    base = KernelSpec()
    variants = [base.replace(head_dim=64), base.replace(group_size=8), base.replace(variant="dense"),
                base.replace(fused_merge=False), base.replace(stages=3), base.replace(chunk_size=512),
                base.replace(kv_dtype="fp16", q_dtype="fp16"), base.replace(arch="sm_100a"),
                base.replace(kv_copy="tma"), base.replace(cluster=8)]
    names = {s.name for s in [base, *variants]}
    assert len(names) == len(variants) + 1


def test_unknown_field_in_dict():
    with pytest.raises(ValueError, match="unknown"):
        KernelSpec.from_dict({**KernelSpec().to_dict(), "color": "red"})
    for retired in ({"steal_tiles": 0}, {"span_rows": False}):  # programs that are gone, even switched off
        with pytest.raises(ValueError, match="unknown"):
            KernelSpec.from_dict({**KernelSpec().to_dict(), **retired})


def test_merge_spec():
    assert MergeSpec(arch="sm90", head_dim=64).name == "sm_90-merge-d64-bf16"
    with pytest.raises(ValueError, match="out_dtype"):
        MergeSpec(out_dtype="fp32")
    assert arch_number("sm_90a") == 90


def test_merge_spec_threads_are_whole_warps_and_named():
    # The merge program's CTA size changes its code, so it must be valid and in the name.
    assert MergeSpec(threads=256).name == "sm_90-merge-d128-bf16-t256"
    assert MergeSpec(threads=64).name != MergeSpec(threads=256).name
    for bad in (7, 0, 2048):
        with pytest.raises(ValueError, match="threads"):
            MergeSpec(threads=bad)
    with pytest.raises(TypeError, match="threads"):
        MergeSpec(threads="x")


@pytest.mark.parametrize("field, value", [("head_dim", 128.0), ("warps", 4.0), ("group_size", True),
                                          ("cluster", 1.0), ("chunk_size", "256")])
def test_integer_fields_refuse_floats_bools_and_strings(field, value):
    # 128.0 == 128 and True == 1 would pass the choice checks and then print as 'd128.0' or 'gTrue'.
    with pytest.raises(TypeError, match=field):
        KernelSpec(**{field: value})


def test_integral_values_become_plain_ints():
    spec = KernelSpec(head_dim=np.int64(128), group_size=np.int32(4))
    assert spec == KernelSpec() and spec.name == KernelSpec().name
    assert type(spec.head_dim) is int and type(spec.group_size) is int


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_default_shapes_fit_every_known_arch(arch):
    # sm_86, sm_89 and sm_120 allow 99 KB per CTA: the built-in shapes must shrink to fit there.
    for head_dim in HEAD_DIMS:
        for group in (1, 4, 8, 16):
            for variant in ("split", "dense"):
                spec = default_spec(f"sm_{arch}", head_dim, group, variant=variant)
                assert spec.smem_bytes + spec.static_smem_bytes <= ARCHS[arch].smem_per_cta
    # Where the H200's shape fits, it is kept.
    if ARCHS[arch].smem_per_cta >= 163 * 1024:
        assert default_spec(f"sm_{arch}", 128, 4).tile_tokens == 32


def test_tensor_copies_need_sm90_and_whole_boxes():
    spec = KernelSpec(arch="sm_90", kv_copy="tma")
    assert spec.name.endswith("-tma")
    assert spec.smem_pad == 0 and KernelSpec(arch="sm_90").smem_pad > 0  # swizzled, not padded
    with pytest.raises(ValueError, match="kv_copy"):
        KernelSpec(arch="sm_80", kv_copy="tma")
    with pytest.raises(ValueError, match="boxes of 128 bytes"):
        KernelSpec(arch="sm_90", kv_copy="tma", head_dim=96)
    with pytest.raises(ValueError, match="boxes of 128 bytes"):  # FP8's 64-byte rows: no box
        KernelSpec(arch="sm_90", kv_copy="tma", head_dim=64, kv_dtype="fp8_e4m3", tile_tokens=64, chunk_size=256)
    # The unpadded rings are smaller; the 1024-byte alignment of the rings counts as static memory.
    assert spec.smem_bytes < KernelSpec(arch="sm_90").smem_bytes
    assert spec.static_smem_bytes >= 1024


def test_nvfp4_rows_arrive_through_one_box_each_beside_per_lane_block_scales():
    from splitkv.choices import tma_box_bytes

    # Rows of 32, 64 and 128 bytes (head_dim 64, 128, 256): one box each, swizzled over its span.
    assert [tma_box_bytes(d, "nvfp4") for d in (64, 128, 256, 96)] == [32, 64, 128, None]
    # Other formats keep boxes of 128 bytes: FP8 at head_dim 64 (64-byte rows) is not boxed.
    assert tma_box_bytes(64, "fp8_e4m3") is None and tma_box_bytes(128, "fp8_e4m3") == 128
    base = dict(arch="sm_90", kv_dtype="nvfp4", warps=8, chunk_size=256)
    spec = KernelSpec(**base, kv_copy="tma")
    assert spec.name.endswith("-tma") and spec.tma_box_bytes == 64
    assert default_spec("sm_90", 128, 4, kv_dtype="nvfp4").kv_copy == "tma"
    assert default_spec("sm_90", 128, 4, kv_dtype="nvfp4", page_size=4).kv_copy == "cp_async"


def test_cluster_inbox_sits_past_the_rings_and_the_combine():
    # Every member's slice of the output, and its log-sum-exps, land in the owner's inbox while the
    # owner may still be streaming: the inbox must not overlap the rings or the combine area.
    for spec in (KernelSpec(chunk_size=128, cluster=8), KernelSpec(head_dim=256, group_size=16, tile_tokens=16,
                                                                    chunk_size=64, cluster=16)):
        ring = spec.warps * spec.stages * spec.tile_tokens * (spec.head_dim + 8) * 2 * 2
        combine = (spec.warps * (spec.group_size * spec.head_dim + 32) + 32) * 4
        assert spec.inbox_offset >= max(ring, combine) and spec.inbox_offset % 16 == 0
        assert spec.cluster * spec.cluster_slice >= spec.group_size * spec.head_dim
        assert spec.smem_bytes == spec.inbox_offset + spec.cluster * (spec.cluster_slice + 16) * 4
    plain = KernelSpec(chunk_size=128, cluster=1)
    assert plain.smem_bytes == plain.inbox_offset  # no inbox without a cluster


@pytest.mark.parametrize("cluster", range(2, 17))
def test_every_cluster_size_covers_the_output_in_aligned_slices(cluster):
    # Whole-row clusters take any size up to 16: member r merges elements [r S, (r + 1) S), pushed
    # four at a time, so S is a multiple of 4 and the members together cover all of G x D (members
    # past the end own nothing, but still count every member's log-sum-exps on their barrier).
    for head_dim in HEAD_DIMS:
        for group in (1, 2, 4, 8, 16):
            spec = default_spec("sm_90", head_dim, group).replace(cluster=cluster)
            size = group * head_dim
            assert spec.cluster_slice % 4 == 0 and spec.cluster_slice > 0
            assert cluster * spec.cluster_slice >= size > (cluster * spec.cluster_slice) - 4 * cluster
            assert f"-k{cluster}" in spec.name


def test_warp_heads_is_a_dense_layout():
    spec = KernelSpec(variant="dense", warp_heads=True)
    assert spec.name.endswith("-wh") and not KernelSpec(variant="dense").name.endswith("-wh")
    assert spec.smem_bytes == KernelSpec(variant="dense").smem_bytes  # the same rings and states
    assert spec.as_dense() == spec
    with pytest.raises(ValueError, match="warp_heads"):
        KernelSpec(variant="split", warp_heads=True)
    with pytest.raises(TypeError, match="warp_heads"):
        KernelSpec(variant="dense", warp_heads=1)


def test_clusters_need_sm90():
    with pytest.raises(ValueError, match="cluster"):
        KernelSpec(arch="sm_80", cluster=2)


def test_static_shared_memory_counts_against_the_limit():
    # sm_86 allows 99 KB per CTA: a ring that fills it exactly leaves no room for the barriers.
    with pytest.raises(ValueError, match="shared memory"):
        KernelSpec(arch="sm_86", head_dim=256, warps=1, tile_tokens=32, stages=3, chunk_size=32)
    spec = KernelSpec(kv_copy="tma")  # two mbarriers per ring stage
    assert spec.static_smem_bytes >= 16 * spec.warps * spec.stages


def test_tokens_on_the_mma_rows_need_groups_up_to_8():
    assert KernelSpec(group_size=8, mma_m="tokens").name.endswith("-mt")
    with pytest.raises(ValueError, match="mma_m"):
        KernelSpec(group_size=16, mma_m="tokens")


def test_warpgroup_mmas_take_whole_warpgroups_on_sm90_and_compile_for_sm90a():
    spec = KernelSpec(kv_copy="tma", mma_m="warpgroup", tile_tokens=64, query_tokens=16)
    assert spec.name.endswith("-tma-wg-q16") and spec.compile_arch == "sm_90a" and spec.arch == "sm_90"
    assert KernelSpec(kv_copy="tma").compile_arch == "sm_90"
    # Rows short of a warpgroup's 64 are padding: still four row slices (one warpgroup) ...
    assert spec.replace(query_tokens=1).row_slices == 4 and spec.replace(query_tokens=1).cta_rows == 4
    # ... and 128 rows two warpgroups on one ring with 8 warps, two row blocks with 4.
    wide = spec.replace(group_size=8, warps=8)
    assert (wide.row_slices, wide.token_streams, wide.row_blocks) == (8, 1, 1)
    assert (spec.replace(group_size=8).row_slices, spec.replace(group_size=8).row_blocks) == (4, 2)
    for bad, why in ((dict(kv_copy="cp_async"), "kv_copy='tma'"), (dict(kv_dtype="fp8_e4m3"), "16-bit"),
                     (dict(head_dim=256), "head_dim 64 or 128"), (dict(warps=2), "warpgroups of 4"),
                     (dict(arch="sm_100a"), "sm_90a alone"), (dict(arch="sm_80", kv_copy="cp_async"), "sm_90a alone"),
                     (dict(variant="dense", warp_heads=True, query_tokens=1), "warp_heads")):
        with pytest.raises(ValueError, match=why):
            spec.replace(**bad)
    # A warp per K/V head is a layout of the warps' own MMAs.
    dense = spec.replace(variant="dense", query_tokens=1, tile_tokens=32)
    assert dense.as_warp_heads().mma_m == "heads" and dense.as_warp_heads().warp_heads


def test_paged_caches_are_named_and_checked():
    assert KernelSpec(page_size=16).name.endswith("-p16")
    assert KernelSpec(page_size=16, kv_layout="HND").name.endswith("-p16hnd")
    assert KernelSpec(page_size=16).tma_box_rows == 16 and KernelSpec(page_size=64).tma_box_rows == 32
    assert KernelSpec().tma_box_rows == 32 and not KernelSpec().paged
    for bad in (3, 512, -16):
        with pytest.raises(ValueError, match="page_size"):
            KernelSpec(page_size=bad)
    # Contiguous caches in transformers' [B, Hkv, L, D] order, 16-bit K/V only.
    assert KernelSpec(kv_layout="HND").name.endswith("-hnd")
    with pytest.raises(ValueError, match="kv_layout"):
        KernelSpec(kv_layout="HND", kv_dtype="fp8_e4m3", tile_tokens=64)
    with pytest.raises(ValueError, match="kv_layout"):
        KernelSpec(page_size=16, kv_layout="NDH")
    # A tensor-map box is a whole number of the swizzle's 8-row periods.
    KernelSpec(page_size=8, kv_copy="tma")
    with pytest.raises(ValueError, match="page_size 4 needs kv_copy='cp_async'"):
        KernelSpec(page_size=4, kv_copy="tma")


def test_default_paged_shapes_copy_small_pages_per_lane():
    assert default_spec("sm_90", 128, 4, page_size=16).kv_copy == "tma"
    assert default_spec("sm_90", 128, 4, page_size=4).kv_copy == "cp_async"
    assert default_spec("sm_90", 128, 4, page_size=1, kv_layout="HND").kv_layout == "HND"


def test_dense_programs_on_pages_shorter_than_16_tokens_take_the_split_tiles():
    # Per-lane copies of a row per page: the rows in flight count, so the dense program keeps the
    # split's 32-token tiles two deep there (contiguous caches without tensor maps keep 16 three deep).
    for arch, page_size in (("sm_90", 1), ("sm_90", 4), ("sm_80", 8)):
        dense = default_spec(arch, 128, 4, variant="dense", page_size=page_size)
        assert (dense.tile_tokens, dense.stages) == (32, 2), (arch, page_size, dense.name)
    for page_size in (0, 16):
        dense = default_spec("sm_80", 128, 4, variant="dense", page_size=page_size)
        assert (dense.tile_tokens, dense.stages) == (16, 3), (page_size, dense.name)


def test_whole_row_clusters_are_left_out_for_pages_shorter_than_a_tile():
    from splitkv.heuristics import takes_whole_row_clusters

    assert takes_whole_row_clusters(default_spec("sm_90", 128, 4))
    assert takes_whole_row_clusters(default_spec("sm_90", 128, 4, page_size=64))
    assert not takes_whole_row_clusters(default_spec("sm_90", 128, 4, page_size=16))
    assert not takes_whole_row_clusters(default_spec("sm_90", 128, 4, kv_dtype="nvfp4"))


def test_saturating_ctas_count_the_bytes_in_flight():
    from splitkv.heuristics import SATURATING_BYTES_IN_FLIGHT, saturating_ctas

    d128, d64 = default_spec("sm_90", 128, 4), default_spec("sm_90", 64, 4)
    assert saturating_ctas(d128) == -(-SATURATING_BYTES_IN_FLIGHT // d128.smem_bytes) == 47
    assert saturating_ctas(d64) > 1.9 * saturating_ctas(d128)  # half the ring: about twice the CTAs
    # Pages shorter than a tile: twice the bytes copied a row per lane, a third more through a box
    # per page (64 CTAs at head_dim 128: 8 rows of 8 splits, one cluster each); pages of a tile and
    # more: as contiguous caches.
    paged1 = default_spec("sm_90", 128, 4, page_size=1)
    assert paged1.kv_copy == "cp_async"
    assert saturating_ctas(paged1) == -(-2 * SATURATING_BYTES_IN_FLIGHT // paged1.smem_bytes)
    paged16 = default_spec("sm_90", 128, 4, page_size=16)
    assert paged16.kv_copy == "tma" and paged16.page_size < paged16.tile_tokens
    assert saturating_ctas(paged16) == -(-SATURATING_BYTES_IN_FLIGHT * 4 // 3 // paged16.smem_bytes) == 63
    assert saturating_ctas(default_spec("sm_90", 128, 4, page_size=64)) == 47
    assert saturating_ctas(default_spec("sm_90", 128, 4, kv_dtype="nvfp4")) is None
    # Several query tokens on 16-row MMAs stream slower than their bytes allow: the wave model
    # (row slices and row blocks alike); 8 rows on the tokens layout keep the rule.
    t8 = default_spec("sm_90", 128, 4, query_tokens=8)
    assert (t8.row_blocks, t8.row_slices, t8.token_streams) == (1, 2, 4)
    assert saturating_ctas(t8) is None and saturating_ctas(default_spec("sm_90", 128, 4, query_tokens=4)) is None
    t2 = default_spec("sm_90", 128, 4, query_tokens=2)
    assert t2.mma_rows == 8 and saturating_ctas(t2) == -(-SATURATING_BYTES_IN_FLIGHT // t2.smem_bytes)
    assert saturating_ctas(default_spec("sm_90", 128, 16)) is not None  # one token, 16 rows


def test_the_short_row_rule_takes_shorter_splits_on_boxed_short_pages():
    from splitkv.heuristics import SHORT_PAGE_FEW_SPLITS_MAX_BYTES, few_splits_max_bytes
    from splitkv.plan import FEW_SPLITS_MAX_BYTES

    assert SHORT_PAGE_FEW_SPLITS_MAX_BYTES < FEW_SPLITS_MAX_BYTES
    assert few_splits_max_bytes(default_spec("sm_90", 128, 4, page_size=16)) == SHORT_PAGE_FEW_SPLITS_MAX_BYTES
    assert few_splits_max_bytes(default_spec("sm_90", 128, 4, page_size=8)) == SHORT_PAGE_FEW_SPLITS_MAX_BYTES
    for spec in (default_spec("sm_90", 128, 4), default_spec("sm_90", 128, 4, page_size=1),
                 default_spec("sm_90", 128, 4, page_size=64), default_spec("sm_80", 128, 4, page_size=16)):
        assert few_splits_max_bytes(spec) == FEW_SPLITS_MAX_BYTES, spec.name
