"""The values each compile-time choice of a program may take.

The vocabulary that `splitkv.spec`'s KernelSpec, MergeSpec and QuantizeSpec validate against (and
that the runtime's input checks, the CLI, the tuner and the tuned tables' keys share), with the small
arithmetic that follows from it alone: bytes of a K/V row, whether rows fit tensor-map boxes, row
slices of a CTA's warps.
"""

from __future__ import annotations

#: Head dimensions the templates are written for (multiples of 32 keep every MMA tile whole).
HEAD_DIMS = (64, 96, 128, 256)
#: Query heads served per K/V head (GQA group size); 1 is plain multi-head attention.
MAX_GROUP = 16
#: Query / output element types.
Q_DTYPES = ("bf16", "fp16")
#: K/V element types: 16-bit floats, or the quantized formats of `splitkv.kv_formats` (FP8 E4M3
#: elements; NVFP4 E2M1 elements two per byte with an E4M3 scale per 16), dequantized in registers.
KV_DTYPES = ("bf16", "fp16", "fp8_e4m3", "nvfp4")
KV_DTYPE_BITS = {"bf16": 16, "fp16": 16, "fp8_e4m3": 8, "nvfp4": 4}
#: The quantized K/V formats: their MMAs run in fp16 (sm_90 converts E4M3 to fp16 only).
QUANTIZED_KV_DTYPES = ("fp8_e4m3", "nvfp4")
#: NVFP4 elements per E4M3 block scale.
NVFP4_BLOCK = 16


def kv_token_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes of one token's K (or V) of one K/V head in memory, NVFP4's block scales included."""
    scales = head_dim // NVFP4_BLOCK if kv_dtype == "nvfp4" else 0
    return head_dim * KV_DTYPE_BITS[kv_dtype] // 8 + scales


#: dense: one CTA per (sequence, K/V head) writes the final output.
#: split: several CTAs per (sequence, K/V head) write fp32 partials and their log-sum-exp,
#: and an exact merge combines them (fused into the last CTA of a row, or a separate program).
#: units: one CTA per row of a work-unit table (`splitkv.work_units`), in table order: a unit that
#: covers its whole row writes the output as the dense program does, a piece of a split row its
#: fp32 partial into its slot, which the merge program (MergeSpec(tables=True)) combines.
VARIANTS = ("dense", "split", "units")
#: The split variants' plans (`plan.SplitPlan`); the units variant's are `work_units.UnitPlan`s.
SPLIT_PLAN_VARIANTS = ("dense", "split")
WARPS = (1, 2, 4, 8)
TILE_TOKENS = (16, 32, 64)
STAGES = (2, 3, 4)
#: Thread-block cluster sizes for the split variant's merge through distributed shared memory
#: (1: no cluster). Sizes above the portable limit of 8 are allowed per kernel at load time.
CLUSTERS = tuple(range(1, 17))
#: How K/V rows reach shared memory. cp_async: every lane copies 16-byte pieces (sm_80+).
#: tma: the copy engine fetches a tile's K and V as 2-D boxes of 128 bytes x tile_tokens rows,
#: described by tensor maps the host encodes per cache (sm_90+, rows a whole number of boxes).
KV_COPIES = ("cp_async", "tma")
#: Bytes of a tensor-map box row: the span of the copy engine's 128-byte swizzle.
TMA_BOX_BYTES = 128
#: Rows over which the 128-byte swizzle repeats: a tensor-map box of a paged cache (one page, when
#: pages are shorter than a tile) must hold a whole number of them.
TMA_SWIZZLE_ROWS = 8
#: Page sizes of paged K/V caches (tokens per page): powers of two from 1 to 256. 0 in a KernelSpec
#: is the contiguous layout [batch, max_len, Hkv, D].
PAGE_SIZES = tuple(1 << i for i in range(9))
#: Axis orders of a page: tokens then K/V heads (NHD: [num_pages, page_size, Hkv, D]), or K/V heads
#: then tokens (HND: [num_pages, Hkv, page_size, D]).
KV_LAYOUTS = ("NHD", "HND")


def tma_box_bytes(head_dim: int, kv_dtype: str) -> int | None:
    """Bytes of a tensor-map box row for K/V rows of ``head_dim`` elements: `TMA_BOX_BYTES` (the
    widest swizzle span) where a row is a whole number of them; NVFP4's rows of 32 or 64 bytes
    (head_dim 64, 128) as one box each, swizzled over that span. None where no box fits (head_dim 96;
    FP8 at head_dim 64 keeps per-lane copies: its 64-byte rows through boxes are not measured)."""
    row = head_dim * KV_DTYPE_BITS[kv_dtype] // 8
    if row % TMA_BOX_BYTES == 0:
        return TMA_BOX_BYTES
    if kv_dtype == "nvfp4" and row in (32, 64):
        return row
    return None


def rows_fit_tma_boxes(head_dim: int, kv_dtype: str) -> bool:
    """Whether K/V rows of ``head_dim`` elements arrive through tensor-map boxes (`tma_box_bytes`)."""
    return tma_box_bytes(head_dim, kv_dtype) is not None


#: Query tokens per sequence a program serves (several: speculative decoding's draft tokens, causal
#: among themselves), 1..MAX_QUERY_TOKENS.
MAX_QUERY_TOKENS = 16
#: MMA rows one warp carries (the M of its m16n8k16 tiles). A K/V head's rows (query heads x query
#: tokens) past it go to further warps that read the same tiles of the same ring ("row slices",
#: up to the CTA's warps), and rows past every warp's to further CTAs of the same K/V head ("row
#: blocks"), which read the same K/V bytes again, mostly from L2.
WARP_ROWS = 16


#: Warps of a warpgroup: mma_m='warpgroup' MMAs take 64 rows, 16 per warp of 4 consecutive warps.
WARPGROUP_WARPS = 4


def row_slices(rows: int, warps: int, warpgroup: bool = False) -> int:
    """Warps of a CTA of ``warps`` that share each tile for ``rows`` rows (`KernelSpec.row_slices`):
    with ``warpgroup``, whole warpgroups (rows past the K/V head's are padding)."""
    needed = -(-rows // WARP_ROWS)
    slices = 1 << (needed - 1).bit_length()
    if warpgroup:
        slices = max(slices, WARPGROUP_WARPS)
    return min(warps, slices)


#: What fills the 16 rows (M) of the m16n8k16 MMAs. heads: the query heads of the group (rows past
#: the group are idle, so G = 4 uses a quarter of each MMA). tokens: 16 tokens per MMA, the query
#: heads as its 8 columns (G <= 8), so S and P V take half as many MMAs for G <= 8.
#: warpgroup (sm_90a): the heads, 64 rows per warpgroup MMA (wgmma) of four warps, K and V read from
#: shared memory by the MMA itself, once per warpgroup, where each warp of 'heads' reads them itself.
MMA_M = ("heads", "tokens", "warpgroup")


#: Input element types of the K/V quantizer, and the formats it writes (see `splitkv.kv_formats`).
QUANTIZE_IN_DTYPES = ("bf16", "fp16")
QUANTIZE_FORMATS = ("fp8_e4m3", "nvfp4")
