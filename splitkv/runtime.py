"""DecodeAttention: validate, choose the programs, plan, launch.

``plan()`` does everything that may synchronise, allocate or compile: it reads the lengths, picks
dense or split and the cluster size, compiles (or loads from the cache) the programs and sizes the
workspace. The workspace is reused by later plans, so a CUDA graph captured after one plan must be
captured again after the next.
``run()`` only reads array metadata and enqueues one or two kernels on the caller's stream (with
an event after them, and a wait before them when the previous plan or run used another stream),
so it can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import threading
from collections import OrderedDict

import numpy as np

from . import paged, planning, streams, tensors
from .heuristics import (default_spec, few_splits_max_bytes, resident_ctas_per_sm, saturating_ctas,
                         takes_whole_row_clusters)
from .plan import SplitPlan
from .quantized_kv import QuantizedKV
from .spec import KV_DTYPES, KV_LAYOUTS, PAGE_SIZES, Q_DTYPES, KernelSpec, MergeSpec
from .tensor_map import TensorMapCache
from .tuned import lookup
from .tuned.keys import TuneKey
from .work_units import BUFFER_HEADER, MERGE_FIELDS, UNIT_FIELDS, CostModel, UnitPlan

_LOG2E = 1.4426950408889634
#: The programs load 16-byte vectors: a layout is only reused for pointers of the same alignment.
_ALIGN = 16
_MERGE_THREADS = 128


@dataclasses.dataclass(frozen=True)
class _BlockTable:
    """A plan's block table: the device array the program reads (kept alive here), its row length,
    and the highest page the planned lengths read, with where it is (``paged.used_pages``; page -1
    when not checked), compared with the cache's page count when run() validates."""

    array: object
    ptr: np.uint64
    stride: int
    highest: tuple


@dataclasses.dataclass(frozen=True)
class _UnitTables:
    """A units plan's tables on the device (`UnitPlan.to_buffer`, kept alive here), the unit rows
    the buffer holds (the decode grid) and the merge program's grid (0: not launched)."""

    array: object
    ptr: np.uint64
    max_units: int
    merge_blocks: int


@dataclasses.dataclass(frozen=True)
class _Launch:
    """Everything run() needs, fixed at plan time (pointers already in kernel-argument form)."""

    plan: SplitPlan
    spec: KernelSpec
    decode_fn: object
    merge_fn: object | None
    batch: int
    max_len: int  # longest planned sequence: k.shape[1] must hold it
    grid: tuple
    seq_lens: object  # device int32 [batch] (the plan's copy, or the caller's array), kept alive here
    workspace: tuple  # (partial_o, partial_lse, counters), None where unused, kept alive here
    seq_lens_ptr: np.uint64
    workspace_ptrs: tuple
    empty_kv_ptr: int = 0  # tma with every length 0: one tile of memory for maps of an empty cache
    table: _BlockTable | None = None  # paged caches: the block table the plan reads through
    units: _UnitTables | None = None  # units plans: the work-unit tables on the device
    # The decode program's Params (splitkv/params.py) and the launch argument pointing at it, per
    # thread (two threads running one plan never share the bytes a launch copies): made on the
    # thread's first run, its fields rewritten on each.
    params: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


@dataclasses.dataclass
class _SplitProgram:
    """What plan() derives from one split program, kept while that program stays
    (`DecodeAttention._split_program`): building or validating a spec costs tens of µs."""

    spec: KernelSpec
    ctas_per_sm: int  # resident CTAs per SM (its registers bound them)
    saturating: int | None  # `heuristics.saturating_ctas`
    few_splits_max_bytes: int  # `heuristics.few_splits_max_bytes`
    clustered: dict = dataclasses.field(default_factory=dict)  # cluster size -> the program in such clusters
    cluster_fit: dict = dataclasses.field(default_factory=dict)  # cluster size -> clusters resident at once

    def in_clusters(self, cluster: int) -> KernelSpec:
        """The split program with ``cluster`` CTAs per thread-block cluster."""
        spec = self.clustered.get(cluster)
        if spec is None:
            spec = self.clustered[cluster] = self.spec.replace(cluster=cluster)
        return spec


class DecodeAttention:
    """Decode attention for a fixed head layout, planned once per step and run once per layer.

    >>> attn = DecodeAttention(num_qo_heads=32, num_kv_heads=8, head_dim=128)
    >>> attn.plan(seq_lens)               # host lengths (or a device int32 array, read back)
    >>> out = attn.run(q, k, v)           # every layer of the step; no sync, no compile

    ``spec`` overrides the built-in CTA shape of both programs (its variant is ignored: the planner
    chooses); ``dense_spec`` then overrides the dense program's alone, e.g. for tuning them apart.
    ``device``: the CUDA device it runs on (default: CuPy's current device when it is built);
    plan() and run() switch to it, whatever device is current when they are called.

    Without ``spec`` and ``dense_spec``, plan() takes both programs from the tuned table of this GPU
    (`splitkv.autotune.lookup`: the entry of the workload bucket nearest the planned lengths),
    else the built-in heuristic; ``tuned=False`` keeps the built-in heuristic. ``tuned_source``
    says which table was found (None: none), ``tuned_entry`` which entry the last plan used.

    ``unit_costs`` (`work_units.CostModel`) is the cost model the work-unit planner plans units
    with (``plan(variant='units')``, and ragged batches the default planner routes to units); None
    takes the costs of the first table that holds them (`lookup.unit_costs`: this GPU's, else
    another GPU's of the same arch; ``splitkv-gen --tune --unit-costs`` writes them) when ``tuned``
    is True, else the planner's built-in priors. ``unit_costs_source`` names that table (None: no
    table's). Whether a batch is routed to units is decided under the priors, which the routing
    factor was measured with.

    ``page_size`` (None: contiguous caches ``[B, L, Hkv, D]``): run() reads paged caches of pages of
    that many tokens, ``kv_layout`` 'NHD' ``[num_pages, page_size, Hkv, D]`` or 'HND'
    ``[num_pages, Hkv, page_size, D]``, through the ``block_table`` given to plan().

    The workspace comes from CuPy's memory pool on the stream of the plan() that sized it. When
    run() is called on other streams, keep the instance alive until those runs are done (or
    synchronize them before dropping it): a freed block may be handed out again on the plan's
    stream, which does not wait for work on the others.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, *, q_dtype: str = "bf16",
                 kv_dtype: str = "bf16", sm_scale: float | None = None, spec: KernelSpec | None = None,
                 dense_spec: KernelSpec | None = None, device: int | None = None, page_size: int | None = None,
                 kv_layout: str = "NHD", tuned: bool = True, unit_costs: CostModel | None = None):
        import cupy

        for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name}: expected an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        num_qo_heads, num_kv_heads, head_dim = int(num_qo_heads), int(num_kv_heads), int(head_dim)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        sm_scale = _checked_sm_scale(sm_scale)
        for name, value, allowed in (("q_dtype", q_dtype, Q_DTYPES), ("kv_dtype", kv_dtype, KV_DTYPES)):
            if not isinstance(value, str) or value not in allowed:
                raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")
        if page_size is not None and (isinstance(page_size, bool) or page_size not in PAGE_SIZES):
            raise ValueError(f"page_size: expected None (contiguous caches) or a power of two from 1 to "
                             f"{PAGE_SIZES[-1]}, got {page_size!r}")
        if kv_layout not in KV_LAYOUTS or (page_size is None and kv_layout != "NHD"):
            raise ValueError(f"kv_layout: expected one of {list(KV_LAYOUTS)} ('HND' with a page_size), got {kv_layout!r}")
        self.page_size, self.kv_layout = int(page_size or 0), kv_layout
        paging = dict(page_size=self.page_size, kv_layout=kv_layout)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.group_size = num_qo_heads // num_kv_heads
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
        device = cupy.cuda.Device(device)  # None: CuPy's current device
        self.device = device.id
        self.arch = "sm_" + device.compute_capability
        self.num_sms = device.attributes["MultiProcessorCount"]
        layout = (head_dim, self.group_size, q_dtype, kv_dtype)
        for name, given in (("spec", spec), ("dense_spec", dense_spec)):
            if given is not None and (given.head_dim, given.group_size, given.q_dtype, given.kv_dtype) != layout:
                raise ValueError(f"{name}: {given.name} does not match head_dim={head_dim}, group={self.group_size}, "
                                 f"q_dtype={q_dtype}, kv_dtype={kv_dtype}")
            if given is not None and given.warp_heads:
                raise ValueError(f"{name}: warp_heads is chosen per plan, not per instance; "
                                 "use plan(..., warp_heads=True)")
        base = spec or default_spec(self.arch, *layout, **paging)
        self.split_spec = base.replace(arch=self.arch, variant="split", **paging)
        if dense_spec is not None:
            self.dense_spec = dense_spec.replace(arch=self.arch, **paging).as_dense()
        elif spec is None:  # the built-in shapes differ between the programs
            self.dense_spec = default_spec(self.arch, *layout, "dense", **paging)
        else:
            self.dense_spec = base.replace(arch=self.arch, **paging).as_dense()
        self._whole_row_clusters = takes_whole_row_clusters(self.split_spec)
        if not isinstance(tuned, bool):
            raise TypeError(f"tuned: expected True or False, got {tuned!r}")
        self._tuned = None
        if tuned and spec is None and dense_spec is None:
            key = TuneKey(head_dim, self.group_size, q_dtype, kv_dtype, self.page_size, kv_layout)
            self._tuned = lookup.find(self.arch, gpu_name(self.device), key)
        self.tuned_source = self._tuned.source if self._tuned else None
        self.tuned_entry = None
        if unit_costs is not None and not isinstance(unit_costs, CostModel):
            raise TypeError(f"unit_costs: expected a splitkv.work_units.CostModel or None, got {unit_costs!r}")
        self.unit_costs, self.unit_costs_source = unit_costs, None
        if unit_costs is None and tuned:
            found = lookup.unit_costs(self.arch, gpu_name(self.device))
            if found is not None:
                self.unit_costs, self.unit_costs_source = found[0].costs, found[1]
        self.merge_spec = MergeSpec(arch=self.arch, head_dim=head_dim, out_dtype=q_dtype, threads=_MERGE_THREADS)
        self._launch: _Launch | None = None
        self._validated_layout: tuple | None = None
        self._extents: tuple = ()  # bytes each run() array spans, for the validated layout
        self._split: _SplitProgram | None = None  # what plans derive from the split program
        self._derived: dict[str, tuple] = {}  # what derives from a program, see _kept
        self._unit_merge_spec = dataclasses.replace(self.merge_spec, tables=True)  # units plans' merge program
        self._loaded: dict[int, tuple] = {}  # id(spec) -> (spec, function, compile result), see _load
        self._workspace: dict[str, object] = {}
        self._tensor_maps = TensorMapCache()  # kv_copy='tma': the caches' maps, encoded once each
        self._order = streams.StreamOrder()  # plan() and run() in call order across streams
        self._producer_events: dict[int, object] = {}  # streams named by inputs' interfaces

    # ---- planning (may sync, allocate, compile) ------------------------------------------------
    def plan(self, seq_lens, max_len: int | None = None, *, block_table=None, validate: bool = True,
             variant: str | None = None, num_splits: int | None = None, warp_heads: bool | None = None,
             max_units: int | None = None, stream=None) -> SplitPlan | UnitPlan:
        """Choose dense or split for these lengths, compile what that needs, size the workspace.

        ``seq_lens``: host ints or a device int32 array (read back once here). ``max_len``, when
        given, bounds the lengths; for a device ``seq_lens`` the plan also covers it, so lengths
        rewritten in place may grow up to it between CUDA-graph replays (such a plan is never a
        units plan, whose units cover the planned lengths only). A plan() that raises leaves the
        previous plan, and every buffer it reads, as it was. ``variant`` (and
        ``num_splits`` for 'split'; other variants ignore it) override the planner's choice, for
        tests, benchmarks and tuning;
        ``warp_heads`` True or False overrides whether a dense plan's warps get a K/V head each
        (None: the planner's choice, ``plan.wants_packed_heads``, which applies to a dense plan
        asked for through ``variant`` too).
        ``variant='units'``: the work-unit planner (`work_units.choose_kv_splits`) and the units
        program, one CTA per unit in table order (longest first), split rows merged by the merge
        program; returns the `UnitPlan`. ``max_units`` fixes the tables' sizes (at least
        ``work_units.max_units(rows, slots, attn.unit_costs)`` for the batch's rows, for any
        lengths): a later plan() of the same
        batch and sizes then rewrites the tables in place, and a CUDA graph captured over run()
        replays with them (the merge program then always runs, doing nothing when no row is split).
        ``block_table`` (paged caches only, and required there): int32 ``[B, max_pages_per_seq]``, host
        or device; a device table is read in place, so entries rewritten there reach graph
        replays. ``validate`` (default True): the table is read back and checked (every page a
        length needs is listed and not negative here; that each exists, when run() first sees the
        cache), a clear ValueError naming the sequence and entry at fault; False skips reading a
        device table back. Either way the programs clamp every page index into the cache, so no
        table makes them read outside it.
        ``stream``: where the lengths and the zeroed counters are written (a CuPy or torch stream,
        or a handle). Default: torch's current stream for a torch ``seq_lens``, else the current
        CuPy stream of this instance's device. run() may launch on other streams: the GPU keeps
        plans and runs in call order whatever streams they use (an event after each; a call on
        another stream than the one before waits for it; the host never waits).
        """
        on_device = tensors.is_device_array(seq_lens)
        with self._in_call_order(seq_lens if on_device else None, stream):
            return self._plan(seq_lens, on_device, max_len, variant, num_splits, warp_heads, block_table, validate,
                              max_units)

    @contextlib.contextmanager
    def _in_call_order(self, like, stream):
        """For one plan() or run(): this instance's device current, and the call's stream (``stream``,
        else that of ``like``, see ``tensors.stream_ptr``) current and ordered after the previous
        plan or run when that used another stream; yields the stream's handle."""
        with streams.on_device(self.device):  # CuPy's current stream is the device's own
            ptr = tensors.stream_ptr(like, stream)
            with streams.use_stream(ptr):
                capturing = self._order.enter(ptr)
                yield ptr
                self._order.leave(ptr, capturing)

    def _plan(self, seq_lens, on_device, max_len, variant, num_splits, warp_heads, block_table, validate, max_units):
        """plan(); ``on_device``: whether ``seq_lens`` is a device array."""
        if warp_heads is not None and not isinstance(warp_heads, bool):
            raise TypeError(f"warp_heads: expected None, True or False, got {warp_heads!r}")
        if not isinstance(validate, bool):
            raise TypeError(f"validate: expected True or False, got {validate!r}")
        if (block_table is None) != (self.page_size == 0):
            raise ValueError("block_table: paged caches need one (and only they take one); this instance reads "
                             + (f"pages of {self.page_size} tokens" if self.page_size else
                                "contiguous caches (build it with page_size=... for paged ones)"))
        lens = self._host_lengths(seq_lens, max_len, on_device)
        batch = lens.size
        host_lens = lens  # what the plan covers
        if on_device and max_len is not None and int(max_len) > int(lens.max()):
            # The caller may rewrite these lengths in place up to max_len before a (graph) replay:
            # plan for the longest one allowed. Host lengths are copied here and cannot grow.
            host_lens = lens.copy()
            host_lens[int(np.argmax(host_lens))] = int(max_len)
        max_planned = int(host_lens.max(initial=0))  # the longest sequence the plan covers
        # The tuned entry nearest this workload chooses the programs (and may make the plan dense).
        tuned_forces_dense = self._tuned is not None and self._use_tuned(batch * self.num_kv_heads, max_planned)
        may_grow = host_lens is not lens
        if variant != "units" and max_units is not None:
            raise ValueError("max_units: sizes the tables of variant='units' plans only")
        # The planners' lengths, checked already: int64, which they take as they are (see
        # plan.plan_splits_unchecked), converted once here.
        planned = host_lens.astype(np.int64)
        if variant == "units":  # the units program's slots; the split program is not loaded for it
            planning.check_units_request(max_planned, may_grow=may_grow, num_splits=num_splits, warp_heads=warp_heads)
            units_spec = self._units_spec()
            _, compiled = self._load(units_spec)
            gpu = planning.GpuFacts(self.num_sms, resident_ctas_per_sm(units_spec, compiled.registers))
            in_clusters = None
        else:
            program = self._split_program()
            gpu = planning.GpuFacts(self.num_sms, program.ctas_per_sm, program.saturating,
                                    program.few_splits_max_bytes, self._max_active_clusters)
            in_clusters = program.in_clusters
        programs = planning.Programs(self.split_spec, self.dense_spec, self.tuned_entry, tuned_forces_dense,
                                     self.unit_costs, self._packed_dense_spec, self._units_spec, in_clusters,
                                     self._whole_row_clusters)
        choice = planning.choose_plan(planned, max_planned, self.num_kv_heads, programs, gpu, may_grow=may_grow,
                                      variant=variant, num_splits=num_splits, warp_heads=warp_heads)
        plan, spec = choice.plan, choice.spec
        if isinstance(plan, UnitPlan):
            return self._plan_units(seq_lens, on_device, lens, host_lens, block_table, validate, max_units, plan)
        # Everything that may raise comes before the first write to a buffer the live plan uses.
        checked_table = self._check_table(block_table, lens, host_lens, validate) if self.page_size else None
        decode_fn, _ = self._load(spec)
        merge_fn = self._load(self.merge_spec)[0] if choice.merge else None
        grid = (plan.num_splits, self.num_kv_heads // plan.heads_per_cta, batch)
        if max(grid[1], grid[2]) > _MAX_GRID_YZ:
            raise ValueError(f"seq_lens: a batch of {batch} sequences x {self.num_kv_heads} K/V heads exceeds the "
                             f"launch grid ({_MAX_GRID_YZ} sequences and K/V heads at most); split the batch")
        partial_o = partial_lse = counters = None
        if plan.variant == "split":
            rows = batch * plan.num_splits * self.num_qo_heads
            partial_o = self._buffer("partial_o", rows * self.head_dim, np.float32)
            partial_lse = self._buffer("partial_lse", rows, np.float32)
            # Merge counters [batch][num_kv_heads][cluster] (with several clusters per row, each
            # cluster rank merges its slice of the row).
            if spec.fused_merge:
                counters = self._buffer("counters", batch * self.num_kv_heads * spec.cluster, np.int32, zero=True)
        table = self._write_table(checked_table) if self.page_size else None
        device_lens = self._device_lens(seq_lens, on_device, lens)
        workspace = (partial_o, partial_lse, counters)
        self._launch = _Launch(plan, spec, decode_fn, merge_fn, batch, max_planned,
                               grid, device_lens, workspace, np.uint64(device_lens.data.ptr),
                               _pointers(workspace), self._empty_kv_ptr(spec, max_planned), table)
        self._validated_layout = None
        return plan

    def _split_program(self) -> _SplitProgram:
        """The split program's resident CTAs per SM, saturating CTAs and derived programs
        (`_SplitProgram`), kept while the split program stays."""
        held = self._split
        if held is None or not _same_spec(held.spec, self.split_spec):
            spec = self.split_spec
            _, compiled = self._load(spec)
            held = self._split = _SplitProgram(spec, resident_ctas_per_sm(spec, compiled.registers),
                                               saturating_ctas(spec), few_splits_max_bytes(spec))
        return held

    def _kept(self, name: str, source: KernelSpec, derive) -> KernelSpec:
        """``derive(source)``, kept under ``name`` while ``source`` stays (building and validating a
        spec is a sizeable part of a plan's host time)."""
        held = self._derived.get(name)
        if held is None or not _same_spec(held[0], source):
            held = self._derived[name] = (source, derive(source))
        return held[1]

    def _packed_dense_spec(self) -> KernelSpec:
        """The dense program with a warp per K/V head."""
        return self._kept("packed dense", self.dense_spec, lambda spec: spec.replace(warp_heads=True))

    def _units_spec(self) -> KernelSpec:
        """The units program of the split program's CTA shape (`KernelSpec.as_units`); the split
        program itself is not loaded for it."""
        return self._kept("units", self.split_spec, KernelSpec.as_units)

    def _load(self, spec) -> tuple:
        """`load_kernel(spec)` on this instance's GPU, whichever is current: (function, compile
        result), kept per spec object, since the loader's own cache hashes every field of the spec
        on each call. The specs plans launch are kept by this instance (`_split_program`,
        `_packed_dense_spec`, `_units_spec`), so the same objects come back."""
        held = self._loaded.get(id(spec))
        if held is None or held[0] is not spec:  # the id of a spec since dropped may be reused
            from .codegen.load import load_kernel

            if len(self._loaded) >= _MAX_LOADED:  # specs an instance no longer uses (tuned entries, say)
                self._loaded.clear()
            with streams.on_device(self.device):  # a module is loaded into the current device's context
                held = self._loaded[id(spec)] = (spec, *load_kernel(spec))
        return held[1:]

    def _use_tuned(self, rows: int, max_len: int) -> bool:
        """Take the programs of the tuned entry nearest this workload (`lookup.programs_for`); True
        when the plan must be dense."""
        entry = self._tuned.entry_for(rows, max_len)
        split, dense, forced = lookup.programs_for(entry.spec if entry else None, self.arch, self._tuned.key, rows,
                                                   self.num_sms)
        if not _same_spec(split, self.split_spec):
            self.split_spec = split  # _split_program follows
            self._whole_row_clusters = takes_whole_row_clusters(split)
        self.dense_spec, self.tuned_entry = dense, entry
        return forced

    def _device_lens(self, seq_lens, on_device: bool, lens: np.ndarray):
        """The lengths the programs read: the caller's device array (``on_device``; lengths it
        rewrites in place reach graph replays), or the plan's copy of host lengths."""
        if on_device:
            return tensors.to_cupy(seq_lens)
        device_lens = self._buffer("seq_lens", lens.size, np.int32)
        device_lens.set(lens)
        return device_lens

    def _plan_units(self, seq_lens, on_device, lens, host_lens, block_table, validate, max_units,
                    plan: UnitPlan) -> UnitPlan:
        """A units plan's launch: ``plan``'s tables for ``host_lens`` (`planning.choose_plan`)."""
        spec = self._units_spec()
        decode_fn, _ = self._load(spec)
        rows = lens.size * self.num_kv_heads
        static = max_units is not None
        if static:
            if isinstance(max_units, bool) or not isinstance(max_units, numbers.Integral) or max_units < len(plan.units):
                raise ValueError(f"max_units: expected an int of at least this plan's {len(plan.units)} units "
                                 f"(work_units.max_units gives a bound for any lengths), got {max_units!r}")
            max_units = int(max_units)
        else:
            max_units = len(plan.units)
        max_merges = rows if static else max(len(plan.merges), 1)
        merge_fn, merge_blocks = None, 0
        if plan.split or static:
            merge_spec = self._unit_merge_spec
            merge_fn, _ = self._load(merge_spec)
            warps = merge_spec.threads // 32
            merge_blocks = -(-max_merges * self.group_size // warps)
        # Everything that may raise comes before the first write to a buffer the live plan uses
        # (with max_units, a captured graph replays the tables written here).
        checked_table = self._check_table(block_table, lens, host_lens, validate) if self.page_size else None
        tables = self._buffer("unit_tables", max_units * len(UNIT_FIELDS) + max_merges * len(MERGE_FIELDS)
                              + len(BUFFER_HEADER), np.int32)
        tables.set(plan.to_buffer(max_units, max_merges))
        # Every unit writes at most one partial: a static plan holds room for as many as it has units.
        slots_held = max_units if static else plan.num_partials
        width = self.group_size * self.head_dim
        partial_o = self._buffer("partial_o", max(slots_held, 1) * width, np.float32)
        partial_lse = self._buffer("partial_lse", max(slots_held, 1) * self.group_size, np.float32)
        table = self._write_table(checked_table) if self.page_size else None
        device_lens = self._device_lens(seq_lens, on_device, lens)
        workspace = (partial_o, partial_lse, None)
        units = _UnitTables(tables, np.uint64(tables.data.ptr), max_units, merge_blocks)
        max_planned = int(host_lens.max(initial=0))
        self._launch = _Launch(plan, spec, decode_fn, merge_fn, lens.size, max_planned,
                               (max_units, 1, 1), device_lens, workspace, np.uint64(device_lens.data.ptr),
                               _pointers(workspace), self._empty_kv_ptr(spec, max_planned), table, units)
        self._validated_layout = None
        return plan

    def _check_table(self, block_table, lens: np.ndarray, host_lens: np.ndarray, validate: bool) -> tuple:
        """The plan's block table (see plan()), checked and not yet written anywhere: (device table or
        None, host table or None, stride, highest page used). Its entries are checked against the
        lengths ``lens`` (pages a length does not use yet are not); its width against the longest
        length the plan covers (``host_lens``: lengths may grow up to max_len)."""
        host = device_table = None
        if tensors.is_device_array(block_table):
            info = tensors.describe(block_table, "block_table")
            tensors.check_block_table_info(info, lens.size)
            _check_device("block_table", info, self.device, "this DecodeAttention runs on")
            device_table, stride = tensors.to_cupy(block_table), info.shape[1]
            if validate:
                host = device_table.get()  # like device lengths, read back once here
        else:
            host = np.asarray(block_table)
            stride = host.shape[1] if host.ndim == 2 else 0
        highest = (-1, -1, -1)
        if host is not None:
            host, highest = paged.used_pages(host, lens, self.page_size)
        if int(host_lens.max(initial=0)) > stride * self.page_size:
            raise ValueError(f"block_table: holds {stride} pages of {self.page_size} tokens per sequence, "
                             f"but the plan covers a sequence of {int(host_lens.max())}")
        return device_table, None if device_table is not None else host, stride, highest

    def _write_table(self, checked: tuple) -> _BlockTable:
        """A checked table's device copy: a device table in place, a host one copied to the plan's buffer."""
        device_table, host, stride, highest = checked
        if device_table is None:
            device_table = self._buffer("block_table", host.size, np.int32)
            device_table.set(host.ravel())
        return _BlockTable(device_table, np.uint64(device_table.data.ptr), stride, highest)

    def _empty_kv_ptr(self, spec: KernelSpec, max_planned: int) -> int:
        """Where the tensor maps of a plan of no tokens point (0: not needed). k.shape[1] may then be 0,
        and a tensor map cannot describe no rows: such maps describe this tile instead, which no CTA
        reads (every length is 0, so no tile is requested)."""
        if spec.kv_copy != "tma" or max_planned:
            return 0
        tile_bytes = spec.tile_tokens * self.num_kv_heads * spec.kv_row_bytes
        return self._buffer("empty_kv", tile_bytes, np.uint8).data.ptr

    def _max_active_clusters(self, cluster: int) -> int | None:
        """Clusters of ``cluster`` split CTAs resident at once on this GPU (None: unknown)."""
        program = self._split_program()
        if cluster not in program.cluster_fit:
            from .codegen.occupancy import max_active_clusters

            spec = program.in_clusters(cluster)
            function, _ = self._load(spec)
            with streams.on_device(self.device):  # the query runs in the function's context
                program.cluster_fit[cluster] = max_active_clusters(function, cluster, spec.threads, spec.smem_bytes)
        return program.cluster_fit[cluster]

    @property
    def plan_info(self) -> str:
        if self._launch is None:
            return "not planned"
        p = self._launch.plan
        if isinstance(p, UnitPlan):
            return (f"units: {len(p.units)} units ({p.num_partials} partials of {len(p.merges)} split rows) of "
                    f"{p.block_size}-token blocks on {p.slots} slots of {self.num_sms} SMs; {self._launch.spec.name}")
        return (f"{p.variant}: {p.num_splits} split(s) of {p.tokens_per_split} tokens, {p.num_ctas} CTAs "
                f"on {self.num_sms} SMs; {self._launch.spec.name}")

    def _host_lengths(self, seq_lens, max_len, on_device: bool | None = None) -> np.ndarray:
        """The lengths, checked, as int32 on the host (device ones read back); ``on_device``: whether
        they are a device array, when the caller knows already."""
        if seq_lens is None:
            raise ValueError("seq_lens: plan() needs the lengths (host ints or a device int32 array)")
        if on_device is None:
            on_device = tensors.is_device_array(seq_lens)
        if on_device:
            # the one synchronisation of plan()
            seq_lens = _read_back_lengths(seq_lens, None, self.device, "this DecodeAttention runs on")
        host = np.asarray(seq_lens)
        if host.ndim != 1 or host.size == 0:
            raise ValueError(f"seq_lens: expected a non-empty 1-D sequence of lengths, got shape {host.shape}")
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral)):
            raise TypeError(f"max_len: expected None or an int, got {max_len!r}")
        return tensors.check_seq_lens(host, host.size, None if max_len is None else int(max_len))

    def _buffer(self, name: str, size: int, dtype, zero: bool = False):
        """A workspace array of at least ``size`` elements, reused across plans while it fits."""
        import cupy

        held = self._workspace.get(name)
        fresh = held is None or held.size < size
        if fresh:
            if held is not None:
                # The block returns to the pool of the stream it was allocated on, which may hand it
                # out at once; runs on other streams may still use it. A rare sync: buffers only grow.
                self._order.synchronize()
            held = cupy.zeros(max(size, 1), dtype=dtype)
            self._workspace[name] = held
        view = held if held.size == size else held[:size]  # a slice of a CuPy array costs a µs or two
        if zero and not fresh:  # a fresh buffer is zeros already
            view.fill(0)
        return view

    # ---- running (no sync, no allocation when out/lse are given, no compile) -------------------
    def run(self, q, k, v, *, out=None, lse=None, return_lse: bool = False, stream=None):
        """Attention of ``q`` over the planned lengths of ``k`` / ``v``; returns out (and lse).

        ``k`` and ``v``: arrays of the instance's kv_dtype, or for a quantized kv_dtype ('fp8_e4m3',
        'nvfp4') `splitkv.QuantizedKV` caches (from `splitkv.quantize_kv`), whose scales are read on
        the device at every run, so they may change between CUDA-graph replays.

        Pass ``out`` (and ``lse``) to make the call allocation-free. Inputs are validated in full
        the first time a layout (kinds, shapes, strides, dtypes, devices) is seen after plan();
        later calls with the same layout only read the data pointers.
        """
        launch = self._launch
        if launch is None:
            raise RuntimeError("run() before plan(): call plan(seq_lens) first")
        with self._in_call_order(q, stream) as launch_stream:
            # Allocated on the launch stream: a pool hands the block out again only after this launch.
            if out is None:
                out = _new_output(q, stream=launch_stream)
            if return_lse and lse is None:
                lse = _new_output(q, lse=True, stream=launch_stream)
            self._launch_on_current_stream(launch, q, k, v, out, lse, launch_stream)
        return (out, lse) if return_lse else out

    def _launch_on_current_stream(self, launch: _Launch, q, k, v, out, lse, launch_stream: int) -> None:
        arrays = (q, k, v, out, lse)
        layout = tuple(_layout(x) for x in arrays)
        if None in layout or layout != self._validated_layout:
            # Arrays known only by their interface are validated on every call, and their
            # producers' streams (the interface's 'stream') waited for.
            producers, self._extents = self._validate(arrays)  # the extents hold while the layout does
            for producer in producers:
                streams.wait_for_producer(producer, launch_stream, self._producer_events)
            self._validated_layout = None if None in layout else layout
        pointers = tuple(_data_ptr(x) for x in arrays)
        _check_outputs_apart(pointers, self._extents)
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr = (np.uint64(p) for p in pointers)
        quantized_args = _quantized_args(k, v)

        plan, spec, table = launch.plan, launch.spec, launch.table
        kv_shape = _kv_shape(k)
        num_pages = kv_shape[0] if table else 0
        # Tokens per sequence the cache holds: a contiguous cache's rows, or a table row's pages.
        cache_len = table.stride * self.page_size if table else kv_shape[1]
        units = launch.units
        # One Params struct (splitkv/params.py) per launch and thread: the plan's fields written
        # when it is made, the arrays' fields on every call (fields a program does not read stay zero).
        packed = launch.params.get(threading.get_ident())
        if packed is None:
            packed = launch.params[threading.get_ident()] = self._new_params(launch)
        params, argument = packed
        params["q"], params["k"], params["v"], params["out"], params["lse"] = q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr
        params["max_len"], params["num_pages"] = cache_len, num_pages
        (params["k_scale"], params["k_per_head"], params["v_scale"], params["v_per_head"],
         params["k_block_scales"], params["v_block_scales"]) = quantized_args
        if spec.kv_copy == "tma":
            # The maps' rows: a contiguous cache's tokens ([batch x cache_len][num_kv_heads x head_dim]),
            # a paged one's ([num_pages x page_size][num_kv_heads x head_dim], HND: [num_pages x
            # num_kv_heads x page_size][head_dim]).
            row_elems = spec.kv_row_bytes // spec.kv_elem_bytes  # a head's row (NVFP4: in bytes)
            rows, cols = launch.batch * cache_len, self.num_kv_heads * row_elems
            if table:
                rows = num_pages * self.page_size * (self.num_kv_heads if self.kv_layout == "HND" else 1)
                cols = row_elems if self.kv_layout == "HND" else cols
            bases = (int(k_ptr), int(v_ptr))
            if rows == 0:  # an empty cache (every length is 0): maps of the plan's stand-in tile
                rows, bases = spec.tile_tokens, (launch.empty_kv_ptr,) * 2
            view = (rows, cols, spec.kv_elem_bytes, spec.tma_box_rows, spec.tma_box_bytes)
            for field, base in zip(("k_map", "v_map"), bases):
                params[field] = self._tensor_maps.argument(base, *view)[1].view(np.uint8)
        # CuPy copies the struct's bytes when the kernel is launched (or captured).
        launch.decode_fn(launch.grid, (spec.threads,), (argument,), shared_mem=spec.smem_bytes)
        if launch.merge_fn is not None and units:
            launch.merge_fn((units.merge_blocks,), (_MERGE_THREADS,),
                            (*launch.workspace_ptrs[:2], units.ptr, out_ptr, lse_ptr, np.int32(self.group_size),
                             np.int32(units.max_units)))
        elif launch.merge_fn is not None:
            rows = launch.batch * self.num_qo_heads
            warps = _MERGE_THREADS // 32
            launch.merge_fn(
                ((rows + warps - 1) // warps,), (_MERGE_THREADS,),
                (*launch.workspace_ptrs[:2], launch.seq_lens_ptr, out_ptr, lse_ptr, np.int32(launch.batch),
                 np.int32(self.num_qo_heads), np.int32(plan.num_splits), np.int32(plan.tokens_per_split),
                 np.int32(cache_len)))

    def _new_params(self, launch: _Launch) -> tuple:
        """(Params buffer, the launch argument pointing at it) with the fields fixed by the plan."""
        from cupy.cuda.function import CPointer

        from .params import new_decode_params

        params = new_decode_params()
        params["seq_lens"] = launch.seq_lens_ptr
        params["partial_o"], params["partial_lse"], params["counters"] = launch.workspace_ptrs
        params["num_kv_heads"], params["scale_log2"] = self.num_kv_heads, self.sm_scale * _LOG2E
        params["tokens_per_split"] = 0 if launch.units else launch.plan.tokens_per_split
        if launch.table is not None:
            params["block_table"], params["table_stride"] = launch.table.ptr, launch.table.stride
        params["units"] = launch.units.ptr if launch.units else 0
        return params, CPointer(params.ctypes.data)

    def _validate(self, arrays) -> tuple[list, tuple]:
        """Checks the run's arrays; returns the streams their producers named (interface 'stream')
        and the bytes each array spans (a quantized cache: its values; None: 0)."""
        q, k, v, out, lse = arrays
        scale_infos = []  # a quantized cache's scales are read on this device too, once their producers are done
        extents = []

        def describe(x, name):
            if name not in ("k", "v") or not isinstance(x, QuantizedKV):
                info = tensors.describe(x, name, bf16_from_uint16=True)
                extents.append(info.nbytes)
                return info
            parts = tensors.describe_quantized(x, name, self.kv_layout if self.page_size else "NHD")
            scale_infos.extend([(f"{name}.block_scales", parts.block_scales), (f"{name}.scale", parts.scale)])
            extents.append(parts.values.nbytes)
            return tensors.quantized_kv_info(x.kv_dtype, parts)

        infos = [describe(x, name) for x, name in zip(arrays[:4], "q k v out".split())]
        lse_info = tensors.describe(lse, "lse") if lse is not None else None
        extents.append(lse_info.nbytes if lse_info is not None else 0)
        named = list(zip("q k v out lse".split(), (*infos, lse_info))) + scale_infos
        for name, info in named:
            if info is not None:
                _check_device(name, info, self.device, "this DecodeAttention runs on")
        shapes = tensors.check_decode_inputs(*infos[:3], out=infos[3], lse=lse_info,
                                             kv_layout=self.kv_layout if self.page_size else None)
        self._check_against_plan(shapes, self._launch)
        return [info.stream for _, info in named if info is not None and info.stream is not None], tuple(extents)

    def _check_against_plan(self, shapes: tensors.DecodeShapes, launch: _Launch) -> None:
        expected = (launch.batch, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                    self.split_spec.q_dtype, self.split_spec.kv_dtype)
        got = (shapes.batch, shapes.num_qo_heads, shapes.num_kv_heads, shapes.head_dim,
               shapes.q_dtype, shapes.kv_dtype)
        if got != expected:
            raise ValueError(f"q/k/v: planned for (batch, num_qo_heads, num_kv_heads, head_dim, q_dtype, "
                             f"kv_dtype) = {expected}, got {got}")
        if launch.table is None and shapes.max_len < launch.max_len:
            raise ValueError(f"k: holds {shapes.max_len} tokens (k.shape[1]) but the plan has a sequence of "
                             f"{launch.max_len}")
        if launch.table is not None:
            if shapes.page_size != self.page_size:
                raise ValueError(f"k: pages of {shapes.page_size} tokens, but this instance reads pages of "
                                 f"{self.page_size} ({self.kv_layout})")
            if shapes.num_pages == 0 and launch.max_len > 0:
                raise ValueError(f"k: a cache of no pages, but the plan has a sequence of {launch.max_len}")
            paged.check_pages_exist(launch.table.highest, shapes.num_pages)


# ---- one-shot API ------------------------------------------------------------------------------
#: decode()'s instances, most recently used last; each holds compiled programs and a workspace, so
#: only the last few layouts and streams are kept.
_instances: OrderedDict[tuple, DecodeAttention] = OrderedDict()
_MAX_INSTANCES = 16
_instances_lock = threading.Lock()


def decode(q, k, v, seq_lens=None, *, block_table=None, kv_layout: str = "NHD", validate: bool = True,
           sm_scale: float | None = None, out=None, return_lse: bool = False, stream=None):
    """Decode attention of ``q`` [B, Hq, D] over ``k``, ``v`` [B, L_max, Hkv, D].

    ``seq_lens``: per-sequence lengths (host ints or a device int32 array; None = all L_max).
    Paged caches: ``k``, ``v`` ``[num_pages, page_size, Hkv, D]`` (``kv_layout`` 'NHD') or
    ``[num_pages, Hkv, page_size, D]`` ('HND'), ``block_table`` int32 ``[B, max_pages_per_seq]`` (host
    or device) and ``seq_lens`` required; ``validate`` checks the table (see `DecodeAttention.plan`).
    Returns ``out`` [B, Hq, D] in q's dtype and kind (CuPy or torch), and with ``return_lse`` also
    the natural-log log-sum-exp [B, Hq] in float32. Plans on every call (reading device lengths
    back); for the hot loop of a server use `DecodeAttention` and call ``run`` per layer.
    """
    qi = tensors.describe(q, "q", bf16_from_uint16=True)
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {list(KV_LAYOUTS)}, got {kv_layout!r}")
    paging = block_table is not None
    if kv_layout != "NHD" and not paging:  # a contiguous cache is [B, L, Hkv, D]: NHD only
        raise ValueError(f"kv_layout: {kv_layout!r} is a page layout and needs a block_table; a contiguous "
                         f"cache [B, L_max, Hkv, D] is read as 'NHD'")
    ki = tensors.describe_kv(k, "k", kv_layout if paging else "NHD")
    vi = tensors.describe_kv(v, "v", kv_layout if paging else "NHD")
    shapes = tensors.check_decode_inputs(qi, ki, vi, kv_layout=kv_layout if paging else None)
    if paging and seq_lens is None:
        raise ValueError("seq_lens: a paged cache needs the lengths (its pages do not say them)")
    sm_scale = _checked_sm_scale(sm_scale)
    import cupy

    device = qi.device if qi.device is not None else cupy.cuda.Device().id
    with cupy.cuda.Device(device):
        launch_stream = tensors.stream_ptr(qi, stream)
        if seq_lens is None:
            seq_lens = np.full(shapes.batch, shapes.max_len, dtype=np.int32)
        elif tensors.is_device_array(seq_lens):
            # Read back here (decode() plans on every call anyway), so that the lengths are checked
            # against this batch and cache like host ones, and the plan keeps its own copy rather
            # than the caller's array. Read on the launch stream: the lengths, like q, k and v,
            # must be ready there.
            with streams.use_stream(launch_stream):
                seq_lens = _read_back_lengths(seq_lens, shapes.batch, qi.device, "q is on")
        seq_lens = tensors.check_seq_lens(seq_lens, shapes.batch, None if paging else shapes.max_len)
        if shapes.batch == 0:  # nothing to attend: the empty results, checked like any others
            return _empty_results(q, qi, ki, vi, out, return_lse, kv_layout if paging else None)
        # One instance (so one workspace) per device and stream: kernels that may overlap on the
        # GPU never share partials, counters or lengths; calls on one stream run in order, and
        # the lock keeps each call's plan and run together on the host.
        # The per-thread default stream has one handle in every thread, but is a stream per thread.
        thread = threading.get_ident() if launch_stream == streams.PER_THREAD_DEFAULT else None
        page_size = shapes.page_size if paging else None
        key = (device, launch_stream, thread, shapes.num_qo_heads, shapes.num_kv_heads, shapes.head_dim,
               shapes.q_dtype, shapes.kv_dtype, sm_scale, page_size, kv_layout if paging else "NHD")
        with _instances_lock:
            attn = _instances.get(key)
            if attn is None:
                attn = DecodeAttention(shapes.num_qo_heads, shapes.num_kv_heads, shapes.head_dim,
                                       q_dtype=shapes.q_dtype, kv_dtype=shapes.kv_dtype, sm_scale=sm_scale,
                                       device=device, page_size=page_size, kv_layout=key[-1])
                _instances[key] = attn
                while len(_instances) > _MAX_INSTANCES:
                    # Its kernels may still run: its workspace goes back to CuPy's pool, which hands
                    # a block out again only to work on the same stream (plan and run share it
                    # here), so after those kernels.
                    _instances.popitem(last=False)
            _instances.move_to_end(key)
            attn.plan(seq_lens, block_table=block_table, validate=validate, stream=launch_stream)
            return attn.run(q, k, v, out=out, return_lse=return_lse, stream=launch_stream)


# ---- helpers -----------------------------------------------------------------------------------
#: CUDA's limit on a launch grid's y and z extents (K/V heads and sequences here).
_MAX_GRID_YZ = 65535


@functools.lru_cache(maxsize=None)
def gpu_name(device: int) -> str:
    """The driver's name of a device ('NVIDIA H200'): the tuned table it looks for."""
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _checked_sm_scale(sm_scale) -> float | None:
    """None, or ``sm_scale`` as a positive finite float; TypeError / ValueError naming it otherwise."""
    if sm_scale is None:
        return None
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale: expected None or a positive finite float, got {sm_scale!r}")
    value = float(sm_scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"sm_scale: expected a positive finite float, got {sm_scale!r}")
    float32 = np.finfo(np.float32)  # the programs get value x log2(e) as a float32
    if not float(float32.tiny) <= value * _LOG2E <= float(float32.max):
        raise ValueError(f"sm_scale: {sm_scale!r} x log2(e) is outside the normal float32 range the programs take")
    return value


def _check_device(name: str, info: tensors.TensorInfo, device: int | None, owner: str) -> None:
    """ValueError naming ``name`` when it is on another device than ``device`` (None: unknown)."""
    if info.device is not None and device is not None and info.device != device:
        raise ValueError(f"{name}: on CUDA device {info.device}, but {owner} device {device}")


def _read_back_lengths(seq_lens, batch: int | None, device: int | None, owner: str) -> np.ndarray:
    """Device lengths (int32, contiguous, ``batch`` of them; None: any 1-D count) on ``device``,
    read back to the host; their values are checked by the caller."""
    info = tensors.describe(seq_lens, "seq_lens")
    count = batch if batch is not None else (info.shape[0] if info.ndim == 1 else -1)
    tensors.check_seq_lens(info, count, 0)  # type, shape and strides only: the values are still on the device
    _check_device("seq_lens", info, device, owner)
    return tensors.to_cupy(seq_lens).get()


def _empty_results(q, qi, ki, vi, out, return_lse, kv_layout):
    """decode() of an empty batch: out (given or new) and lse of batch 0, validated as usual."""
    if out is None:
        out = _new_output(q)
    tensors.check_decode_inputs(qi, ki, vi, out=tensors.describe(out, "out", bf16_from_uint16=True), kv_layout=kv_layout)
    return (out, _new_output(q, lse=True)) if return_lse else out


def _layout(x):
    """What validation depends on, read cheaply from CuPy arrays and torch tensors (None otherwise:
    such inputs are validated on every call)."""
    if x is None:
        return ()
    if isinstance(x, QuantizedKV):  # its parts' layouts, and its format
        parts = tuple(_layout(a) for a in (x.values, x.block_scales, x.scale))
        return None if None in parts else (x.kv_dtype, *parts)
    module = type(x).__module__
    if module.startswith("torch"):
        return ("torch", x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() % _ALIGN)
    if module.startswith("cupy"):
        return ("cupy", x.shape, x.strides, x.dtype, x.device.id, x.data.ptr % _ALIGN)
    return None


def _kv_shape(k) -> tuple:
    """k's shape (a quantized cache's values'), for arrays without a .shape attribute too."""
    if isinstance(k, QuantizedKV):
        k = k.values
    shape = getattr(k, "shape", None)
    return tuple(int(n) for n in (shape if shape is not None else tensors.describe(k, "k").shape))


#: Compiled programs `DecodeAttention._load` keeps per instance before starting afresh.
_MAX_LOADED = 32


def _same_spec(held, spec) -> bool:
    """Whether what was derived from spec ``held`` serves ``spec``: the same object, or an equal one
    (comparing two specs field by field costs about a µs, so identity is tried first)."""
    return held is spec or held == spec


def _pointers(arrays) -> tuple:
    """The device pointers of plan-owned CuPy arrays as launch arguments (0 for None)."""
    return tuple(np.uint64(a.data.ptr if a is not None else 0) for a in arrays)


_NAMES = ("q", "k", "v", "out", "lse")
#: (written, other) pairs of run()'s arrays, by their index in _NAMES, that must share no byte.
_APART = ((3, 0), (3, 1), (3, 2), (3, 4), (4, 0), (4, 1), (4, 2))


def _check_outputs_apart(pointers: tuple, extents: tuple) -> None:
    """out and lse share no byte with q, k, v or each other: the programs write them while other
    CTAs still read the inputs. ValueError naming the two otherwise."""
    for i, j in _APART:
        overlap = pointers[i] < pointers[j] + extents[j] and pointers[j] < pointers[i] + extents[i]
        if extents[i] and extents[j] and overlap:
            raise ValueError(f"{_NAMES[i]}: overlaps {_NAMES[j]} in memory; the results must go to a buffer of "
                             f"their own")


def _data_ptr(x) -> int:
    if x is None:
        return 0
    if isinstance(x, QuantizedKV):  # its values
        return _data_ptr(x.values)
    module = type(x).__module__
    if module.startswith("torch"):
        return x.data_ptr()
    if module.startswith("cupy"):
        return x.data.ptr
    return tensors.describe(x, "array").ptr


def _quantized_args(k, v) -> tuple:
    """The decode program's last arguments: K's and V's float32 scales (pointer, and 1 when there is
    one per K/V head), then their NVFP4 block scales; zeros for 16-bit K/V."""
    if not isinstance(k, QuantizedKV):
        return (np.uint64(0), np.int32(0), np.uint64(0), np.int32(0), np.uint64(0), np.uint64(0))

    def per_head(scale):
        shape = getattr(scale, "shape", None)
        return np.int32((shape[0] if shape is not None else tensors.describe(scale, "scale").shape[0]) > 1)
    return (np.uint64(_data_ptr(k.scale)), per_head(k.scale), np.uint64(_data_ptr(v.scale)), per_head(v.scale),
            np.uint64(_data_ptr(k.block_scales)), np.uint64(_data_ptr(v.block_scales)))


def _new_output(q, *, lse: bool = False, stream: int | None = None):
    """An uninitialised out [B, Hq, D] in q's dtype (or lse [B, Hq] in float32) on q's device:
    from torch's allocator for torch tensors (on ``stream`` when it is not torch's current one),
    else from CuPy's, on CuPy's current stream (a CuPy q's own dtype; for other arrays bf16 as
    uint16, CuPy's carrier)."""
    if type(q).__module__.startswith("torch"):
        import torch

        shape, dtype = (q.shape[:2], torch.float32) if lse else (q.shape, q.dtype)
        if stream is None or stream == torch.cuda.current_stream(q.device).cuda_stream:
            return torch.empty(shape, dtype=dtype, device=q.device)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=q.device)):
            return torch.empty(shape, dtype=dtype, device=q.device)
    import cupy

    info = tensors.describe(q, "q", bf16_from_uint16=True)
    if lse:
        dtype = cupy.float32
    elif type(q).__module__.startswith("cupy"):
        dtype = q.dtype  # uint16, float16, or ml_dtypes' bfloat16: whatever the caller keeps bf16 in
    else:
        dtype = _CUPY_CARRIERS.get(info.dtype, cupy.float16)  # a bad q fails validation
    with cupy.cuda.Device(info.device if info.device is not None else cupy.cuda.Device().id):
        return cupy.empty(info.shape[:2] if lse else info.shape, dtype=dtype)


_CUPY_CARRIERS = {"bf16": np.uint16, "fp16": np.float16}
