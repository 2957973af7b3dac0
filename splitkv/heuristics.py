"""The built-in choice of CTA shape per workload key, and occupancy arithmetic.

This is the fallback of the tuned tables (`splitkv.tuned`): one CTA shape per (head_dim, group
size, dtypes) chosen from measurements on an H200, the short-row rule's terms (the bytes in flight
that saturate the memory system), and the resident-CTA count the planner needs, computed from the
compiled kernel's registers and shared memory. The measurements behind each choice are in
docs/experiments.md, under the names given here.
"""

from __future__ import annotations

from .arch import ARCHS, arch_number
from .choices import QUANTIZED_KV_DTYPES, STAGES, TMA_SWIZZLE_ROWS, WARP_ROWS, row_slices, rows_fit_tma_boxes
from .plan import FEW_SPLITS_MAX_BYTES
from .spec import KernelSpec, SharedMemoryError

#: 32-bit registers per SM (the same from sm_80 through sm_120).
_REGISTERS_PER_SM = 65536
#: The driver reserves 1 KB of shared memory per resident CTA.
_SMEM_RESERVED_PER_CTA = 1024


def default_spec(arch: str, head_dim: int, group_size: int, q_dtype: str = "bf16", kv_dtype: str = "bf16",
                 variant: str = "split", page_size: int = 0, kv_layout: str = "NHD",
                 query_tokens: int = 1) -> KernelSpec:
    """The built-in CTA shape: four warps, each streaming its own tiles through a ring in shared memory.

    On sm_90 and newer, K/V tiles arrive through tensor maps (``kv_copy="tma"``) wherever a row is a
    whole number of 128-byte boxes: per-lane copies cap a stream of 128 CTAs below a plain read
    kernel, and the copy engine's boxes (one request per box) reach it ("Per-lane cp.async against
    tensor maps"). NVFP4's rows of 32-128 bytes arrive a box each, their block scales by per-lane
    cp.async beside them ("NVFP4 values through tensor maps"; the scales as boxes of 16-byte rows
    were slower: "NVFP4 block scales through tensor maps too"). Elsewhere (sm_80, head_dim 96, FP8
    at head_dim 64) every lane copies 16-byte pieces with cp.async.

    Split: 32-token tiles two stages deep, so one split gets a whole number of 128-token chunks
    (one tile per warp), fine enough for the planner to cut short sequences into many splits.
    Dense with cp.async: 16-token tiles three stages deep, three quarters of the ring's bytes, so two
    CTAs share an SM; the dense program runs when the batch alone fills the GPU, often in several
    waves, and there a second resident CTA hides the first one's prologue and tail. Dense with
    tensor maps: the split shape, which beat 16-token tiles three deep on multi-wave batches once
    rows arrived as unpadded boxes ("Dense ring"). head_dim 256 keeps 16-token tiles two stages
    deep for both, to fit the ring in shared memory. Groups up to 8 put the tokens on the MMA's 16
    rows (``mma_m="tokens"``) instead of padding the query heads to 16 rows, which halves the MMAs
    where the math is exposed and was never slower ("Tokens on the MMA rows").

    Quantized K/V (one shape for dense and split): a tile's bytes shrink with the format, and fewer
    bytes in flight per SM read slower, so FP8 tiles hold twice the tokens; NVFP4, whose software
    E2M1 decode is bound by instruction issue, runs eight warps three stages deep instead: more
    warps to issue the decode, where longer tiles were slower (Quantized K/V: "Built-in shapes").

    Several query tokens per sequence (``query_tokens`` > 1) multiply the math per K/V byte by the
    tokens: where tiles are 32 tokens or more, twice the warps take half as long tiles (the ring's
    bytes the same), so that two warps share each SM sub-partition and one's math hides under the
    other's wait; where the rows exceed one MMA tile (16 rows) no clusters (docs/experiments.md:
    "Several query tokens: built-in shapes"; measured at head_dim 64 and 128, BF16 and FP8). Rows
    past 16 take row slices of warps that share each ring (`KernelSpec.row_slices`), so a CTA holds
    fewer rings: each is made deeper, up to four stages, to keep the bytes in flight.

    Paged caches (``page_size`` > 0) keep these shapes; tensor maps take pages of 8 tokens and more
    (a box per page when pages are shorter than a tile), shorter pages per-lane copies; on pages
    shorter than 16 tokens the dense program takes the split's tiles.
    """
    dense = variant == "dense"
    tma = (arch_number(arch) >= 90 and rows_fit_tma_boxes(head_dim, kv_dtype)
           and (page_size == 0 or page_size >= TMA_SWIZZLE_ROWS))
    # Pages shorter than the 16-token tile split every tile over several pages, a row per page at
    # the shortest: there the rows in flight per CTA count, so the split shape's 32-token tiles two
    # deep beat 16 three deep, and the batches measured fill the SMs once, so no second CTA would
    # share one ("Dense program on pages shorter than 16 tokens", measured on pages of 1). Pages of
    # 2 to 8 follow pages of 1 here unmeasured.
    short_pages = 0 < page_size < 16
    small_dense = dense and not tma and kv_dtype not in QUANTIZED_KV_DTYPES and not short_pages
    tile = 16 if head_dim > 128 or small_dense else 32
    stages = 3 if small_dense and head_dim <= 128 else 2
    warps = 4
    if kv_dtype == "fp8_e4m3":
        tile *= 2
    elif kv_dtype == "nvfp4":
        warps, stages = 8, 3
    cluster = 16 if variant == "split" and arch_number(arch) >= 90 else 1

    rows = group_size * query_tokens
    if query_tokens > 1 and warps == 4 and tile >= 32:
        warps, tile = 8, tile // 2
    if rows > WARP_ROWS:
        cluster = 1

    def shape(warps, tile, stages):
        stages = min(stages * row_slices(rows, warps), max(STAGES))
        return KernelSpec(arch=arch, head_dim=head_dim, group_size=group_size, q_dtype=q_dtype,
                          kv_dtype=kv_dtype, variant=variant, chunk_size=warps * tile, warps=warps,
                          tile_tokens=tile, stages=stages, cluster=cluster, kv_copy="tma" if tma else "cp_async",
                          mma_m="tokens" if rows <= 8 else "heads", page_size=page_size, kv_layout=kv_layout,
                          query_tokens=query_tokens)

    # GPUs with 99 KB of shared memory per CTA (sm_86, sm_89, sm_120) cannot hold these rings: the
    # ring shrinks (shorter tiles, then fewer stages, then fewer warps) until the spec accepts it.
    candidates = [(warps, tile, stages), (4, tile, stages), (4, max(tile // 2, 16), stages), (4, 16, stages), (4, 16, 2),
                  (2, 16, 2), (1, 16, 2)]
    for candidate in dict.fromkeys(candidates):  # in order, without repeats
        try:
            return shape(*candidate)
        except SharedMemoryError:
            continue
    return shape(*candidates[-1])  # raises, naming the shared memory even the smallest ring needs


def takes_whole_row_clusters(spec: KernelSpec) -> bool:
    """Whether the planner may put each row's splits of ``spec``'s split program in one cluster on
    about half the SMs (`plan.WHOLE_ROW_SHARE`). Half the SMs stream as fast as all of them where
    each SM streams at full speed; not so for NVFP4's decode, bound by instruction issue, which
    needs every SM's issue slots ("NVFP4 needs its 128 CTAs"), nor for paged caches of pages
    shorter than a tile, fetched a page at a time in smaller requests, where more CTAs must stream
    to keep the bytes in flight ("16-row boxes need more CTAs"). Pages of a tile or more stream as a
    contiguous cache does and keep whole-row clusters."""
    return spec.kv_dtype != "nvfp4" and not _short_pages(spec)


#: Bytes in flight (the CTAs' rings in shared memory together) at which a K/V stream saturates
#: the memory system, as measured on an H200: head_dim 128 (134 KB rings) 48 CTAs, head_dim 64 (67 KB)
#: about 96, head_dim 256 (136 KB) 48 stream short rows as fast as any more CTAs. More CTAs add only
#: partials to merge (docs/experiments.md: "The short-row rule").
SATURATING_BYTES_IN_FLIGHT = 6 << 20

#: Pages shorter than a tile arrive a page at a time, so more bytes must be in flight. Copied a row
#: per lane (pages under `TMA_SWIZZLE_ROWS` tokens): twice as many, measured on pages of 1, where
#: both fewer splits and the wave model's many splits were slower. Through a box per page: a third
#: more, 64 CTAs at head_dim 128, whose splits of 8 rows merge in one cluster where twice the bytes
#: would take 128 CTAs merged through global memory, whose tail costs more than the extra CTAs
#: gain (docs/experiments.md: "Pages of 16 and the short-row rule").
SHORT_PAGE_IN_FLIGHT_FACTOR = {"cp_async": (2, 1), "tma": (4, 3)}  # (numerator, denominator)

#: Longest split the short-row rule plans on boxed pages shorter than a tile; longer rows go to the
#: wave model's 128 CTAs, which streamed splits of 2 MiB and more as fast as the short-row rule's 64
#: or faster (docs/experiments.md: "Pages of 16 and the short-row rule").
SHORT_PAGE_FEW_SPLITS_MAX_BYTES = 3 << 19


def _short_pages(spec: KernelSpec) -> bool:
    return spec.paged and spec.page_size < spec.tile_tokens


def saturating_ctas(spec: KernelSpec) -> int | None:
    """CTAs of ``spec`` whose rings together hold `SATURATING_BYTES_IN_FLIGHT` (times
    `SHORT_PAGE_IN_FLIGHT_FACTOR` on pages shorter than a tile), for the planner's short-row rule
    (`plan.plan_splits`). None where a CTA streams slower than its bytes in flight allow, so that
    every CTA an SM holds counts (the wave model): NVFP4, whose decode is bound by instruction
    issue (see `takes_whole_row_clusters`), and several query tokens on 16-row MMAs, where each
    warp's math on a tile outlasts the tile's arrival (measured at 32/8, D=128 over 64k: 64 CTAs of
    32 rows took 149 µs, twice what 16 rows took on them; docs/experiments.md: "Row slices: several
    warps over one ring"). Rows of several row blocks per K/V head are always the latter."""
    if spec.kv_dtype == "nvfp4" or (spec.query_tokens > 1 and spec.mma_rows == 16):
        return None
    in_flight = SATURATING_BYTES_IN_FLIGHT
    if _short_pages(spec):
        numerator, denominator = SHORT_PAGE_IN_FLIGHT_FACTOR[spec.kv_copy]
        in_flight = in_flight * numerator // denominator
    return -(-in_flight // spec.smem_bytes)


def few_splits_max_bytes(spec: KernelSpec) -> int:
    """Longest split, in K/V bytes, the short-row rule plans for ``spec`` (`plan.plan_splits`'s
    ``max_split_bytes``): `SHORT_PAGE_FEW_SPLITS_MAX_BYTES` on boxed pages shorter than a tile,
    else `plan.FEW_SPLITS_MAX_BYTES`."""
    if _short_pages(spec) and spec.kv_copy == "tma":
        return SHORT_PAGE_FEW_SPLITS_MAX_BYTES
    return FEW_SPLITS_MAX_BYTES


def resident_ctas_per_sm(spec: KernelSpec, registers: int | None) -> int:
    """CTAs of ``spec`` one SM holds at once, limited by registers, threads, CTAs and shared memory."""
    arch = ARCHS[arch_number(spec.arch)]
    limits = [arch.threads_per_sm // spec.threads, arch.ctas_per_sm,
              arch.smem_per_sm // (spec.smem_bytes + spec.static_smem_bytes + _SMEM_RESERVED_PER_CTA)]
    if registers:
        # Registers are allocated per warp in units of 256.
        per_warp = -(-registers * 32 // 256) * 256
        limits.append(_REGISTERS_PER_SM // per_warp // spec.warps)
    return max(1, min(limits))
