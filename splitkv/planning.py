"""The planning policy: which plan and which program a batch of lengths launches.

`choose_plan` is a pure function of the lengths, the programs (`Programs`) and what the GPU holds
of them (`GpuFacts`): no device, no allocation, the same answer for the same arguments.
`DecodeAttention.plan` gathers the facts from the programs it compiled or loaded, calls it, and
writes the buffers and tables the chosen plan reads; the tuner measures what it chooses.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .heuristics import takes_whole_row_clusters
from .plan import (SplitPlan, batch_invariant_plan, dense_regardless, describe, fit_clusters, fixed_plan,
                   pack_heads, plan_splits_unchecked, wants_packed_heads, whole_row_ctas)
from .spec import KernelSpec
from .work_units import (PRIOR_COSTS, ROUTE_FACTOR, CostModel, UnitPlan, choose_kv_splits,
                         may_route_to_units_unchecked, predicted_makespan, split_plan_makespan)


@dataclasses.dataclass(frozen=True)
class GpuFacts:
    """What the GPU holds of the programs a plan may launch.

    ``ctas_per_sm``: resident CTAs per SM of the split program (of the units program for
    ``variant='units'``, whose slots it counts). ``saturating_ctas`` and ``few_splits_max_bytes``:
    the short-row rule's terms (`heuristics.saturating_ctas`, None: no rule; and
    `heuristics.few_splits_max_bytes`). ``resident_clusters``: cluster size -> clusters of split
    CTAs resident at once (None: unknown); asked only for the cluster sizes a split plan tries,
    so a caller may answer it lazily (it is expected to answer the same for the same size)."""

    num_sms: int
    ctas_per_sm: int
    saturating_ctas: int | None = None
    few_splits_max_bytes: int = 0
    resident_clusters: Callable[[int], int | None] = lambda cluster: None


@dataclasses.dataclass(frozen=True)
class Programs:
    """The programs a plan chooses among, and what the tuned table says of them.

    ``split`` and ``dense``: the split and dense programs (of the tuned entry, when one serves).
    ``tuned``: that entry (`autotune.table.TunedEntry`, None: no tuned table), read for its
    ``planner`` and ``spec``. ``tuned_forces_dense``: the table's verdict that these rows run its
    dense program (`autotune.lookup.programs_for`). ``unit_costs``: the cost model units plans are
    made with (None: the priors). ``packed_dense``, ``units`` and ``in_clusters``: callables
    making the dense program with a warp per K/V head, the units program and the split program in
    clusters of a size, where the caller keeps them (None: derived here); called only for the
    program chosen. ``whole_row_clusters``: `heuristics.takes_whole_row_clusters` of
    ``split`` (None: derived here)."""

    split: KernelSpec
    dense: KernelSpec
    tuned: object | None = None
    tuned_forces_dense: bool = False
    unit_costs: CostModel | None = None
    packed_dense: Callable[[], KernelSpec] | None = None
    units: Callable[[], KernelSpec] | None = None
    in_clusters: Callable[[int], KernelSpec] | None = None
    whole_row_clusters: bool | None = None

    @property
    def unit_block(self) -> int:
        """Units start on blocks: whole chunks (so a unit's tiles fall evenly on the warps), whole pages."""
        return max(self.split.chunk_size, self.split.page_size)


@dataclasses.dataclass(frozen=True)
class PlanChoice:
    """A plan and how it launches: ``spec`` the decode program (the units program for a
    `UnitPlan`), ``merge`` whether the merge program runs after it (a units plan's own merge
    program where rows are split; a plan with a fixed number of units merges always, which is
    the runtime's to add)."""

    plan: SplitPlan | UnitPlan
    spec: KernelSpec
    merge: bool


def choose_plan(lengths, max_len: int, num_kv_heads: int, programs: Programs, gpu: GpuFacts, *,
                may_grow: bool = False, variant: str | None = None, num_splits: int | None = None,
                warp_heads: bool | None = None, allow_units: bool = True, batch_invariant: bool = False) -> PlanChoice:
    """The plan of ``lengths`` (checked int64 lengths the plan covers, the longest ``max_len``)
    and its program.

    ``may_grow``: device lengths may grow up to ``max_len`` after the plan (a units plan cannot
    cover them, so none is made). ``variant`` (and ``num_splits`` for 'split') override the
    planner's choice; ``warp_heads`` True or False whether a dense plan's warps get a K/V head
    each (None: `plan.wants_packed_heads`). ``allow_units``: whether the units program may serve
    these rows (not with a window or several row blocks per K/V head). ``batch_invariant``: the
    split program without clusters over `plan.batch_invariant_plan` (each sequence's splits from its
    own length; the merge sums them in split order), whatever the batch.

    The policy, for ``variant=None``: a tuned dense program that the table says these rows run
    makes the plan dense; else the wave model (`plan.plan_splits_unchecked`) and the short-row
    rule (`short_row_plan`) plan the splits, and a ragged batch the work-unit cost model predicts
    `ROUTE_FACTOR` times faster goes to units (`units_pay`). A split plan then takes the largest
    cluster that fits (`plan.fit_clusters`)."""
    chunk = programs.split.chunk_size
    if batch_invariant:
        plan = batch_invariant_plan(lengths, num_kv_heads, chunk_size=chunk)
        spec = programs.in_clusters(1) if programs.in_clusters else programs.split.replace(cluster=1)
        return PlanChoice(plan, spec, not spec.fused_merge)
    if variant == "units":
        check_units_request(max_len, may_grow=may_grow, num_splits=num_splits, warp_heads=warp_heads)
        units = unit_plan(lengths, num_kv_heads, programs, gpu.num_sms * gpu.ctas_per_sm, programs.unit_costs)
        return _units_choice(units, programs)
    if variant is None:
        if programs.tuned_forces_dense:
            wave = plan = fixed_plan(lengths, num_kv_heads, variant="dense", chunk_size=chunk)
        else:
            wave = plan_splits_unchecked(lengths, max_len, num_kv_heads, chunk, gpu.num_sms, gpu.ctas_per_sm)
            plan = short_row_plan(wave, lengths, max_len, num_kv_heads, programs, gpu)
        # The units' cost model counts tokens per CTA on every resident CTA, as the wave model
        # does: the routing judges the wave model's plan in those terms, and the short-row
        # rule's where it differs (fewer, longer splits may leave a long row to few CTAs among
        # short rows).
        routable = allow_units and not may_grow
        units = units_pay(wave, lengths, max_len, num_kv_heads, programs, gpu) if routable else None
        if units is None and plan is not wave and plan != wave and routable:  # `is`: the common case
            units = units_pay(plan, lengths, max_len, num_kv_heads, programs, gpu)
        if units is not None:
            return _units_choice(units, programs)
    else:
        plan = fixed_plan(lengths, num_kv_heads, variant=variant, chunk_size=chunk, num_splits=num_splits)
    dense = programs.dense
    if warp_heads is None:
        # A warpgroup program's warps share their rows: a warp per K/V head would give each its own
        # ring (four times the shared memory), so it is packed only when asked for.
        warp_heads = dense.mma_m != "warpgroup" and wants_packed_heads(plan, num_kv_heads, warps=dense.warps,
                                                                       num_sms=gpu.num_sms)
    if warp_heads:
        plan = pack_heads(plan, num_kv_heads, warps=dense.warps)
    if plan.heads_per_cta > 1:
        spec = programs.packed_dense() if programs.packed_dense else dense.as_warp_heads()
    else:
        spec = dense
    if plan.variant == "split":
        split = programs.split
        whole_rows = programs.whole_row_clusters
        if whole_rows is None:
            whole_rows = takes_whole_row_clusters(split)
        plan, cluster = fit_clusters(plan, lengths, num_kv_heads, chunk_size=chunk, max_cluster=split.cluster,
                                     resident_clusters=gpu.resident_clusters,
                                     kv_bytes_per_token=split.kv_bytes_per_token,
                                     may_resplit=variant is None, multi_cluster=split.fused_merge,
                                     whole_row_ctas=whole_row_ctas(gpu.num_sms) if whole_rows else None)
        spec = programs.in_clusters(cluster) if programs.in_clusters else split.replace(cluster=cluster)
    if spec.cluster > 1 and plan.num_splits != spec.cluster and not spec.fused_merge:
        # Several clusters per row leave one partial per cluster, which only the fused merge reads.
        raise RuntimeError(f"planner bug: {plan.num_splits} splits in clusters of {spec.cluster} "
                           f"without the fused merge; {describe(plan)}")
    if plan.variant == "split" and plan.tokens_per_split % spec.tile_tokens:  # tiles start at split starts
        raise RuntimeError(f"planner bug: {plan.tokens_per_split} tokens per split is not a multiple of "
                           f"the tile ({spec.tile_tokens} tokens); {describe(plan)}")
    # A cluster merges in place, the fused merge in the program: else the merge program runs.
    merge = plan.variant == "split" and not spec.fused_merge and spec.cluster == 1
    return PlanChoice(plan, spec, merge)


def check_units_request(max_len: int, *, may_grow: bool, num_splits: int | None, warp_heads: bool | None) -> None:
    """Refuse what a ``variant='units'`` plan cannot honour (before its program is loaded)."""
    if num_splits is not None or warp_heads:
        raise ValueError("variant: 'units' plans take neither num_splits nor warp_heads")
    if may_grow:
        # A unit covers the blocks of its row's length at plan time: lengths that grow
        # after it would leave their new tokens to no unit.
        raise ValueError(f"max_len: a 'units' plan covers the lengths it is planned for, so device "
                         f"lengths may not grow up to max_len={int(max_len)} after it; plan() again "
                         f"for each step's lengths (with max_units, a captured graph replays the "
                         f"tables rewritten in place)")


def short_row_plan(wave: SplitPlan, lengths, max_len: int, num_kv_heads: int, programs: Programs,
                   gpu: GpuFacts) -> SplitPlan:
    """The short-row rule's plan of these lengths (`plan_splits` with the saturating CTAs), or the
    wave model's ``wave`` where the rule does not apply: no saturating count (NVFP4, several query
    tokens on 16-row MMAs: `heuristics.saturating_ctas`), a tuned
    program measured without the rule (its entry's `planner`: a tuned program launches what the
    tuner measured), or rows that run dense under either rule."""
    split, tuned = programs.split, programs.tuned
    measured_by_waves = tuned is not None and tuned.planner == "waves" and tuned.spec == split
    if gpu.saturating_ctas is None or measured_by_waves or dense_regardless(
            lengths.size * num_kv_heads, max_len,
            chunk_size=split.chunk_size, num_sms=gpu.num_sms, ctas_per_sm=gpu.ctas_per_sm):
        return wave
    return plan_splits_unchecked(lengths, max_len, num_kv_heads, split.chunk_size, gpu.num_sms, gpu.ctas_per_sm,
                                 saturating_ctas=gpu.saturating_ctas, kv_bytes_per_token=split.kv_bytes_per_token,
                                 max_split_bytes=gpu.few_splits_max_bytes)


def units_pay(plan: SplitPlan, lengths, max_len: int, num_kv_heads: int, programs: Programs,
              gpu: GpuFacts) -> UnitPlan | None:
    """The work-unit plan of these lengths when the cost model predicts it `ROUTE_FACTOR` times
    faster than the split planner's ``plan``."""
    if plan.heads_per_cta > 1:
        return None
    slots = gpu.num_sms * gpu.ctas_per_sm
    per_split = plan.tokens_per_split if plan.variant == "split" else max(max_len, 1)
    # The routing compares the two plans under the priors (ROUTE_FACTOR was measured with them);
    # the units plan it routes to is made with the programs' costs.
    if not may_route_to_units_unchecked(lengths, max_len, num_kv_heads, per_split, slots):  # in O(batch)
        return None
    costs = programs.unit_costs
    units = unit_plan(lengths, num_kv_heads, programs, slots, costs)
    routed = units if costs in (None, PRIOR_COSTS) else unit_plan(lengths, num_kv_heads, programs, slots, None)
    split_cost = split_plan_makespan(lengths, num_kv_heads, per_split, slots)
    return units if split_cost > ROUTE_FACTOR * predicted_makespan(routed, lengths) else None


def unit_plan(lengths, num_kv_heads: int, programs: Programs, slots: int, costs: CostModel | None) -> UnitPlan:
    """The work-unit planner's tables for these lengths on ``slots`` slots (``costs`` None: the priors)."""
    return choose_kv_splits(lengths, num_kv_heads, block_size=programs.unit_block, slots=slots, costs=costs)


def _units_choice(units: UnitPlan, programs: Programs) -> PlanChoice:
    return PlanChoice(units, programs.units() if programs.units else programs.split.as_units(), bool(units.split))
