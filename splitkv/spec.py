"""KernelSpec: the one vocabulary for every compile-time choice of a decode program.

Everything that changes the generated CUDA lives here, and nothing else does: the renderer, the
compile cache, the planner, the tuned tables and the CLI all speak in KernelSpecs. A spec is frozen
and hashable, validates itself on construction and has a stable, readable ``name`` that is safe to use
as a file name and as a cache or table key. The values each choice may take are in `splitkv.choices`,
what splitkv knows of each compute capability in `splitkv.arch`.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field

from .arch import ARCHS, arch_number, parse_arch
from .choices import (CLUSTERS, HEAD_DIMS, KV_COPIES, KV_DTYPE_BITS, KV_DTYPES, KV_LAYOUTS, MAX_GROUP,
                      MAX_QUERY_TOKENS, MMA_M, NVFP4_BLOCK, PAGE_SIZES, Q_DTYPES, QUANTIZE_FORMATS,
                      QUANTIZE_IN_DTYPES, QUANTIZED_KV_DTYPES, STAGES, TILE_TOKENS, TMA_BOX_BYTES, TMA_SWIZZLE_ROWS,
                      VARIANTS, WARP_ROWS, WARPGROUP_WARPS, WARPS, kv_token_bytes, row_slices, rows_fit_tma_boxes, tma_box_bytes)


class SharedMemoryError(ValueError):
    """A CTA shape needs more shared memory than its arch gives a CTA."""


#: Shared-memory row padding in bytes: one 16-byte chunk, so that the eight rows an ldmatrix
#: reads fall in distinct banks for every supported head_dim and K/V format.
SMEM_ROW_PAD_BYTES = 16


@dataclass(frozen=True)
class KernelSpec:
    """Every compile-time choice of one decode program.

    CTA shape: ``warps`` warps per CTA; each warp streams its own tiles of ``tile_tokens`` tokens
    through a ``stages``-deep ring in shared memory (filled as ``kv_copy`` says), with its own online-softmax state; the
    warps of a CTA combine their states once at the end. ``chunk_size`` is the split granularity:
    the planner gives every split a whole number of chunks, so a split never starts mid-tile.
    ``cluster`` consecutive splits of a row run as one thread-block cluster (split variant only) and
    merge their partial results through distributed shared memory, without a trip to global memory.
    ``warp_heads`` (dense only): each warp serves its own K/V head over the whole sequence, so a
    CTA serves ``warps`` consecutive K/V heads of one sequence and its warps have nothing to
    combine. The planner takes it per plan (``plan.wants_packed_heads``, ``plan.pack_heads``);
    ``DecodeAttention.plan(warp_heads=...)`` overrides.
    ``page_size`` (0: contiguous caches ``[batch, max_len, Hkv, D]``, or with ``kv_layout`` HND
    ``[batch, Hkv, max_len, D]``, each possibly a view of a longer cache): K/V live in pages of that
    many tokens, ``kv_layout`` NHD ``[num_pages, page_size, Hkv, D]`` or HND ``[num_pages, Hkv,
    page_size, D]``, found through a block table (see `splitkv.paged`).
    """

    arch: str = "sm_90"
    head_dim: int = 128
    group_size: int = 4
    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    variant: str = "split"
    chunk_size: int = 256
    warps: int = 4
    tile_tokens: int = 32
    stages: int = 2
    fused_merge: bool = True
    cluster: int = 1
    kv_copy: str = "cp_async"
    mma_m: str = "heads"
    warp_heads: bool = False
    page_size: int = 0
    kv_layout: str = "NHD"
    # The attention variants (compiled in only where used, so plain attention pays nothing for
    # them): query tokens per sequence, a sliding window, a logits soft-cap, attention sinks. Their
    # values (window_left, the cap, the sinks' array) are run-time fields of the kernel's argument.
    query_tokens: int = 1
    window: bool = False
    soft_cap: bool = False
    sinks: bool = False

    def __post_init__(self):
        object.__setattr__(self, "arch", parse_arch(self.arch))
        _normalise_ints(self, ("head_dim", "group_size", "chunk_size", "warps", "tile_tokens", "stages", "cluster",
                               "page_size", "query_tokens"))
        _check_choice("head_dim", self.head_dim, HEAD_DIMS)
        if not 1 <= self.group_size <= MAX_GROUP:
            raise ValueError(f"group_size: expected an int in 1..{MAX_GROUP}, got {self.group_size!r}")
        _check_choice("q_dtype", self.q_dtype, Q_DTYPES)
        _check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _check_choice("variant", self.variant, VARIANTS)
        _check_choice("warps", self.warps, WARPS)
        _check_choice("tile_tokens", self.tile_tokens, TILE_TOKENS)
        _check_choice("stages", self.stages, STAGES)
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size: expected a positive int, got {self.chunk_size!r}")
        if self.chunk_size % self.tile_tokens:
            raise ValueError(
                f"chunk_size: {self.chunk_size} is not a multiple of tile_tokens={self.tile_tokens}")
        _check_choice("cluster", self.cluster, CLUSTERS)
        if self.cluster > 1 and arch_number(self.arch) < 90:
            raise ValueError(f"cluster: thread-block clusters need sm_90 or newer, got arch {self.arch}")
        if self.variant != "split" and self.cluster != 1:
            raise ValueError(f"cluster: the {self.variant} program merges in no cluster; use cluster=1")
        if self.variant == "units" and self.fused_merge:
            raise ValueError("fused_merge: the units program leaves split rows to the merge program; "
                             "use fused_merge=False")
        _check_choice("kv_copy", self.kv_copy, KV_COPIES)
        if self.kv_copy == "tma" and arch_number(self.arch) < 90:
            raise ValueError(f"kv_copy: 'tma' needs sm_90 or newer (cp.async.bulk.tensor), got arch {self.arch}")
        if self.kv_dtype in QUANTIZED_KV_DTYPES and arch_number(self.arch) < 89:
            raise ValueError(f"kv_dtype: {self.kv_dtype} K/V are converted with cvt.f16x2.e4m3x2, which needs sm_89 "
                             f"or newer; got arch {self.arch}")
        if self.kv_dtype == "nvfp4" and self.head_dim % 64:
            raise ValueError(f"head_dim: NVFP4 programs copy each row's block scales as one 4-16 byte piece, "
                             f"so head_dim must be a multiple of 64; got {self.head_dim}")
        if self.kv_dtype in QUANTIZED_KV_DTYPES and self.tile_tokens * self.kv_row_bytes % (16 * 32):
            raise ValueError(f"tile_tokens: a tile of {self.tile_tokens} rows of {self.kv_row_bytes} bytes is not "
                             f"a whole number of 16-byte copies per lane; use a longer tile")
        if self.kv_copy == "tma" and not rows_fit_tma_boxes(self.head_dim, self.kv_dtype):
            raise ValueError(f"kv_copy: 'tma' copies K/V rows in boxes of {TMA_BOX_BYTES} bytes (NVFP4: also "
                             f"rows of 32 or 64 bytes, one box each); head_dim {self.head_dim} of {self.kv_dtype} "
                             f"fits neither")
        if not 1 <= self.query_tokens <= MAX_QUERY_TOKENS:
            raise ValueError(f"query_tokens: expected an int in 1..{MAX_QUERY_TOKENS}, got {self.query_tokens!r}")
        _check_choice("mma_m", self.mma_m, MMA_M)
        if self.mma_m == "tokens" and self.rows > 8:
            raise ValueError(f"mma_m: 'tokens' puts the query heads x query tokens on the MMA's 8 columns; "
                             f"group_size {self.group_size} x query_tokens {self.query_tokens} needs 'heads'")
        if self.mma_m == "warpgroup":
            self._check_warpgroup()
        for switch in ("fused_merge", "warp_heads", "window", "soft_cap", "sinks"):
            _check_bool(switch, getattr(self, switch))
        if self.warp_heads and self.variant != "dense":
            raise ValueError("warp_heads: a warp per K/V head is a layout of the dense program; use variant='dense'")
        if self.warp_heads and self.query_tokens > 1:
            raise ValueError("warp_heads: a warp per K/V head serves one query token per sequence")
        if self.variant == "units" and not self.rows_fit_units:
            raise ValueError(f"variant: the units program serves a K/V head's rows in one CTA, at most "
                             f"{WARP_ROWS} x warps={self.warps} rows (query heads x query tokens); group_size "
                             f"{self.group_size} x query_tokens {self.query_tokens} needs the split or dense program")
        self._check_paging()
        limit = ARCHS[arch_number(self.arch)].smem_per_cta
        if self.smem_bytes + self.static_smem_bytes > limit:
            raise SharedMemoryError(
                f"CTA shape needs {self.smem_bytes} bytes of shared memory (warps={self.warps} x "
                f"stages={self.stages} x tile_tokens={self.tile_tokens} x rows of head_dim={self.head_dim} "
                f"{self.kv_dtype}); {self.arch} allows {limit}")

    def _check_warpgroup(self) -> None:
        """mma_m='warpgroup': what `warpgroup_refusal` says of the arch and K/V rows, then the tiles
        read as the tensor maps lay them (128-byte boxes, swizzled) by whole warpgroups."""
        why = warpgroup_refusal(self.arch, self.head_dim, self.kv_dtype)
        if why is None and self.kv_copy != "tma":
            why = "the MMAs read K/V tiles as the tensor maps lay them out; use kv_copy='tma'"
        elif why is None and self.warps % WARPGROUP_WARPS:
            why = f"warps: a whole number of warpgroups of {WARPGROUP_WARPS}; got {self.warps}"
        elif why is None and self.warp_heads:
            why = "warp_heads serves a K/V head per warp; a warpgroup shares its rows"
        if why:
            raise ValueError(f"mma_m: 'warpgroup': {why}")

    def _check_paging(self) -> None:
        if self.page_size not in (0, *PAGE_SIZES):
            raise ValueError(f"page_size: expected 0 (contiguous) or a power of two from 1 to {PAGE_SIZES[-1]}, "
                             f"got {self.page_size!r}")
        _check_choice("kv_layout", self.kv_layout, KV_LAYOUTS)
        if not self.page_size:
            if self.kv_layout == "HND" and self.kv_dtype in QUANTIZED_KV_DTYPES:
                raise ValueError(f"kv_layout: contiguous 'HND' caches [batch, Hkv, max_len, D] hold 16-bit K/V; "
                                 f"{self.kv_dtype} caches are [batch, max_len, Hkv, ...] (NHD) or paged")
            return
        if self.kv_copy == "tma" and self.page_size < TMA_SWIZZLE_ROWS:
            raise ValueError(f"kv_copy: 'tma' boxes of a paged cache hold whole pages of at least "
                             f"{TMA_SWIZZLE_ROWS} tokens (the swizzle's period); page_size {self.page_size} "
                             f"needs kv_copy='cp_async'")

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def tma_box_rows(self) -> int:
        """kv_copy='tma': token rows per tensor-map box (a tile, or a page when pages are shorter)."""
        return min(self.tile_tokens, self.page_size) if self.paged else self.tile_tokens

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def rows(self) -> int:
        """A K/V head's rows: its query heads x query tokens (row t x group_size + h: token t, head h)."""
        return self.group_size * self.query_tokens

    @property
    def row_slices(self) -> int:
        """Warps that read each tile together, each carrying its own `WARP_ROWS` of the CTA's rows:
        the fewest (a power of two, at most ``warps``) whose rows hold the K/V head's."""
        return row_slices(self.rows, self.warps, self.mma_m == "warpgroup")

    @property
    def token_streams(self) -> int:
        """Rings per CTA: warps over row slices, each ring's tiles read by a slice's warps; with
        warp_heads, a ring per warp (and K/V head)."""
        return self.warps // self.row_slices

    @property
    def row_blocks(self) -> int:
        """CTAs per (sequence, K/V head, split) that share its rows: one where the row slices hold
        them, else as many as it takes (each reads the same K/V bytes, mostly from L2)."""
        return -(-self.rows // (WARP_ROWS * self.row_slices))

    @property
    def rows_fit_units(self) -> bool:
        """Whether the units program can serve these rows: one row block per K/V head (a unit is a
        token range of one K/V head's rows)."""
        return self.row_blocks == 1

    @property
    def cta_rows(self) -> int:
        """Rows one CTA serves: the K/V head's rows over its row blocks, evenly (the last block's rows
        past the head's are padding, computed and never written); its row slice s serves rows
        s x WARP_ROWS on."""
        return -(-self.rows // self.row_blocks)

    @property
    def row_slots(self) -> int:
        """Per-row entries of the CTA's combine state: every row slice's `WARP_ROWS`."""
        return WARP_ROWS * self.row_slices

    @property
    def mma_rows(self) -> int:
        """Rows of each warp's m16n8k16 tile that carry data: 8 for up to 8 rows per CTA, else 16."""
        return 8 if self.cta_rows <= 8 else 16

    @property
    def compiled_variant(self) -> tuple:
        """The `with_variant` arguments this program was built with."""
        return (self.query_tokens, self.window, self.soft_cap, self.sinks)

    @property
    def has_variant(self) -> bool:
        """Whether any attention variant is compiled in (see `with_variant`)."""
        return self.query_tokens > 1 or self.window or self.soft_cap or self.sinks

    def with_variant(self, query_tokens: int = 1, window: bool = False, soft_cap: bool = False,
                     sinks: bool = False) -> "KernelSpec":
        """This program with the attention variants given: its CTA shape kept, the MMA rows turned to
        the query heads where tokens x heads no longer fit the 8 columns of ``mma_m='tokens'``."""
        mma_m = self.mma_m
        if mma_m == "tokens" and self.group_size * query_tokens > 8:
            mma_m = "heads"
        return self.replace(query_tokens=query_tokens, window=window, soft_cap=soft_cap, sinks=sinks, mma_m=mma_m)

    @property
    def compile_arch(self) -> str:
        """The target NVRTC compiles for: the arch, made arch-specific ('sm_90a') for warpgroup MMAs."""
        if self.mma_m == "warpgroup" and not self.arch.endswith("a"):
            return self.arch + "a"
        return self.arch

    @property
    def kv_bits(self) -> int:
        """Bits of one K/V element (its block scale not counted)."""
        return KV_DTYPE_BITS[self.kv_dtype]

    @property
    def kv_elem_bytes(self) -> int:
        """Bytes of the elements a tensor map describes K/V in: an element of 8- and 16-bit formats,
        a byte (two values) of NVFP4."""
        return max(self.kv_bits // 8, 1)

    @property
    def tma_box_bytes(self) -> int:
        """kv_copy='tma': bytes of a box row, the span of its swizzle (see `tma_box_bytes`)."""
        box = tma_box_bytes(self.head_dim, self.kv_dtype)
        if box is None:
            raise ValueError(f"tma_box_bytes: head_dim {self.head_dim} of {self.kv_dtype} fits no tensor-map box")
        return box

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one token's K (or V) values of one K/V head."""
        return self.head_dim * self.kv_bits // 8

    @property
    def kv_scale_row_bytes(self) -> int:
        """Bytes of one token's NVFP4 block scales of one K/V head (0 for other formats)."""
        return self.head_dim // NVFP4_BLOCK if self.kv_dtype == "nvfp4" else 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V (block scales included) one token of one K/V head occupies in memory."""
        return 2 * kv_token_bytes(self.head_dim, self.kv_dtype)

    @property
    def mma_dtype(self) -> str:
        """The MMAs' operand type: the K/V type, or fp16 for quantized K/V (Q is converted once)."""
        return "fp16" if self.kv_dtype in QUANTIZED_KV_DTYPES else self.kv_dtype

    @property
    def cluster_slice(self) -> int:
        """Output elements (of group_size x head_dim) each CTA of a cluster merges: a multiple of 4."""
        return -(-self.cta_rows * self.head_dim // (4 * self.cluster)) * 4

    @property
    def smem_pad(self) -> int:
        """Bytes of padding after each K/V row in shared memory: none where the copy engine
        swizzles the rows instead (tma)."""
        return 0 if self.kv_copy == "tma" else SMEM_ROW_PAD_BYTES

    @property
    def tile_bytes(self) -> int:
        """Shared memory of one K (or V) tile: padded rows of values, then (NVFP4) block-scale rows;
        with tensor maps, rounded up to the swizzle's period (8 box rows), on which every box starts."""
        tile = self.tile_tokens * (self.kv_row_bytes + self.smem_pad + self.kv_scale_row_bytes)
        if self.kv_copy == "tma":
            period = TMA_SWIZZLE_ROWS * self.tma_box_bytes
            tile = -(-tile // period) * period
        return tile

    @property
    def inbox_offset(self) -> int:
        """Byte offset of the cluster inbox in dynamic shared memory: past the per-warp K/V rings
        and the CTA's final combine, which reuses the rings' bytes once they are drained."""
        return -(-max(self.ring_bytes, self.combine_bytes) // 16) * 16

    @property
    def ring_bytes(self) -> int:
        """The CTA's K/V rings: a K and a V tile per stage, per token stream."""
        return self.token_streams * self.stages * self.tile_bytes * 2

    @property
    def combine_bytes(self) -> int:
        """The warps' states as the final combine lays them out (fp32): per token stream a max and a
        sum per row slot and its rows x D accumulator, then per row slot the CTA's sum, log-sum-exp,
        final denominator and sink."""
        streams = self.token_streams
        return (streams * (self.cta_rows * self.head_dim + 2 * self.row_slots) + 4 * self.row_slots) * 4

    @property
    def static_smem_bytes(self) -> int:
        """Shared memory the program declares statically (barriers, flags), on top of
        ``smem_bytes``; both count against the per-CTA limit. An upper bound."""
        per_stage = 16 if self.kv_copy == "tma" else 0  # a stage's two mbarriers (K rows, V rows)
        # tma: up to 1024 bytes of padding put the dynamic rings on a 1024-byte boundary.
        return 16 + self.token_streams * self.stages * per_stage + (1024 if self.kv_copy == "tma" else 0)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: the rings (reused for the combine), then, in a cluster, the inbox
        where the other CTAs leave their partials (fp32) and log-sum-exps for this CTA's slice."""
        inbox = self.cluster * (self.cluster_slice + self.row_slots) * 4 if self.cluster > 1 else 0
        return self.inbox_offset + inbox

    @property
    def name(self) -> str:
        """Stable and readable: 'sm_90-d128-g4-bf16-bf16-split-c256-w4t32s2-k8-fm' ('-tma' appended when
        K/V arrive through tensor maps, '-mt' when tokens fill the MMA rows, '-wg' for warpgroup MMAs, '-wh' when each warp serves
        its own K/V head, '-p16' for pages of 16 tokens, '-p16hnd' in the HND layout, '-hnd' for contiguous
        HND caches [B, Hkv, L, D]; the variants:
        '-q4' for 4 query tokens, '-win' a sliding window, '-cap' a soft-cap, '-sink' attention sinks)."""
        merge = ""
        if self.variant == "split":
            merge = (f"-k{self.cluster}" if self.cluster > 1 else "") + ("-fm" if self.fused_merge else "")
        return (f"{self.arch}-d{self.head_dim}-g{self.group_size}-{self.q_dtype}-{self.kv_dtype}-"
                f"{self.variant}-c{self.chunk_size}-w{self.warps}t{self.tile_tokens}s{self.stages}{merge}"
                + ("" if self.kv_copy == "cp_async" else f"-{self.kv_copy}")
                + ("-mt" if self.mma_m == "tokens" else "") + ("-wg" if self.mma_m == "warpgroup" else "")
                + ("-wh" if self.warp_heads else "")
                + (f"-p{self.page_size}" if self.paged else "") + ("hnd" if self.kv_layout == "HND" and self.paged else "")
                + ("-hnd" if self.kv_layout == "HND" and not self.paged else "")
                + (f"-q{self.query_tokens}" if self.query_tokens > 1 else "")
                + ("-win" if self.window else "") + ("-cap" if self.soft_cap else "") + ("-sink" if self.sinks else ""))

    def replace(self, **changes) -> "KernelSpec":
        return dataclasses.replace(self, **changes)

    def as_dense(self) -> "KernelSpec":
        """The dense program of the same CTA shape: the split-only choice (clusters) dropped."""
        return self.replace(variant="dense", cluster=1)

    def as_warp_heads(self) -> "KernelSpec":
        """The dense program with a warp per K/V head: each warp's own MMAs, of 16 rows ('heads'),
        where this one's warps share warpgroup MMAs."""
        return self.replace(warp_heads=True, mma_m="heads" if self.mma_m == "warpgroup" else self.mma_m)

    def as_units(self) -> "KernelSpec":
        """The units program of the same CTA shape (see VARIANTS)."""
        return self.replace(variant="units", cluster=1, warp_heads=False, fused_merge=False)

    def to_dict(self) -> dict:
        """Every field, but the attention variants' at their defaults (plain attention), so that what
        tables and results files hold of plain programs stays as it was."""
        data = dataclasses.asdict(self)
        for name, plain in _PLAIN_VARIANT.items():
            if data[name] == plain:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "KernelSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"KernelSpec: unknown fields {sorted(unknown)}")
        return cls(**data)


#: The attention variants' fields of plain attention.
_PLAIN_VARIANT = dict(query_tokens=1, window=False, soft_cap=False, sinks=False)


@dataclass(frozen=True)
class MergeSpec:
    """The standalone merge program: combines the fp32 partials of split rows (exact, base-2 LSE)."""

    arch: str = "sm_90"
    head_dim: int = 128
    out_dtype: str = "bf16"
    threads: int = field(default=128)
    tables: bool = False  # walk a work-unit plan's merge table (the units program's partials)

    def __post_init__(self):
        object.__setattr__(self, "arch", parse_arch(self.arch))
        _normalise_ints(self, ("head_dim", "threads"))
        _check_choice("head_dim", self.head_dim, HEAD_DIMS)
        _check_choice("out_dtype", self.out_dtype, Q_DTYPES)
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads: expected a multiple of 32 in 32..1024 (one warp merges one row), "
                             f"got {self.threads!r}")
        _check_bool("tables", self.tables)

    @property
    def compile_arch(self) -> str:
        """The target NVRTC compiles for: the arch."""
        return self.arch

    @property
    def name(self) -> str:
        """'sm_90-merge-d128-bf16', with '-t256' when the CTA is not the default 128 threads and
        '-units' when it walks a merge table."""
        return (f"{self.arch}-merge-d{self.head_dim}-{self.out_dtype}" + (f"-t{self.threads}" if self.threads != 128 else "")
                + ("-units" if self.tables else ""))


@dataclass(frozen=True)
class QuantizeSpec:
    """The K/V quantizer: BF16/FP16 rows in, FP8 E4M3 or NVFP4 rows (and block scales) out, written
    at each sequence's cache position. ``head_dim`` is any multiple of 16 (one NVFP4 block, or 16
    FP8 bytes, per thread)."""

    arch: str = "sm_90"
    head_dim: int = 128
    in_dtype: str = "bf16"
    kv_format: str = "fp8_e4m3"
    threads: int = 256

    def __post_init__(self):
        object.__setattr__(self, "arch", parse_arch(self.arch))
        _normalise_ints(self, ("head_dim", "threads"))
        if self.head_dim <= 0 or self.head_dim % 16:
            raise ValueError(f"head_dim: the quantizer needs a positive multiple of 16, got {self.head_dim!r}")
        _check_choice("in_dtype", self.in_dtype, QUANTIZE_IN_DTYPES)
        _check_choice("kv_format", self.kv_format, QUANTIZE_FORMATS)
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads: expected a multiple of 32 in 32..1024, got {self.threads!r}")

    @property
    def compile_arch(self) -> str:
        """The target NVRTC compiles for: the arch."""
        return self.arch

    @property
    def name(self) -> str:
        """'sm_90-quantize-d128-bf16-fp8_e4m3'."""
        return (f"{self.arch}-quantize-d{self.head_dim}-{self.in_dtype}-{self.kv_format}"
                + (f"-t{self.threads}" if self.threads != 256 else ""))


def warpgroup_refusal(arch: str, head_dim: int, kv_dtype: str) -> str | None:
    """Why warpgroup MMAs (mma_m='warpgroup') cannot serve programs of this arch, head_dim and K/V
    type, or None where they can: wgmma exists on sm_90a alone and takes 16-bit K/V from shared
    memory as stored; O accumulators of head_dim 256 (128 registers a thread) leave no room for the
    rest, and rows of other head dims are no whole number of 128-byte boxes."""
    if arch_number(arch) != 90:
        return f"warpgroup MMAs (wgmma) exist on sm_90a alone, got arch {arch}"
    if kv_dtype in QUANTIZED_KV_DTYPES:
        return f"the MMAs read 16-bit K/V from shared memory as stored; {kv_dtype} needs 'heads'"
    if head_dim not in (64, 128):
        return f"head_dim 64 or 128 (rows of whole 128-byte boxes, O in registers); got {head_dim}"
    return None


def _normalise_ints(spec, fields) -> None:
    """Integer fields as plain ints: any integral value (a NumPy int, say) is taken, but not a bool or a
    float, which would pass the choice checks (True == 1, 128.0 == 128) and then show up in the name."""
    for name in fields:
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {value!r}")
        object.__setattr__(spec, name, int(value))


def _check_choice(arg: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{arg}: expected one of {list(allowed)}, got {value!r}")


def _check_bool(arg: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{arg}: expected a bool, got {value!r}")
