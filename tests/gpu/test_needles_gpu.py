"""Needle tests of every decode program the product keeps (marker: gpu).

One token per (sequence, K/V head) holds the softmax mass of its row and its V row names it
(tests/needles.py): each query head must output that V row within 1e-2 and the needle's logit as
its LSE within about 1e-4, so a dropped, doubled, misplaced or misaligned tile fails by ~100% (or
by ln 2 in the LSE), however long the row. The needles go to the boundaries of the plan that was
made (first and last token, tiles, splits, clusters, work units, pages), a few rounds per case,
each with new positions on the same plan and programs. Outputs are NaN before every call (the
ones run() allocates too, see conftest.py); caches hold NaN past every length and in every page
row no length reads.

Programs compiled (bf16 Q and K/V, head_dim 128, group 4 unless named; S the built-in split shape
``default_spec('sm_90', 128, 4)``: tensor maps, tokens on the MMA rows, clusters up to 16; S1 the
same with clusters of 1), 33 in all:

 1-3    S1 split (fused merge), dense, dense with a warp per K/V head
 4-5    S split in clusters of 16 (loaded for its registers too) and of 8
 6-7    S1 split without the fused merge, and the merge program
 8-9    S1 units and the units' merge program (also what the planner routes the ragged batch to,
        with the tuned table's S)
 10-15  S1 with kv_copy='cp_async', with mma_m='heads', and fp16 Q and K/V: split and dense each
 16-17  head_dim 256, group 16 (16-token tiles, the heads on the MMA rows): split and dense
 18-21  FP8 E4M3 and NVFP4 (their built-in shapes): split and dense each
 22-23  paged split: FP8 in pages of 16 (HND), NVFP4 in pages of 64 (NHD)
 24-31  paged split and dense: pages of 1 NHD (per-lane copies), 16 HND, 64 NHD, 256 HND
 32     paged units, pages of 16 HND
 33     decode()'s plan for 2 sequences of 100k and 3k: the tuned table's S, in the clusters the
        planner takes for them (of 4 on 132 SMs, by its arithmetic)

Cases that share a program share its compile (the loader keeps programs per spec and device).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import pytest

import seeds

cupy = pytest.importorskip("cupy")

import needles  # noqa: E402
import splitkv  # noqa: E402
from splitkv import DecodeAttention, QuantizedKV  # noqa: E402
from splitkv.choices import QUANTIZED_KV_DTYPES  # noqa: E402
from splitkv.heuristics import default_spec  # noqa: E402

from decode_checks import poisoned, to_float64  # noqa: E402

pytestmark = pytest.mark.gpu

#: Tokens past the longest sequence in a contiguous cache (NaN): none of them may be read.
TAIL = 3
#: Pages no table entry names, and table columns past what the lengths need (entries -1).
SPARE_PAGES, SPARE_COLUMNS = 3, 1
#: NaN in each storage: bf16 bits, fp16, and the E4M3 code (FP8 values, NVFP4 block scales).
NAN_BITS = {"bf16": 0x7FC0, "fp16": np.float16(np.nan), "fp8_e4m3": 0x7F, "nvfp4": 0x7F}


def spec_of(head_dim=128, group=4, q_dtype="bf16", kv_dtype="bf16", page=None, **changes):
    """The built-in split shape of a layout (see the module notes), with ``changes``."""
    page_size, layout = page or (0, "NHD")
    return default_spec("sm_90", head_dim, group, q_dtype, kv_dtype, page_size=page_size,
                        kv_layout=layout).replace(**changes)


S = spec_of()
S1 = S.replace(cluster=1)


@dataclasses.dataclass(frozen=True)
class Case:
    """One program layout: the instance (``spec`` None: the tuned or built-in choice), the lengths,
    what to plan, and what the plan must have launched (``expect(plan, launched spec, attn)``)."""

    name: str
    lens: tuple
    spec: object = None
    plan: tuple = ()  # plan() keyword arguments, as (name, value) pairs
    expect: Callable = lambda plan, spec, attn: True
    num_kv: int = 8
    group: int = 4
    head_dim: int = 128
    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    page: tuple | None = None  # (page_size, layout)
    max_rounds: int = 6
    allocate: bool = False  # run(return_lse=True) without out=: run() allocates (NaN in tests)
    one_shot: bool = False  # splitkv.decode(..., return_lse=True); ``spec`` must be None
    exclusive: bool = False  # so much memory that a parallel run gives it the GPU alone


def dense(warp_heads=False):
    """plan() arguments of a dense plan, with or without a warp per K/V head."""
    return (("variant", "dense"), ("warp_heads", warp_heads))


def split(num_splits):
    """plan() arguments of a split plan of ``num_splits`` splits of the longest sequence."""
    return (("variant", "split"), ("num_splits", num_splits))


UNITS = (("variant", "units"),)
SHORT = (1, 33, 4096 + 77, 20000)
RAGGED = (3000, 17, 8000 + 5, 0)
PAGED = (7, 1077, 2048 + 33, 300)


def is_dense(plan, spec, attn):
    return plan.variant == "dense" and spec.variant == "dense" and not spec.warp_heads


def is_split(fused=True, cluster=1):
    def check(plan, spec, attn):
        return plan.variant == "split" and spec.fused_merge == fused and spec.cluster == cluster
    return check


def is_units(split_rows: bool | None = True):
    def check(plan, spec, attn):
        return spec.variant == "units" and (split_rows is None or plan.split == split_rows)
    return check


def cases() -> list[Case]:
    found = [
        Case("dense", SHORT, S1, dense(), is_dense, allocate=True),
        Case("dense-warp-per-head", (0, 7, 1077, 3000), S1, dense(True),
             lambda plan, spec, attn: spec.warp_heads and plan.heads_per_cta == 4),
        Case("split-fused-merge", RAGGED, S1, split(5), is_split()),
        # The planner's own layout for 8 rows of 128k: one cluster of 8 per row (about half the SMs).
        Case("split-whole-row-clusters", (131072,), S, (),
             lambda plan, spec, attn: plan.variant == "split" and 1 < spec.cluster == plan.num_splits, max_rounds=8),
        # One K/V head, 32 splits: two clusters of 16 per row, merged in two levels.
        Case("split-clusters-per-row", (131072, 65536 + 7), S, split(32),
             lambda plan, spec, attn: plan.variant == "split" and 1 < spec.cluster < plan.num_splits,
             num_kv=1, max_rounds=12),
        Case("split-separate-merge", (5000, 3, 9000, 1077), S1.replace(fused_merge=False), split(6),
             lambda plan, spec, attn: is_split(fused=False)(plan, spec, attn) and attn._launch.merge_fn is not None),
        Case("units", (65536,) + (512,) * 7, S1, UNITS, is_units()),
        # A long row among whole waves of short ones: the planner routes the batch to units. 33
        # rows padded to 64k: tens of GB of float32 inputs and their temporaries.
        Case("routed-to-units", (65536,) + (512,) * 32, None, (), is_units(None), max_rounds=3, exclusive=True),
        Case("cp-async-split", RAGGED, S1.replace(kv_copy="cp_async"), split(5), is_split()),
        Case("cp-async-dense", SHORT, S1.replace(kv_copy="cp_async"), dense(), is_dense),
        Case("mma-heads-split", RAGGED, S1.replace(mma_m="heads"), split(5), is_split()),
        Case("mma-heads-dense", SHORT, S1.replace(mma_m="heads"), dense(), is_dense),
        Case("fp16-split", RAGGED, spec_of(q_dtype="fp16", kv_dtype="fp16", cluster=1), split(5), is_split(),
             q_dtype="fp16", kv_dtype="fp16"),
        Case("fp16-dense", SHORT, spec_of(q_dtype="fp16", kv_dtype="fp16", cluster=1), dense(), is_dense,
             q_dtype="fp16", kv_dtype="fp16"),
        Case("head-dim-256-group-16-split", RAGGED, spec_of(256, 16, cluster=1), split(5), is_split(),
             num_kv=2, group=16, head_dim=256),
        Case("head-dim-256-group-16-dense", SHORT, spec_of(256, 16, cluster=1), dense(), is_dense,
             num_kv=2, group=16, head_dim=256),
        Case("decode-one-shot", (100000, 3000), one_shot=True),
    ]
    for kv_dtype in QUANTIZED_KV_DTYPES:
        spec = spec_of(kv_dtype=kv_dtype, cluster=1)
        found += [Case(f"{kv_dtype}-split", RAGGED, spec, split(5), is_split(), kv_dtype=kv_dtype),
                  Case(f"{kv_dtype}-dense", SHORT, spec, dense(), is_dense, kv_dtype=kv_dtype)]
    for kv_dtype, page in (("fp8_e4m3", (16, "HND")), ("nvfp4", (64, "NHD"))):
        spec = spec_of(kv_dtype=kv_dtype, page=page, cluster=1)
        found.append(Case(f"{kv_dtype}-paged-{page[0]}-{page[1]}", PAGED, spec, split(5), is_split(), kv_dtype=kv_dtype,
                          page=page))
    for page in ((1, "NHD"), (16, "HND"), (64, "NHD"), (256, "HND")):  # pages shorter than a tile, and longer
        spec = spec_of(page=page, cluster=1)
        found += [Case(f"paged-{page[0]}-{page[1]}-split", PAGED, spec, split(5), is_split(), page=page),
                  Case(f"paged-{page[0]}-{page[1]}-dense", PAGED, spec, dense(), is_dense, page=page)]
    found.append(Case("paged-16-HND-units", (4096, 77, 3000), spec_of(page=(16, "HND"), cluster=1), UNITS, is_units(),
                      page=(16, "HND")))
    return found


@pytest.mark.parametrize("case", [pytest.param(case, id=case.name,
                                               marks=[pytest.mark.gpu_exclusive] if case.exclusive else [])
                                  for case in cases()])
def test_needles(case: Case):
    lens = [int(n) for n in case.lens]
    batch, num_qo = len(lens), case.num_kv * case.group
    rng = seeds.rng("needles", case.name)
    quantized = case.kv_dtype in QUANTIZED_KV_DTYPES
    longest = max(max(lens), 1)
    base = needles.random_base(batch, longest + (0 if case.page else TAIL), case.num_kv, case.group, case.head_dim,
                               seed=int(rng.integers(2**31)), q_dtype=case.q_dtype,
                               kv_dtype="bf16" if quantized else case.kv_dtype, xp=cupy)
    pages = None
    if case.page:  # K and V share one page order, so one block table serves both
        page_size, layout = case.page
        per_seq = -(-longest // page_size)
        order = rng.permutation(batch * per_seq + SPARE_PAGES)
        table = needles.block_table(order, batch, per_seq)
        table = np.concatenate([table, np.full((batch, SPARE_COLUMNS), -1, np.int32)], axis=1)
        pages = (page_size, layout, order, cupy.asarray(table))

    paging = dict(page_size=case.page[0], kv_layout=case.page[1]) if case.page else {}
    attn = DecodeAttention(num_qo, case.num_kv, case.head_dim, q_dtype=case.q_dtype, kv_dtype=case.kv_dtype,
                           spec=case.spec, **paging)  # one_shot: the probe that plans as decode() does
    plan = attn.plan(lens, block_table=pages[3] if pages else None, **dict(case.plan))
    launched = attn._launch.spec
    assert case.expect(plan, launched, attn), f"{case.name}: planned otherwise: {attn.plan_info}"
    label = f"{case.name}: {attn.plan_info}"
    print(label)

    q = needles.stored(base.q, case.q_dtype)
    candidates = needles.plan_boundaries(plan, lens, launched)
    for positions, labels in needles.needle_rounds(candidates, case.num_kv, rng, case.max_rounds):
        with needles.placed(base, positions) as (k32, v32):
            k, k_read = cache_of(k32, case.kv_dtype, lens, pages)
            v, v_read = cache_of(v32, case.kv_dtype, lens, pages)
            expected = needles.expected_results(base.q, k_read, v_read, lens, positions, base.sm_scale, labels)
        del k_read, v_read
        if case.one_shot:
            out, lse = splitkv.decode(q, k, v, lens, return_lse=True)
        elif case.allocate:
            out, lse = attn.run(q, k, v, return_lse=True)
        else:
            out = poisoned((batch, num_qo, case.head_dim), case.q_dtype)
            lse = cupy.full((batch, num_qo), cupy.nan, dtype=cupy.float32)
            attn.run(q, k, v, out=out, lse=lse)
        needles.assert_needles(to_float64(out, case.q_dtype), lse, expected,
                               f"{label}, needles at {positions.tolist()}")


def cache_of(x32, kv_dtype: str, lens, pages):
    """K or V (float32 values, exact in bf16/fp16) as the program reads it: (the cache in its storage,
    NaN past every length, paged when ``pages`` says so; the values it holds, for the expected
    results: float32, or float64 for a quantized cache)."""
    quantized = kv_dtype in QUANTIZED_KV_DTYPES
    if quantized:
        cache = splitkv.quantize_kv(needles.stored(x32, "bf16"), kv_dtype)
        values = cache.dequantize_reference(on_device=True)
        parts = [cache.values, cache.block_scales]
    else:
        values = x32
        parts = [needles.stored(x32, kv_dtype), None]
    nan = NAN_BITS[kv_dtype]
    nan_part = 1 if kv_dtype == "nvfp4" else 0  # NVFP4's NaN is a block scale's
    for b, n in enumerate(lens):
        parts[nan_part][b, n:] = nan
    if pages is not None:
        page_size, layout, order, _ = pages
        parts = [None if p is None else needles.to_pages(p, lens, page_size, layout, order, nan if i == nan_part else 0)
                 for i, p in enumerate(parts)]
    if quantized:
        return QuantizedKV(kv_dtype, parts[0], parts[1], cache.scale), values
    return parts[0], values
