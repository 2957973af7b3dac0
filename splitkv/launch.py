"""What a plan launches, and launching it: the part of run() that the plan fixes.

plan() builds a `Launch`: the decode program (and the merge program, when the plan has one) with
its grid, the workspace, the lengths, the block table and the unit tables. run() reads its arrays
(`read_arrays`) and calls `Launch.enqueue`, which writes the arrays' fields into the programs'
``Params`` structs (splitkv/params.py; one pair per thread, the plan's fields written when it is
made) and enqueues each program with one driver call (cuLaunchKernel through CuPy's binding, with
its argument array packed already). The driver copies the structs' bytes when a launch is made or
captured, so a CUDA graph keeps the values of the run that was captured.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import paged
from .params import DECODE, MERGE
from .plan import SplitPlan
from .quantized_kv import QuantizedKV
from .spec import KernelSpec
from .tensor_map import MAP_BYTES
from .variants import PLAIN, AttentionVariant
from .work_units import UnitPlan

#: The merge program's CTA size; one warp merges one output row.
MERGE_THREADS = 128


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """A plan's block table: the device array the program reads (kept alive here), its row length,
    and the highest page the planned lengths read, with where it is (``paged.used_pages``; page -1
    when not checked), compared with the cache's page count when run() validates."""

    array: object
    ptr: int
    stride: int
    highest: tuple


@dataclasses.dataclass(frozen=True)
class UnitTables:
    """A units plan's tables on the device (`UnitPlan.to_buffer`, kept alive here), the unit rows
    the buffer holds (the decode grid) and the merge program's grid (0: not launched)."""

    array: object
    ptr: int
    max_units: int
    merge_blocks: int


@dataclasses.dataclass(frozen=True)
class Heads:
    """The instance's facts the programs' structs carry."""

    num_qo_heads: int
    num_kv_heads: int
    scale_log2: float  # sm_scale x log2(e)
    page_size: int  # 0: contiguous caches
    kv_layout: str


@dataclasses.dataclass(frozen=True)
class Launch:
    """Everything run() needs, fixed at plan time. ``decode_fn`` and ``merge_fn`` are CuPy kernel
    functions of the current device (tools may swap ``decode_fn`` for a patched program of the
    same struct: `with_decode_fn`)."""

    plan: SplitPlan | UnitPlan
    spec: KernelSpec
    heads: Heads
    decode_fn: object
    merge_fn: object | None
    batch: int
    max_len: int  # longest planned sequence: k.shape[1] must hold it
    grid: tuple
    seq_lens: object  # device int32 [batch] (the plan's copy, or the caller's array), kept alive here
    workspace: tuple  # (partial_o, partial_lse, counters), None where unused, kept alive here
    empty_kv_ptr: int = 0  # tma with every length 0: one tile of memory for maps of an empty cache
    table: BlockTable | None = None  # paged caches: the block table the plan reads through
    units: UnitTables | None = None  # units plans: the work-unit tables on the device
    attention: AttentionVariant = PLAIN  # the attention variant compiled into the programs

    def check_inputs(self, shapes) -> None:
        """ValueError unless inputs of these `tensors.DecodeShapes` fit this launch: its batch, head
        layout and dtypes, and a cache that holds every planned token (or page)."""
        spec, heads = self.spec, self.heads
        expected = (self.batch, heads.num_qo_heads, heads.num_kv_heads, spec.head_dim, spec.q_dtype, spec.kv_dtype)
        got = (shapes.batch, shapes.num_qo_heads, shapes.num_kv_heads, shapes.head_dim,
               shapes.q_dtype, shapes.kv_dtype)
        if got != expected:
            raise ValueError(f"q/k/v: planned for (batch, num_qo_heads, num_kv_heads, head_dim, q_dtype, "
                             f"kv_dtype) = {expected}, got {got}")
        if shapes.query_tokens != self.attention.query_tokens:
            raise ValueError(f"q: planned for {self.attention.query_tokens} query token(s) per sequence "
                             f"(plan(query_tokens=...)), got q of {shapes.query_tokens}")
        if self.table is None and shapes.max_len < self.max_len:
            raise ValueError(f"k: holds {shapes.max_len} tokens per sequence but the plan has a sequence of "
                             f"{self.max_len}")
        if self.table is not None:
            if shapes.page_size != heads.page_size:
                raise ValueError(f"k: pages of {shapes.page_size} tokens, but this instance reads pages of "
                                 f"{heads.page_size} ({heads.kv_layout})")
            if shapes.num_pages == 0 and self.max_len > 0:
                raise ValueError(f"k: a cache of no pages, but the plan has a sequence of {self.max_len}")
            paged.check_pages_exist(self.table.highest, shapes.num_pages)

    def with_decode_fn(self, function) -> Launch:
        """This launch with another decode function of the same struct (a patched program, for the
        tools that time or probe one)."""
        return dataclasses.replace(self, decode_fn=function)

    def enqueue(self, args: Arguments, stream: int, pointers: tuple, quantized: tuple, kv_shape: tuple,
                tensor_maps, sinks: int = 0, kv_stride: int = 0) -> None:
        """Writes the run's fields into ``args`` (the calling thread's structs; bound to this launch
        first if they were not) and enqueues the programs on ``stream``. ``pointers``: the
        addresses of q, k, v, out, lse (0: none); ``quantized``: the quantized-cache fields `read_arrays` gives; ``kv_shape``:
        k's shape (a quantized cache's values'); ``tensor_maps``: the instance's `TensorMapCache`;
        ``sinks``: the address of the sinks' array (0: none); ``kv_stride``: a contiguous cache's
        tokens per sequence (NHD) or K/V head (HND) in memory (0: its extent, ``kv_shape``'s)."""
        if args.bound is not self:
            args.bind(self)
        table = self.table
        # Tokens per sequence the cache holds: a contiguous cache's rows, or a table row's pages.
        hnd = self.heads.kv_layout == "HND"
        cache_len = table.stride * self.heads.page_size if table else kv_shape[2 if hnd else 1]
        kv_stride = kv_stride or cache_len
        num_pages = kv_shape[0] if table else 0
        words, ints = args.decode_words, args.decode_ints
        (words[_Q], words[_K], words[_V], words[_OUT], words[_LSE]) = pointers
        (words[_K_SCALE], words[_V_SCALE], words[_K_BLOCKS], words[_V_BLOCKS],
         ints[_K_PER_HEAD], ints[_V_PER_HEAD]) = quantized
        ints[_MAX_LEN], ints[_NUM_PAGES], ints[_KV_STRIDE] = cache_len, num_pages, kv_stride
        words[_SINKS] = sinks
        if args.map_view is not None:
            maps = (pointers[1], pointers[2], cache_len, num_pages, kv_stride)
            if maps != args.maps_written:  # the same caches as the last run: the struct holds their maps
                self._write_maps(args, *maps, tensor_maps)
                args.maps_written = maps
        launch_kernel(args.decode_call, stream, args.decode_argument)
        if args.merge_call is not None:
            args.merge_words[_M_OUT], args.merge_words[_M_LSE], args.merge_words[_M_SINKS] = pointers[3], pointers[4], sinks
            args.merge_ints[_M_MAX_LEN] = cache_len
            launch_kernel(args.merge_call, stream, args.merge_argument)

    def _write_maps(self, args: Arguments, k_ptr: int, v_ptr: int, cache_len: int, num_pages: int,
                    kv_stride: int, tensor_maps) -> None:
        """The K and V tensor maps of this run's caches, into the decode struct's first 256 bytes.
        The maps' rows: a contiguous cache's tokens ([batch x kv_stride][num_kv_heads x head_dim],
        HND: [batch x num_kv_heads x kv_stride][head_dim], up to the last sequence's or head's
        cache_len-th token: a view's tail is not the cache's), a paged one's ([num_pages x
        page_size][num_kv_heads x head_dim], HND: [num_pages x num_kv_heads x page_size][head_dim])."""
        row_elems, cols, elem_bytes, box_rows, box_bytes = args.map_view
        heads = self.heads
        runs = self.batch * (heads.num_kv_heads if heads.kv_layout == "HND" else 1)  # rows of kv_stride tokens
        rows = (runs - 1) * kv_stride + cache_len if runs and cache_len else 0
        if self.table is not None:
            rows = num_pages * heads.page_size * (heads.num_kv_heads if heads.kv_layout == "HND" else 1)
        if rows == 0:  # an empty cache (every length is 0): maps of the plan's stand-in tile
            rows, k_ptr, v_ptr = self.spec.tile_tokens, self.empty_kv_ptr, self.empty_kv_ptr
        struct = args.decode_bytes
        struct[_K_MAP:_K_MAP + MAP_BYTES] = tensor_maps.encoded(k_ptr, rows, cols, elem_bytes, box_rows, box_bytes)
        struct[_V_MAP:_V_MAP + MAP_BYTES] = tensor_maps.encoded(v_ptr, rows, cols, elem_bytes, box_rows, box_bytes)


def launch_kernel(call: tuple, stream: int, argument: int) -> None:
    """Enqueues one program: ``call`` is (function, grid x, y, z, block x, y, z, shared memory),
    ``argument`` the address of its kernel-argument array (one pointer, to its struct)."""
    _launch(*call, stream, argument, 0)


def _driver_launch(*args) -> None:
    global _launch
    from cupy_backends.cuda.api import driver

    _launch = driver.launchKernel
    _launch(*args)


_launch = _driver_launch  # cuLaunchKernel, bound on the first launch


class Arguments:
    """One thread's structs (decode and merge programs) of one instance: the plan's fields written
    when they are bound to a launch (`bind`, on the first run after a plan), the run's on each
    call, through 64- and 32-bit views of the bytes (a numpy record write costs several times
    more). Two threads never share them: a launch copies the bytes while the thread makes it."""

    def __init__(self):
        import cupy

        # A thread's first launch: bind the device's primary context, which the driver call needs
        # and which a thread that made no runtime call yet does not have.
        cupy.cuda.runtime.setDevice(cupy.cuda.runtime.getDevice())
        self.decode, self.decode_bytes, self.decode_words, self.decode_ints, self.decode_floats, \
            self._decode_argument = _struct(DECODE)
        self.merge, _, self.merge_words, self.merge_ints, _, self._merge_argument = _struct(MERGE)
        self.decode_argument = self._decode_argument.ctypes.data
        self.merge_argument = self._merge_argument.ctypes.data
        self.bound = None  # the launch the plan's fields are of
        self.decode_call = self.merge_call = self.map_view = self.maps_written = None

    def bind(self, launch: Launch) -> None:
        """Writes ``launch``'s fields (every plan-fixed field, so nothing of another plan stays)."""
        heads, plan, units, table, spec = launch.heads, launch.plan, launch.units, launch.table, launch.spec
        seq_lens = launch.seq_lens.data.ptr if launch.seq_lens is not None else 0
        partial_o, partial_lse, counters = _pointers(launch.workspace)
        words, ints = self.decode_words, self.decode_ints
        words[_SEQ_LENS], words[_PARTIAL_O], words[_PARTIAL_LSE], words[_COUNTERS] = (seq_lens, partial_o,
                                                                                      partial_lse, counters)
        words[_BLOCK_TABLE], ints[_TABLE_STRIDE] = (table.ptr, table.stride) if table else (0, 0)
        words[_UNITS] = units.ptr if units else 0
        ints[_NUM_KV_HEADS], ints[_TOKENS_PER_SPLIT] = heads.num_kv_heads, 0 if units else plan.tokens_per_split
        self.decode_floats[_SCALE_LOG2] = heads.scale_log2
        attention = launch.attention
        ints[_WINDOW_LEFT] = attention.window_left
        self.decode_floats[_SOFT_CAP_LOG2] = attention.soft_cap_log2
        self.decode_call = (launch.decode_fn.kernel.ptr, *launch.grid, spec.threads, 1, 1, spec.smem_bytes)
        self.map_view = self.maps_written = None
        if spec.kv_copy == "tma":
            row_elems = spec.kv_row_bytes // spec.kv_elem_bytes  # a head's row (NVFP4: in bytes)
            cols = row_elems if heads.kv_layout == "HND" else heads.num_kv_heads * row_elems
            self.map_view = (row_elems, cols, spec.kv_elem_bytes, spec.tma_box_rows, spec.tma_box_bytes)
        self.merge_call = None
        if launch.merge_fn is not None:
            words, ints = self.merge_words, self.merge_ints
            words[_M_PARTIAL_O], words[_M_PARTIAL_LSE] = partial_o, partial_lse
            # Where the decode program's rows land (merge.cuh's OutRows), for either plan.
            ints[_M_NUM_QO_HEADS], ints[_M_GROUP] = heads.num_qo_heads, heads.num_qo_heads // heads.num_kv_heads
            ints[_M_QUERY_TOKENS], ints[_M_ROW_BLOCKS], ints[_M_CTA_ROWS] = (attention.query_tokens, spec.row_blocks,
                                                                             spec.cta_rows)
            ints[_M_WINDOW_LEFT], ints[_M_WINDOW_ALIGN] = attention.window_left, spec.tile_tokens
            if units:
                words[_M_SEQ_LENS], words[_M_UNITS] = 0, units.ptr
                ints[_M_BATCH] = ints[_M_NUM_SPLITS] = ints[_M_TOKENS_PER_SPLIT] = 0
                ints[_M_MAX_UNITS], ints[_M_ROWS_PER_SLOT] = units.max_units, 0
                blocks = units.merge_blocks
            else:
                words[_M_SEQ_LENS], words[_M_UNITS] = seq_lens, 0
                ints[_M_BATCH] = launch.batch
                ints[_M_NUM_SPLITS], ints[_M_TOKENS_PER_SPLIT] = plan.num_splits, plan.tokens_per_split
                ints[_M_MAX_UNITS] = 0
                ints[_M_ROWS_PER_SLOT] = heads.num_kv_heads * spec.row_blocks * spec.cta_rows
                blocks = -(-launch.batch * ints[_M_ROWS_PER_SLOT] // (MERGE_THREADS // 32))  # a warp per row
            self.merge_call = (launch.merge_fn.kernel.ptr, blocks, 1, 1, MERGE_THREADS, 1, 1, 0)
        self.bound = launch


def _struct(layout) -> tuple:
    """A zeroed struct of ``layout`` with its byte, 64-bit, 32-bit and float views, and the
    kernel-argument array (one pointer) that points at it."""
    record = layout.new()
    raw = memoryview(record.view(np.uint8)).cast("B")
    return record, raw, raw.cast("Q"), raw.cast("i"), raw.cast("f"), np.array([record.ctypes.data], np.uint64)


def _pointers(arrays) -> tuple:
    """The device addresses of plan-owned CuPy arrays (0 for None)."""
    return tuple(a.data.ptr if a is not None else 0 for a in arrays)


def _word(layout, name: str) -> int:
    """A pointer field's index in the struct's 64-bit words."""
    return layout.offset[name] // 8


def _int(layout, name: str) -> int:
    """An int (or float) field's index in the struct's 32-bit words."""
    return layout.offset[name] // 4


_Q, _K, _V, _OUT, _LSE = (_word(DECODE, f) for f in ("q", "k", "v", "out", "lse"))
_K_SCALE, _V_SCALE, _K_BLOCKS, _V_BLOCKS = (_word(DECODE, f) for f in
                                            ("k_scale", "v_scale", "k_block_scales", "v_block_scales"))
_SEQ_LENS, _PARTIAL_O, _PARTIAL_LSE, _COUNTERS, _BLOCK_TABLE, _UNITS, _SINKS = (
    _word(DECODE, f) for f in ("seq_lens", "partial_o", "partial_lse", "counters", "block_table", "units", "sinks"))
_WINDOW_LEFT, _SOFT_CAP_LOG2, _KV_STRIDE = (_int(DECODE, f) for f in ("window_left", "soft_cap_log2", "kv_stride"))
_K_PER_HEAD, _V_PER_HEAD, _MAX_LEN, _NUM_PAGES = (_int(DECODE, f) for f in
                                                  ("k_per_head", "v_per_head", "max_len", "num_pages"))
_NUM_KV_HEADS, _TOKENS_PER_SPLIT, _TABLE_STRIDE, _SCALE_LOG2 = (
    _int(DECODE, f) for f in ("num_kv_heads", "tokens_per_split", "table_stride", "scale_log2"))
_K_MAP, _V_MAP = DECODE.offset["k_map"], DECODE.offset["v_map"]
_M_PARTIAL_O, _M_PARTIAL_LSE, _M_OUT, _M_LSE, _M_SEQ_LENS, _M_UNITS, _M_SINKS = (
    _word(MERGE, f) for f in ("partial_o", "partial_lse", "out", "lse", "seq_lens", "units", "sinks"))
_M_QUERY_TOKENS, _M_ROW_BLOCKS, _M_CTA_ROWS, _M_ROWS_PER_SLOT, _M_WINDOW_LEFT, _M_WINDOW_ALIGN = (
    _int(MERGE, f) for f in ("query_tokens", "row_blocks", "cta_rows", "rows_per_slot", "window_left", "window_align"))
_M_BATCH, _M_NUM_QO_HEADS, _M_NUM_SPLITS, _M_TOKENS_PER_SPLIT, _M_MAX_LEN, _M_GROUP, _M_MAX_UNITS = (
    _int(MERGE, f) for f in ("batch", "num_qo_heads", "num_splits", "tokens_per_split", "max_len", "group",
                             "max_units"))


# ---- the run's arrays --------------------------------------------------------------------------
#: The programs load 16-byte vectors: a validated layout holds only for pointers of the same alignment.
_ALIGN_MASK = 15
_NO_QUANTIZED = (0, 0, 0, 0, 0, 0)
_NONE, _TORCH, _CUPY, _QUANTIZED, _OTHER = range(5)
_kinds: dict = {type(None): _NONE}  # an array's type -> its kind, found once per type


def _kind(cls) -> int:
    kind = _kinds.get(cls)
    if kind is None:
        module = cls.__module__
        kind = _kinds[cls] = (_TORCH if module.startswith("torch") else _CUPY if module.startswith("cupy")
                              else _QUANTIZED if issubclass(cls, QuantizedKV) else _OTHER)
    return kind


def read_arrays(q, k, v, out, lse) -> tuple[tuple | None, tuple, tuple, tuple]:
    """(layout, pointers, quantized, kv shape) of run()'s arrays: what validation depends on, read
    cheaply from CuPy arrays and torch tensors (None when any array is of another kind: such
    inputs are validated on every call); each array's device address (a quantized cache's values';
    0 for None); the decode struct's quantized-cache fields: K's and V's float32 scales and NVFP4
    block scales (addresses), then whether each scale has one value per K/V head (zeros for 16-bit
    K/V); and k's shape (a quantized cache's values'). This runs on every run().

    A torch entry holds True for a contiguous tensor rather than its strides (a call that costs a
    third as much), and a non-contiguous one's strides (a cache view's token stride is read by the
    programs), so arrays of equal entries pass or fail validation alike and launch alike."""
    cls = type(q)
    if type(out) is cls and (lse is None or type(lse) is cls):
        kind = _kinds.get(cls)
        if type(k) is cls and type(v) is cls:
            if kind == _TORCH:
                return _read_torch(q, k, v, out, lse)
            if kind == _CUPY:
                return _read_cupy(q, k, v, out, lse)
        elif type(k) is QuantizedKV and type(v) is QuantizedKV and (kind == _TORCH or kind == _CUPY):
            read = _read_quantized(q, k, v, out, lse, cls, _torch_part if kind == _TORCH else _cupy_part)
            if read is not None:
                return read
    layout, pointers, quantized = [], [], []
    known = True
    for name, x in zip(_NAMES, (q, k, v, out, lse)):
        kind = _kinds.get(type(x))
        if kind is None:  # a type not seen before
            kind = _kind(type(x))
        if kind == _TORCH:
            ptr = x.data_ptr()
            layout.append((x.shape, x.is_contiguous() or x.stride(), x.dtype, x.get_device(), ptr & _ALIGN_MASK))
        elif kind == _NONE:
            ptr = 0
            layout.append(())
        elif kind == _QUANTIZED:  # its parts' layouts and its format; its scales' fields
            values, ptr = read_array(x.values, f"{name}.values")
            blocks, blocks_ptr = read_array(x.block_scales, f"{name}.block_scales")
            scale, scale_ptr = read_array(x.scale, f"{name}.scale")
            part_known = values is not None and blocks is not None and scale is not None
            known = known and part_known
            layout.append((x.kv_dtype, values, blocks, scale) if part_known else None)
            quantized.append((scale_ptr, blocks_ptr, int(_length(x.scale) > 1)))
        else:
            entry, ptr = read_array(x, name)
            known = known and entry is not None
            layout.append(entry)
        pointers.append(ptr)
    if len(quantized) == 2:  # (k's, v's) scale, block scales, per head
        (k_scale, k_blocks, k_per_head), (v_scale, v_blocks, v_per_head) = quantized
        quantized = (k_scale, v_scale, k_blocks, v_blocks, k_per_head, v_per_head)
    else:
        quantized = _NO_QUANTIZED
    return (tuple(layout) if known else None), tuple(pointers), quantized, kv_shape(k)


def _read_torch(q, k, v, out, lse) -> tuple:
    """`read_arrays` of torch tensors (lse may be None), spelled out: the common case, where the
    generic loop's per-array dispatch would cost about as much as the reads. The entries are the
    loop's own, so a layout compares equal whichever way it was read."""
    q_ptr, k_ptr, v_ptr, out_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    lse_ptr = 0 if lse is None else lse.data_ptr()
    k_shape = k.shape
    # A cache view of a longer cache is not contiguous: its strides join its entry (which the
    # programs read: the view's token stride).
    layout = ((q.shape, q.is_contiguous(), q.dtype, q.get_device(), q_ptr & _ALIGN_MASK),
              (k_shape, k.is_contiguous() or k.stride(), k.dtype, k.get_device(), k_ptr & _ALIGN_MASK),
              (v.shape, v.is_contiguous() or v.stride(), v.dtype, v.get_device(), v_ptr & _ALIGN_MASK),
              (out.shape, out.is_contiguous(), out.dtype, out.get_device(), out_ptr & _ALIGN_MASK),
              () if lse is None else (lse.shape, lse.is_contiguous(), lse.dtype, lse.get_device(), lse_ptr & _ALIGN_MASK))
    return layout, (q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr), _NO_QUANTIZED, k_shape


def _read_quantized(q, k, v, out, lse, cls, part) -> tuple | None:
    """`read_arrays` of arrays of type ``cls`` (torch or CuPy; ``part`` reads one of them) with K
    and V quantized caches of that type (None where a part of a cache is of another kind: the
    generic loop reads those). A call per array, which still costs less than the loop's dispatch
    on each array's kind."""
    q_entry, q_ptr = part(q)
    out_entry, out_ptr = part(out)
    lse_entry, lse_ptr = ((), 0) if lse is None else part(lse)
    caches = []
    for cache in (k, v):
        values, blocks, scale = cache.values, cache.block_scales, cache.scale
        if type(values) is not cls or type(scale) is not cls or (blocks is not None and type(blocks) is not cls):
            return None
        values_entry, values_ptr = part(values)
        blocks_entry, blocks_ptr = ((), 0) if blocks is None else part(blocks)
        scale_entry, scale_ptr = part(scale)
        caches.append(((cache.kv_dtype, values_entry, blocks_entry, scale_entry), values_ptr, scale_ptr,
                       blocks_ptr, int(scale.shape[0] > 1)))
    (k_entry, k_ptr, k_scale, k_blocks, k_per_head), (v_entry, v_ptr, v_scale, v_blocks, v_per_head) = caches
    return ((q_entry, k_entry, v_entry, out_entry, lse_entry), (q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr),
            (k_scale, v_scale, k_blocks, v_blocks, k_per_head, v_per_head), k.values.shape)


def _torch_part(x) -> tuple:
    """(layout entry, device address) of one torch tensor."""
    ptr = x.data_ptr()
    return (x.shape, x.is_contiguous() or x.stride(), x.dtype, x.get_device(), ptr & _ALIGN_MASK), ptr


def _cupy_part(x) -> tuple:
    """(layout entry, device address) of one CuPy array: its entry starts with its kind, since a
    torch entry's fields compare equal to a CuPy one's; the memory pointer gives its device."""
    memory = x.data
    ptr = memory.ptr
    return (_CUPY, x.shape, x.strides, x.dtype, memory.device_id, ptr & _ALIGN_MASK), ptr


def _read_cupy(q, k, v, out, lse) -> tuple:
    """`_read_torch` for CuPy arrays: each array's memory pointer gives its address and device."""
    qm, km, vm, om = q.data, k.data, v.data, out.data
    q_ptr, k_ptr, v_ptr, out_ptr = qm.ptr, km.ptr, vm.ptr, om.ptr
    k_shape = k.shape
    if lse is None:
        lse_ptr, lse_entry = 0, ()
    else:
        lm = lse.data
        lse_ptr = lm.ptr
        lse_entry = (_CUPY, lse.shape, lse.strides, lse.dtype, lm.device_id, lse_ptr & _ALIGN_MASK)
    layout = ((_CUPY, q.shape, q.strides, q.dtype, qm.device_id, q_ptr & _ALIGN_MASK),
              (_CUPY, k_shape, k.strides, k.dtype, km.device_id, k_ptr & _ALIGN_MASK),
              (_CUPY, v.shape, v.strides, v.dtype, vm.device_id, v_ptr & _ALIGN_MASK),
              (_CUPY, out.shape, out.strides, out.dtype, om.device_id, out_ptr & _ALIGN_MASK),
              lse_entry)
    return layout, (q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr), _NO_QUANTIZED, k_shape


def read_array(x, name: str) -> tuple:
    """(layout entry or None, device address) of one array (not a quantized cache) of any kind;
    ``name`` is what an error about it calls it."""
    kind = _kind(type(x))
    if kind == _TORCH:
        return _torch_part(x)
    if kind == _CUPY:
        return _cupy_part(x)
    if kind == _NONE:
        return (), 0
    from . import tensors

    return None, tensors.describe(x, name).ptr


def _length(x) -> int:
    shape = getattr(x, "shape", None)
    if shape is None:
        from . import tensors

        shape = tensors.describe(x, "scale").shape
    return int(shape[0])


def kv_shape(k) -> tuple:
    """k's shape (a quantized cache's values'; a torch.Size for torch), for arrays without a
    .shape attribute too."""
    if isinstance(k, QuantizedKV):
        k = k.values
    if k is None:
        return ()
    shape = getattr(k, "shape", None)
    if shape is None:
        from . import tensors

        shape = tensors.describe(k, "k").shape
    return shape


_NAMES = ("q", "k", "v", "out", "lse")
#: (written, other) pairs of run()'s arrays, by their index in _NAMES, that must share no byte.
_APART = ((3, 0), (3, 1), (3, 2), (3, 4), (4, 0), (4, 1), (4, 2))


def check_outputs_apart(pointers: tuple, extents: tuple) -> None:
    """out and lse share no byte with q, k, v or each other: the programs write them while other
    CTAs still read the inputs. ValueError naming the two otherwise."""
    q, k, v, out, lse = pointers
    eq, ek, ev, eo, el = extents
    # Each written array against the others, spelled out: this runs on every run().
    if eo and (eq and out < q + eq and q < out + eo or ek and out < k + ek and k < out + eo
               or ev and out < v + ev and v < out + eo or el and out < lse + el and lse < out + eo):
        _raise_overlap(pointers, extents)
    if el and (eq and lse < q + eq and q < lse + el or ek and lse < k + ek and k < lse + el
               or ev and lse < v + ev and v < lse + el):
        _raise_overlap(pointers, extents)


def _raise_overlap(pointers: tuple, extents: tuple) -> None:
    for i, j in _APART:
        if (extents[i] and extents[j] and pointers[i] < pointers[j] + extents[j]
                and pointers[j] < pointers[i] + extents[i]):
            raise ValueError(f"{_NAMES[i]}: overlaps {_NAMES[j]} in memory; the results must go to a buffer of "
                             f"their own")
