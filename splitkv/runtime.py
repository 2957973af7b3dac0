"""DecodeAttention: validate, choose the programs, plan, launch.

``plan()`` does everything that may synchronise, allocate or compile: it reads the lengths, picks
dense or split and the cluster size, compiles (or loads from the cache) the programs and sizes the
workspace. The workspace is reused by later plans, so a CUDA graph captured after one plan must be
captured again after the next.
``run()`` only reads array metadata and enqueues one or two kernels on the caller's stream (with
an event after them, and a wait before them when the previous plan or run used another stream),
so it can be captured in a CUDA graph and replayed; what it launches is fixed by the plan
(`splitkv.launch`). The one-shot `decode()` lives in `splitkv.oneshot`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import threading

import numpy as np

from . import arrays, gpu, instance, planning, streams, tensors, variants
from .choices import WARP_ROWS
from .heuristics import resident_ctas_per_sm, takes_whole_row_clusters
from .launch import MERGE_THREADS, Arguments, Heads, Launch, UnitTables, check_outputs_apart, read_array, read_arrays
from .plan import SplitPlan
from .program_cache import ProgramCache, same_spec
from .spec import KernelSpec, MergeSpec
from .tensor_map import TensorMapCache
from .tuned import lookup
from .tuned.keys import TuneKey
from .workspace import Workspace, check_table
from .work_units import BUFFER_HEADER, MERGE_FIELDS, UNIT_FIELDS, CostModel, UnitPlan

_LOG2E = 1.4426950408889634


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

    ``page_size`` (None: contiguous caches, ``kv_layout`` 'NHD' ``[B, L, Hkv, D]`` or 'HND' ``[B, Hkv,
    L, D]``, as transformers' caches hold them; either may be a view ``cache[:, :L]`` / ``cache[:, :,
    :L]`` of a longer cache, read in place): run() reads paged caches of pages of that many tokens,
    ``kv_layout`` 'NHD' ``[num_pages, page_size, Hkv, D]`` or 'HND' ``[num_pages, Hkv, page_size,
    D]``, through the ``block_table`` given to plan().

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

        num_qo_heads, num_kv_heads, head_dim, sm_scale = instance.check_arguments(
            num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, sm_scale, page_size, kv_layout, device)
        self.page_size, self.kv_layout = int(page_size or 0), kv_layout
        paging = dict(page_size=self.page_size, kv_layout=kv_layout)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.group_size = num_qo_heads // num_kv_heads
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
        try:
            device = cupy.cuda.Device(device)  # None: CuPy's current device
            self.device = device.id
            self.arch = "sm_" + device.compute_capability
            self.num_sms = device.attributes["MultiProcessorCount"]
        except cupy.cuda.runtime.CUDARuntimeError:
            gpu.require_gpu(None if device is None else int(device))  # says what is missing
            raise
        layout = (head_dim, self.group_size, q_dtype, kv_dtype)
        self.split_spec, self.dense_spec = instance.starting_programs(self.arch, layout, paging, spec, dense_spec)
        self._whole_row_clusters = takes_whole_row_clusters(self.split_spec)
        self._own_programs = (self.split_spec, self.dense_spec)  # batch-invariant plans launch these
        if not isinstance(tuned, bool):
            raise TypeError(f"tuned: expected True or False, got {tuned!r}")
        self._tuned = None
        self._tuned_allowed = spec is None and dense_spec is None  # the built-in or tuned programs
        self._key = TuneKey(head_dim, self.group_size, q_dtype, kv_dtype, self.page_size, kv_layout)
        if tuned and self._tuned_allowed:
            self._tuned = lookup.find(self.arch, gpu_name(self.device), self._key)
        # Query tokens per sequence -> the tuned choices of that key (None: the built-in programs
        # of that many tokens); looked up at the first plan of each count.
        self._tuned_by_tokens = {1: self._tuned}
        self._tables_searched = tuned and self._tuned_allowed
        self._programs_tokens = 1  # the query tokens split_spec and dense_spec were chosen for
        self.tuned_source = self._tuned.source if self._tuned else None
        self.tuned_entry = None
        if unit_costs is not None and not isinstance(unit_costs, CostModel):
            raise TypeError(f"unit_costs: expected a splitkv.work_units.CostModel or None, got {unit_costs!r}")
        self.unit_costs, self.unit_costs_source = unit_costs, None
        if unit_costs is None and tuned:
            found = lookup.unit_costs(self.arch, gpu_name(self.device))
            if found is not None:
                self.unit_costs, self.unit_costs_source = found[0].costs, found[1]
        self._heads = Heads(num_qo_heads, num_kv_heads, self.sm_scale * _LOG2E, self.page_size, kv_layout)
        self.merge_spec = MergeSpec(arch=self.arch, head_dim=head_dim, out_dtype=q_dtype, threads=MERGE_THREADS)
        self._launch: Launch | None = None
        # The run() arrays' layout validated last: (layout, DecodeShapes, bytes each array spans,
        # the launch they were checked against). One tuple, so that threads see it whole.
        self._validated: tuple = (None, None, (), None)
        self._cuda = cupy.cuda.runtime  # its getDevice: run()'s check that no device switch is needed
        self._arguments: dict[int, Arguments] = {}  # thread id -> that thread's launch structs
        self._programs = ProgramCache(self.device)  # loaded programs, and the specs derived from them
        self._unit_merge_spec = dataclasses.replace(self.merge_spec, tables=True)  # units plans' merge program
        self._tensor_maps = TensorMapCache()  # kv_copy='tma': the caches' maps, encoded once each
        self._order = streams.StreamOrder()  # plan() and run() in call order across streams
        self._workspace = Workspace(self._order)
        self._producer_events: dict[int, object] = {}  # streams named by inputs' interfaces
        self._sinks_checked = None  # the layout of the last sinks array run() checked

    # ---- planning (may sync, allocate, compile) ------------------------------------------------
    def plan(self, seq_lens, max_len: int | None = None, *, block_table=None, validate: bool = True,
             variant: str | None = None, num_splits: int | None = None, warp_heads: bool | None = None,
             max_units: int | None = None, stream=None, query_tokens: int = 1, window_left: int = -1,
             logits_soft_cap: float = 0.0, sinks: bool = False, deterministic: bool = False) -> SplitPlan | UnitPlan:
        """Choose dense or split for these lengths, compile what that needs, size the workspace.

        The attention variant (`splitkv.variants` states each exactly): ``query_tokens`` T query
        tokens per sequence (q ``[B, T, Hq, D]``, causal among them; ``seq_lens`` counts the T new
        tokens), a sliding window of ``window_left`` tokens before each query's own (-1: none; only
        the window's tokens are read, and the planner splits only them), a ``logits_soft_cap`` (0:
        none), ``sinks`` (True: run() takes the sinks' float32 ``[Hq]`` array). Each is compiled into
        the programs of this plan alone.

        ``deterministic=True``: batch-invariant results: a sequence's output (and lse) is the same
        bits whatever else is in the batch and wherever it stands in it. One program (the instance's
        own split program, never a tuned table's, which chooses by workload), no clusters, every
        sequence split by its own length (`plan.batch_invariant_plan`), the splits merged in order.
        It takes none of ``variant``, ``num_splits``, ``warp_heads``, ``max_units``.

        ``seq_lens``: host ints or a device int32 array (read back once here). ``max_len``, when
        given, bounds the lengths; for a device ``seq_lens`` the plan also covers it, so lengths
        rewritten in place may grow up to it between CUDA-graph replays (such a plan is never a
        units plan, whose units cover the planned lengths only). A plan() that raises leaves the
        previous plan, and every buffer it reads, as it was. ``variant`` (and
        ``num_splits`` for 'split'; other variants ignore it) override the planner's choice, for
        tests, benchmarks and tuning;
        ``warp_heads`` True or False overrides whether a dense plan's warps get a K/V head each
        (None: the planner's choice, ``plan.wants_packed_heads``, which applies to a dense plan
        asked for through ``variant`` too; never for a warpgroup dense program, whose warps share
        their rows).
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
        deterministic = tensors.check_flag(deterministic, "deterministic")
        if deterministic and (variant, num_splits, warp_heads, max_units) != (None, None, None, None):
            raise ValueError("deterministic: a batch-invariant plan takes none of variant, num_splits, warp_heads "
                             "and max_units (it fixes them)")
        attention = variants.plan_variant(query_tokens, window_left, logits_soft_cap, sinks)
        with self._in_call_order(seq_lens if on_device else None, stream):
            return self._plan(seq_lens, on_device, max_len, variant, num_splits, warp_heads, block_table, validate,
                              max_units, attention=attention, deterministic=deterministic)

    @contextlib.contextmanager
    def _in_call_order(self, like, stream):
        """For one plan() or run(): this instance's device current, and the call's stream (``stream``,
        else that of ``like``, see ``arrays.stream_ptr``) current and ordered after the previous
        plan or run when that used another stream; yields the stream's handle."""
        with streams.on_device(self.device):  # CuPy's current stream is the device's own
            ptr = arrays.stream_ptr(like, stream)
            with streams.use_stream(ptr):
                capturing = self._order.enter(ptr)
                yield ptr
                self._order.leave(ptr, capturing)

    def _plan_checked(self, lens: np.ndarray, *, block_table, validate: bool, stream: int,
                      attention: variants.AttentionVariant = variants.PLAIN,
                      deterministic: bool = False) -> SplitPlan | UnitPlan:
        """plan() of host lengths checked already (`tensors.check_seq_lens`: int32, 1-D): decode()'s,
        which checks them against its cache itself."""
        if lens.size == 0:
            raise ValueError(f"seq_lens: expected a non-empty 1-D sequence of lengths, got shape {lens.shape}")
        with self._in_call_order(None, stream):
            return self._plan(lens, False, None, None, None, None, block_table, validate, None, checked=True,
                              attention=attention, deterministic=deterministic)

    def _plan(self, seq_lens, on_device, max_len, variant, num_splits, warp_heads, block_table, validate, max_units,
              checked: bool = False, attention: variants.AttentionVariant = variants.PLAIN,
              deterministic: bool = False):
        """plan(); ``on_device``: whether ``seq_lens`` is a device array; ``checked``: whether they
        are host lengths checked already; ``attention``: the plan's attention variant."""
        if warp_heads is not None and not isinstance(warp_heads, bool):
            raise TypeError(f"warp_heads: expected None, True or False, got {warp_heads!r}")
        if not isinstance(validate, bool):
            raise TypeError(f"validate: expected True or False, got {validate!r}")
        if (block_table is None) != (self.page_size == 0):
            raise ValueError("block_table: paged caches need one (and only they take one); this instance reads "
                             + (f"pages of {self.page_size} tokens" if self.page_size else
                                "contiguous caches (build it with page_size=... for paged ones)"))
        lens = seq_lens if checked else tensors.plan_lengths(seq_lens, max_len, on_device, self.device)
        batch = lens.size
        attention.check_plan(lens, warp_heads)
        host_lens = lens  # what the plan covers
        if on_device and max_len is not None and int(max_len) > int(lens.max()):
            # The caller may rewrite these lengths in place up to max_len before a (graph) replay:
            # plan for the longest one allowed. Host lengths are copied here and cannot grow.
            host_lens = lens.copy()
            host_lens[int(np.argmax(host_lens))] = int(max_len)
        max_planned = int(host_lens.max(initial=0))  # the longest sequence the plan covers
        # The tuned entry nearest this workload chooses the programs (and may make the plan dense);
        # a batch-invariant plan keeps the instance's own, whatever the workload.
        tuned_forces_dense = False
        if deterministic:
            self._keep_own_programs()
        elif self._tuned_allowed and (self._tuned is not None or attention.query_tokens != self._programs_tokens):
            # Looked up by the tokens the programs stream: with a window, the window's, however long
            # the sequence (a 4k window over 64k tokens is a 4k workload).
            attended = int(attention.planned_lengths(np.array([max_planned]), 1)[0])
            tuned_forces_dense = self._use_tuned(attention.query_tokens, batch * self.num_kv_heads, attended)
        may_grow = host_lens is not lens
        if variant != "units" and max_units is not None:
            raise ValueError("max_units: sizes the tables of variant='units' plans only")
        # The programs with the plan's attention variant compiled in (the same objects where they
        # have it), and the rows the planner sees: a K/V head's row blocks each (several CTAs share
        # a head whose query heads x tokens exceed one CTA's row slices), over the tokens the
        # programs stream (with a window, the window's).
        split_spec = self._programs.with_variant("split", self.split_spec, attention)
        dense_spec = self._programs.with_variant("dense", self.dense_spec, attention)
        row_heads = self.num_kv_heads * split_spec.row_blocks
        units_allowed = attention.window_left < 0 and split_spec.rows_fit_units
        if variant == "units" and not units_allowed:
            raise ValueError("variant: 'units' plans serve neither a window nor more rows (query heads x query "
                             f"tokens) per K/V head than one CTA holds ({WARP_ROWS} x warps={split_spec.warps}); this "
                             f"plan has window_left={attention.window_left} and {split_spec.rows} rows")
        # The planners' lengths, checked already: int64, which they take as they are (see
        # plan.plan_splits_unchecked), converted once here.
        planned = attention.planned_lengths(host_lens.astype(np.int64), split_spec.tile_tokens)
        streamed = int(planned.max(initial=0))
        if variant == "units":  # the units program's slots; the split program is not loaded for it
            planning.check_units_request(max_planned, may_grow=may_grow, num_splits=num_splits, warp_heads=warp_heads)
            units_spec = self._programs.with_variant("units", self._units_spec(), attention)
            _, compiled = self._programs.load(units_spec)
            gpu = planning.GpuFacts(self.num_sms, resident_ctas_per_sm(units_spec, compiled.registers))
            in_clusters = None
        else:
            program = self._programs.split_program(split_spec)
            gpu = planning.GpuFacts(self.num_sms, program.ctas_per_sm, program.saturating,
                                    program.few_splits_max_bytes, self._max_active_clusters)
            in_clusters = program.in_clusters
        programs = planning.Programs(split_spec, dense_spec, self.tuned_entry, tuned_forces_dense,
                                     self.unit_costs, lambda: self._programs.with_variant("packed", self._packed_dense_spec(), attention),
                                     lambda: self._programs.with_variant("units", self._units_spec(), attention), in_clusters,
                                     self._whole_row_clusters)
        choice = planning.choose_plan(planned, streamed, row_heads, programs, gpu, may_grow=may_grow,
                                      variant=variant, num_splits=num_splits,
                                      warp_heads=False if attention.query_tokens > 1 else warp_heads,
                                      allow_units=units_allowed, batch_invariant=deterministic)
        plan, spec = choice.plan, choice.spec
        if isinstance(plan, UnitPlan):
            return self._plan_units(seq_lens, on_device, lens, host_lens, block_table, validate, max_units, plan,
                                    spec, attention)
        # Everything that may raise comes before the first write to a buffer the live plan uses.
        checked_table = check_table(block_table, lens, host_lens, validate, self.page_size, self.device) if self.page_size else None
        decode_fn, _ = self._programs.load(spec)
        merge_fn = self._programs.load(self.merge_spec)[0] if choice.merge else None
        # The launched program's row blocks: a dense program may hold a K/V head's rows in fewer (or
        # more) CTAs than the split program the planner counted with.
        row_heads = self.num_kv_heads * spec.row_blocks
        grid = (plan.num_splits, row_heads // plan.heads_per_cta, batch)
        if max(grid[1], grid[2]) > _MAX_GRID_YZ:
            raise ValueError(f"seq_lens: a batch of {batch} sequences x {self.num_kv_heads} K/V heads exceeds the "
                             f"launch grid ({_MAX_GRID_YZ} sequences and K/V heads at most); split the batch")
        partial_o = partial_lse = counters = None
        if plan.variant == "split":
            rows = batch * plan.num_splits * row_heads * spec.cta_rows
            partial_o = self._workspace.buffer("partial_o", rows * self.head_dim, np.float32)
            partial_lse = self._workspace.buffer("partial_lse", rows, np.float32)
            # Merge counters [batch][K/V heads x row blocks][cluster] (with several clusters per
            # row, each cluster rank merges its slice of the row).
            if spec.fused_merge:
                counters = self._workspace.buffer("counters", batch * row_heads * spec.cluster, np.int32, zero=True)
        table = self._workspace.block_table(checked_table) if self.page_size else None
        device_lens = self._workspace.lengths(seq_lens, on_device, lens)
        workspace = (partial_o, partial_lse, counters)
        self._launch = Launch(plan, spec, self._heads, decode_fn, merge_fn, batch, max_planned, grid, device_lens,
                              workspace, self._workspace.empty_kv_ptr(spec, self.num_kv_heads, max_planned), table,
                              attention=attention)
        return plan

    def _packed_dense_spec(self) -> KernelSpec:
        """The dense program with a warp per K/V head."""
        return self._programs.kept("packed dense", self.dense_spec, KernelSpec.as_warp_heads)

    def _units_spec(self) -> KernelSpec:
        """The units program of the split program's CTA shape (`KernelSpec.as_units`); the split
        program itself is not loaded for it."""
        return self._programs.kept("units", self.split_spec, KernelSpec.as_units)

    def _keep_own_programs(self) -> None:
        """The instance's own programs (its spec, or the built-in heuristic's), as it was built: what
        a batch-invariant plan launches, whichever tuned entry the last plan took."""
        split, dense = self._own_programs
        self._programs_tokens = 1
        if not same_spec(split, self.split_spec):
            self.split_spec = split
            self._whole_row_clusters = takes_whole_row_clusters(split)
        self.dense_spec, self.tuned_entry = dense, None

    def _use_tuned(self, query_tokens: int, rows: int, max_len: int) -> bool:
        """Take the programs of the tuned entry of ``query_tokens`` tokens per sequence nearest this
        workload, or the built-in ones of that many tokens where no table has the key
        (`lookup.programs_for`); True when the plan must be dense."""
        key = self._key.with_query_tokens(query_tokens)
        choices = self._tuned_by_tokens.get(query_tokens, False)
        if choices is False:
            choices = lookup.find(self.arch, gpu_name(self.device), key) if self._tables_searched else None
            self._tuned_by_tokens[query_tokens] = choices
        entry = choices.entry_for(rows, max_len) if choices else None
        split, dense, forced = lookup.programs_for(entry.spec if entry else None, self.arch, key, rows, self.num_sms)
        self._programs_tokens = query_tokens
        if not same_spec(split, self.split_spec):
            self.split_spec = split  # _split_program follows
            self._whole_row_clusters = takes_whole_row_clusters(split)
        self.dense_spec, self.tuned_entry = dense, entry
        return forced

    def _plan_units(self, seq_lens, on_device, lens, host_lens, block_table, validate, max_units,
                    plan: UnitPlan, spec: KernelSpec, attention: variants.AttentionVariant) -> UnitPlan:
        """A units plan's launch: ``plan``'s tables for ``host_lens`` (`planning.choose_plan`), run by
        the units program ``spec``."""
        decode_fn, _ = self._programs.load(spec)
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
            merge_fn, _ = self._programs.load(merge_spec)
            warps = merge_spec.threads // 32
            merge_blocks = -(-max_merges * spec.cta_rows // warps)
        # Everything that may raise comes before the first write to a buffer the live plan uses
        # (with max_units, a captured graph replays the tables written here).
        checked_table = check_table(block_table, lens, host_lens, validate, self.page_size, self.device) if self.page_size else None
        tables = self._workspace.buffer("unit_tables", max_units * len(UNIT_FIELDS) + max_merges * len(MERGE_FIELDS)
                              + len(BUFFER_HEADER), np.int32)
        tables.set(plan.to_buffer(max_units, max_merges))
        # Every unit writes at most one partial: a static plan holds room for as many as it has units.
        slots_held = max_units if static else plan.num_partials
        width = spec.cta_rows * self.head_dim  # a unit's rows: its K/V head's query heads x query tokens
        partial_o = self._workspace.buffer("partial_o", max(slots_held, 1) * width, np.float32)
        partial_lse = self._workspace.buffer("partial_lse", max(slots_held, 1) * spec.cta_rows, np.float32)
        table = self._workspace.block_table(checked_table) if self.page_size else None
        device_lens = self._workspace.lengths(seq_lens, on_device, lens)
        workspace = (partial_o, partial_lse, None)
        units = UnitTables(tables, tables.data.ptr, max_units, merge_blocks)
        max_planned = int(host_lens.max(initial=0))
        self._launch = Launch(plan, spec, self._heads, decode_fn, merge_fn, lens.size, max_planned, (max_units, 1, 1),
                              device_lens, workspace, self._workspace.empty_kv_ptr(spec, self.num_kv_heads, max_planned), table, units,
                              attention=attention)
        return plan

    def _max_active_clusters(self, cluster: int) -> int | None:
        """Clusters of ``cluster`` split CTAs resident at once on this GPU (None: unknown)."""
        return self._programs.max_active_clusters(cluster, self.split_spec)

    # ---- warming up (compiles what later plans need) -------------------------------------------
    def warmup(self, max_len: int, max_batch: int = 1, *, jobs: int | None = None) -> "warmup.WarmupReport":
        """Compile and load every program a plan() of 1 to ``max_batch`` sequences of up to ``max_len``
        tokens may launch (`splitkv.warmup.programs_to_warm`: every variant, cluster size and tuned
        entry of the range), on ``jobs`` threads (None: one per CPU), so that such plans compile
        nothing. Programs in the disk cache are only read (`splitkv-gen --warm` prebuilds one).
        Returns what it did (`warmup.WarmupReport`)."""
        from . import warmup

        key = self._key
        if self._tuned_allowed:
            specs, entries = warmup.programs_to_warm(self.arch, gpu_name(self.device), key, self.num_kv_heads,
                                                     max_batch, max_len, tuned=self._tuned is not None)
        else:  # the instance's own spec / dense_spec
            warmup.check_ranges(max_batch, max_len)
            specs, entries = warmup.programs_of_specs(self.split_spec, self.dense_spec, key), 0

        def load(spec):  # into the loader's cache, which plans' own spec objects then find
            from .codegen.load import load_kernel

            with streams.on_device(self.device):
                load_kernel(spec)
        compiled, seconds = warmup.compile_all(specs, jobs=jobs, load=load)
        return warmup.WarmupReport(len(specs), compiled, round(seconds, 3), entries)

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

    # ---- running (no sync, no allocation when out/lse are given, no compile) -------------------
    def run(self, q, k, v, *, out=None, lse=None, return_lse: bool = False, sinks=None, stream=None):
        """Attention of ``q`` over the planned lengths of ``k`` / ``v``; returns out (and lse).

        ``q``: ``[B, Hq, D]``, or ``[B, T, Hq, D]`` for a plan of T query tokens (out has q's shape,
        lse q's without its last axis). ``sinks``: a plan made with ``sinks=True`` takes the float32
        ``[Hq]`` device array of this layer's sink logits (read at every run, like the caches).

        ``k`` and ``v``: arrays of the instance's kv_dtype, or for a quantized kv_dtype ('fp8_e4m3',
        'nvfp4') `splitkv.QuantizedKV` caches (from `splitkv.quantize_kv`), whose scales are read on
        the device at every run, so they may change between CUDA-graph replays.

        Pass ``out`` (and ``lse``) to make the call allocation-free. Inputs are validated in full
        the first time a layout (kinds, shapes, strides, dtypes, devices) is seen; later calls with
        the same layout only read the data pointers (and the first after a plan() checks the
        layout against the new plan).
        """
        launch = self._launch
        if launch is None:
            raise RuntimeError("run() before plan(): call plan(seq_lens) first")
        if return_lse.__class__ is not bool:  # one comparison on the hot path; the rest checks
            return_lse = tensors.check_flag(return_lse, "return_lse")
        if out is None or (return_lse and lse is None) or self._cuda.getDevice() != self.device:
            return self._run_allocating(launch, q, k, v, out, lse, return_lse, stream, sinks)
        self._enqueue(launch, q, k, v, out, lse, arrays.launch_stream(q, stream, self.device),
                      read_arrays(q, k, v, out, lse), sinks)
        return (out, lse) if return_lse else out

    def _run_read(self, q, k, v, out, stream: int, read: tuple, sinks=None):
        """run() of ``out`` (no lse) on stream handle ``stream``, the arrays read already
        (`read_arrays` of q, k, v, out and None): decode()'s, which read them to describe them."""
        launch = self._launch
        if launch is None or self._cuda.getDevice() != self.device:
            return self.run(q, k, v, out=out, sinks=sinks, stream=stream)
        self._enqueue(launch, q, k, v, out, None, stream, read, sinks)
        return out

    def _run_allocating(self, launch: Launch, q, k, v, out, lse, return_lse: bool, stream, sinks=None):
        """run() with this instance's device made current, and the missing outputs allocated."""
        with streams.on_device(self.device):
            ptr = arrays.launch_stream(q, stream, self.device)
            if out is None or (return_lse and lse is None):
                # On the launch stream: a pool hands the block out again only after this launch.
                with streams.use_stream(ptr):
                    if out is None:
                        out = arrays.new_output(q, stream=ptr)
                    if return_lse and lse is None:
                        lse = arrays.new_output(q, lse=True, stream=ptr)
            self._enqueue(launch, q, k, v, out, lse, ptr, read_arrays(q, k, v, out, lse), sinks)
        return (out, lse) if return_lse else out

    def _enqueue(self, launch: Launch, q, k, v, out, lse, stream: int, read: tuple, sinks=None) -> None:
        """Checks the arrays (in full for a layout not seen before; ``read``: their `read_arrays`)
        and enqueues the plan's programs on ``stream``, ordered after the previous plan or run."""
        layout, pointers, quantized, k_shape = read
        sinks_ptr = 0 if sinks is None and not launch.attention.sinks else self._sinks_pointer(launch, sinks)
        seen, shapes, extents, checked = self._validated
        if layout is None or layout != seen:
            # Arrays known only by their interface are validated on every call, and their
            # producers' streams (the interface's 'stream') waited for.
            producers, shapes, extents = tensors.check_run_inputs(
                (q, k, v, out, lse), self.device, self.kv_layout if self.page_size else None, self.kv_layout)
            launch.check_inputs(shapes)
            for producer in producers:
                streams.wait_for_producer(producer, stream, self._producer_events)
            self._validated = (layout, shapes, extents, launch)
        elif checked is not launch:  # a layout validated before, and a new plan
            launch.check_inputs(shapes)
            self._validated = (layout, shapes, extents, launch)
        check_outputs_apart(pointers, extents)
        args = self._arguments.get(threading.get_ident())
        if args is None:
            args = self._arguments[threading.get_ident()] = Arguments()
        capturing = self._order.enter(stream)
        launch.enqueue(args, stream, pointers, quantized, k_shape, self._tensor_maps, sinks_ptr, shapes.kv_stride)
        self._order.leave(stream, capturing)

    def _sinks_pointer(self, launch: Launch, sinks) -> int:
        """The device address of run()'s ``sinks``, checked in full once per layout (a float32
        ``[Hq]`` array on this device; arrays known only by an interface on every call)."""
        if sinks is None:
            raise ValueError(f"sinks: this plan was made with sinks=True; run() needs the float32 "
                             f"[{self.num_qo_heads}] array of sink logits")
        if not launch.attention.sinks:
            raise ValueError("sinks: this plan was made without sinks; plan(..., sinks=True) compiles them in")
        entry, ptr = read_array(sinks, "sinks")
        if entry is None or entry != self._sinks_checked:
            tensors.check_sinks(tensors.describe(sinks, "sinks"), self.num_qo_heads, self.device)
            self._sinks_checked = entry
        return ptr


# ---- helpers -----------------------------------------------------------------------------------
#: CUDA's limit on a launch grid's y and z extents (K/V heads and sequences here).
_MAX_GRID_YZ = 65535


@functools.lru_cache(maxsize=None)
def gpu_name(device: int) -> str:
    """The driver's name of a device ('NVIDIA H200'): the tuned table it looks for."""
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)
