"""The work-unit planner's costs, tuned per GPU model (`splitkv-gen --tune --unit-costs`).

The work-unit planner (`splitkv.work_units.choose_kv_splits`) predicts a plan's makespan from a cost
model (`work_units.CostModel`): a fixed overhead per unit, the merge program's fixed cost and its
cost per partial, and the predicted gain a split plan must show before it replaces the unsplit one.
Its PRIOR_COSTS are priors. This search sets them from measurements on the GPU at hand:

- each candidate cost model plans a fixed set of ragged batches (`WORKLOADS`, 8 K/V heads of
  head_dim 128, group 4, bf16) as ``plan(variant="units")`` plans them, with the programs the
  runtime takes on this GPU (its tuned table's, where one is found);
- a candidate whose plans are those of one measured before takes its figure (the plans change in
  steps, so most of the space repeats a few plans; planning is NumPy, nothing runs for it) and is
  not counted as a trial;
- otherwise each workload's plan is checked against the float64 reference (output poisoned first)
  and timed under the benchmark's protocol; the candidate's figure is the geometric mean of the
  workloads' medians;
- the built-in priors are measured first; the best candidate is measured again against them in
  rounds of alternating order, and is kept only when it is `confirm.MARGIN` faster there. Otherwise
  the priors are kept, with the figures that kept them.

The result goes into the GPU's table as ``unit_costs`` (`splitkv.tuned.tables.UnitCosts`); `DecodeAttention`
plans its work units with it on that GPU unless it is given costs or ``tuned=False``. Whether the
default planner routes a ragged batch to units stays decided under the priors, which its routing
factor (`work_units.ROUTE_FACTOR`) was measured with; the workloads measure the units plans themselves.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from ..work_units import PRIOR_COSTS, CostModel, choose_kv_splits
from ..tuned.keys import REFERENCE_KV_HEADS, TuneKey

#: The batches measured: (name, lengths), 8 K/V heads each. Two partial waves of whole rows, a
#: long row among short ones, a ragged mix, and a batch whose rows fill about one wave.
WORKLOADS = (
    ("1 x 6096", (6096,)),
    ("3 x 4096", (4096,) * 3),
    ("32k + 31 x 512", (32768,) + (512,) * 31),
    ("5 x 12000 + 11 x 1500", (12000,) * 5 + (1500,) * 11),
    ("16 x 4096", (4096,) * 16),
)
#: The layout the workloads are measured in (the costs are in tokens of one K/V head streamed by one
#: CTA, so they carry over to other layouts roughly as the stream's speed does).
KEY = TuneKey(128, 4, "bf16", "bf16", 0, "NHD")
#: The searched values: (low, high, step) of each CostModel field; max_ways keeps its default.
SPACE = {
    "unit_overhead": (0, 512, 16),
    "merge_fixed": (0, 2048, 64),
    "merge_per_partial": (0, 128, 4),
    "threshold": (0.0, 0.15, 0.01),
}
#: Asks per counted trial at most (candidates that repeat known plans are free, but not endless).
MAX_ASKS = 20
#: Rounds of the confirmation, each measuring the best candidate and the priors once.
CONFIRM_ROUNDS = 4


@dataclass(frozen=True)
class Outcome:
    """What the search keeps: the costs, their figure and the priors' (geometric mean µs: the
    medians of the confirmation rounds, or the search's one figure where the priors' plans were the
    best and nothing was confirmed), the trials measured, and each workload's µs (kept, priors)."""

    costs: CostModel
    tuned_us: float
    default_us: float
    trials: int
    workloads_us: dict


def costs_of(params: dict) -> CostModel:
    """A CostModel from a trial's parameters (`SPACE`), max_ways at its default."""
    return CostModel(unit_overhead=int(params["unit_overhead"]), merge_fixed=int(params["merge_fixed"]),
                     merge_per_partial=int(params["merge_per_partial"]),
                     threshold=round(float(params["threshold"]), 4))


def params_of(costs: CostModel) -> dict:
    """The trial parameters of ``costs`` (for enqueueing the priors: they lie on the space's grid)."""
    return {name: getattr(costs, name) for name in SPACE}


def plans_of(costs: CostModel, geometry) -> tuple:
    """What the runtime would launch for each workload under ``costs``: its unit and merge tables,
    planned on the workload's (block size, slots) in ``geometry`` (those of the units program the
    runtime takes for it, which the costs do not change)."""
    plans = []
    for (_, lens), (block_size, slots) in zip(WORKLOADS, geometry, strict=True):
        plan = choose_kv_splits(lens, REFERENCE_KV_HEADS, block_size=block_size, slots=slots, costs=costs)
        plans.append((plan.units.tobytes(), plan.merges.tobytes()))
    return tuple(plans)


def search(measure, plans, *, trials: int, seed: int = 0, log=None) -> Outcome:
    """Search the cost model: ``measure(costs, iters_scale)`` gives ``(geometric mean µs, {workload:
    µs})`` (raising `objective.TrialFailed` for a plan that fails its check, `objective.ContextLost`
    when the GPU can run nothing more, which ends the search), ``plans(costs)`` a hashable
    description of what they launch. ``trials`` counts distinct launches measured."""
    from .objective import ContextLost, TrialFailed
    from .confirm import MARGIN, beats_built_in
    from .studies import import_optuna

    optuna = import_optuna()
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.enqueue_trial(params_of(PRIOR_COSTS))
    known: dict = {}  # plans -> (geometric mean µs, per workload) or None (failed)
    launchers: dict = {}  # plans -> every candidate that launched them
    measured = asks = 0
    while measured < trials and asks < trials * MAX_ASKS:
        asks += 1
        trial = study.ask()
        costs = costs_of({name: _suggest(trial, name) for name in SPACE})
        launched = plans(costs)
        launchers.setdefault(launched, []).append(costs)
        if launched not in known:
            try:
                known[launched] = measure(costs, 1)
            except ContextLost:
                raise
            except TrialFailed as e:
                known[launched] = None
                _say(log, f"unit costs {costs.as_dict()}: failed: {e}")
            measured += 1
            if known[launched] is not None:
                _say(log, f"[{measured}/{trials}] {known[launched][0]:.2f} µs  {costs.as_dict()}")
        if known[launched] is None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, known[launched][0])
    prior_plans = plans(PRIOR_COSTS)
    if known.get(prior_plans) is None:
        raise RuntimeError("the built-in unit costs' plans failed their check; nothing to compare against")
    best = min((k for k in known if known[k] is not None), key=lambda k: known[k][0])
    if best == prior_plans:  # one search figure each: nothing to confirm against
        return _priors_kept(known[prior_plans], measured)
    # Every candidate that launched the best plans launches the same on the workloads; on other
    # batches they may differ, so the one nearest the priors is kept (the least change measured).
    chosen = min(launchers[best], key=_distance_from_priors)
    try:
        best_us, prior_us, per = against_priors(measure, chosen)
    except ContextLost:
        raise
    except TrialFailed as e:
        if e.priors_failed:
            raise RuntimeError(f"the built-in unit costs' plans failed their check when measured again: {e}") from e
        _say(log, f"the best candidate failed its check when measured again ({e}): keeping the built-in costs")
        return _priors_kept(known[prior_plans], measured)
    if beats_built_in(best_us, prior_us):
        return Outcome(chosen, best_us, prior_us, measured, per)
    _say(log, f"the best candidate ({best_us:.2f} µs) is not {MARGIN:.0%} faster than the built-in costs "
              f"({prior_us:.2f} µs) when measured again: keeping the built-in costs")
    return Outcome(PRIOR_COSTS, prior_us, prior_us, measured, {name: (p, p) for name, (_, p) in per.items()})


def against_priors(measure, costs: CostModel) -> tuple[float, float, dict]:
    """``costs`` and the priors measured again in `CONFIRM_ROUNDS` rounds of alternating order (each
    in both positions, twice the calls): (median µs of ``costs``, of the priors, {workload: (µs of
    ``costs``, of the priors)}), medians of the rounds' geometric means and of each workload's
    figures. ``costs`` that are the priors are measured once a round, standing for both. A check
    that fails raises its `TrialFailed` with ``priors_failed`` saying whose it was."""
    from .objective import TrialFailed

    rounds = {"best": [], "prior": []}
    order = ("prior",) if costs == PRIOR_COSTS else ("best", "prior")
    for r in range(CONFIRM_ROUNDS):
        for which in order[::-1 if r % 2 else 1]:
            try:
                rounds[which].append(measure(costs if which == "best" else PRIOR_COSTS, 2))
            except TrialFailed as e:  # (a lost context too: it ends whatever measures next)
                e.priors_failed = which == "prior"
                raise
    if costs == PRIOR_COSTS:
        rounds["best"] = rounds["prior"]
    best_us = float(np.median([m[0] for m in rounds["best"]]))
    prior_us = float(np.median([m[0] for m in rounds["prior"]]))
    per = {name: (float(np.median([m[1][name] for m in rounds["best"]])),
                  float(np.median([m[1][name] for m in rounds["prior"]]))) for name in rounds["best"][0][1]}
    return best_us, prior_us, per


def _priors_kept(figures: tuple, measured: int) -> Outcome:
    """The priors kept on their one search figure ``(geometric mean µs, {workload: µs})``."""
    us, per = figures
    return Outcome(PRIOR_COSTS, us, us, measured, {name: (t, t) for name, t in per.items()})


def _distance_from_priors(costs: CostModel) -> float:
    """How far ``costs`` lie from the priors, each field in units of its searched range."""
    return sum(((getattr(costs, name) - getattr(PRIOR_COSTS, name)) / (high - low)) ** 2
               for name, (low, high, _) in SPACE.items())


def _suggest(trial, name: str):
    low, high, step = SPACE[name]
    if isinstance(step, int):
        return trial.suggest_int(name, low, high, step=step)
    return trial.suggest_float(name, low, high, step=step)


def _say(log, text: str) -> None:
    print(f"splitkv-gen: {text}", file=log or sys.stderr, flush=True)


class GpuMeasure:
    """The workloads on the current GPU: inputs and float64 references made once, then per cost
    model each workload planned with ``plan(variant="units")``, checked and timed (median of
    ``iters`` calls, L2 flushed before each; twice the calls when confirming)."""

    def __init__(self, *, iters: int = 30, seed: int = 0):
        from ..timing import Harness
        from .measure import FLUSH_BYTES, BucketInputs

        self.iters = iters
        self.harness = Harness(iters, 5, FLUSH_BYTES)
        with self.harness.active():
            self.harness.flush_us = self.harness.flush_time_us()
            self.inputs = [BucketInputs(KEY, lens, seed + i) for i, (_, lens) in enumerate(WORKLOADS)]
        # Each workload's block size and slots, as the runtime plans its units on this GPU (with
        # the units program of the tuned entry nearest it, if any: the costs do not change which).
        self.geometry = []
        for inp in self.inputs:
            _, probe = self._planned(PRIOR_COSTS, inp)
            self.geometry.append((probe.block_size, probe.slots))

    def plans(self, costs: CostModel) -> tuple:
        return plans_of(costs, self.geometry)

    def _planned(self, costs: CostModel, inp):
        """(DecodeAttention planned for ``inp`` with the units program under ``costs``, the UnitPlan):
        the programs the runtime takes on this GPU (its tuned table's), the costs given."""
        from .. import DecodeAttention

        attn = DecodeAttention(KEY.group_size * REFERENCE_KV_HEADS, REFERENCE_KV_HEADS, KEY.head_dim,
                               q_dtype=KEY.q_dtype, kv_dtype=KEY.kv_dtype, unit_costs=costs)
        with self.harness.active():
            plan = attn.plan(inp.seq_lens, variant="units")
        return attn, plan

    def __call__(self, costs: CostModel, iters_scale: int = 1) -> tuple:
        from .measure import _failure, checked_call
        from .objective import TrialFailed

        per = {}
        for (name, _), inp in zip(WORKLOADS, self.inputs):
            with self.harness.active():
                try:
                    _, call = checked_call(lambda inp=inp: self._planned(costs, inp)[0], inp, self.harness)
                except TrialFailed as e:  # (ContextLost stays ContextLost)
                    raise type(e)(f"{name}: {e}") from e
                try:
                    times = self.harness.time(call, self.iters * iters_scale)
                except Exception as e:  # noqa: BLE001 - a plan that cannot run is a failed candidate
                    raise _failure(e) from e
            per[name] = float(np.median(times))
        return math.exp(sum(math.log(t) for t in per.values()) / len(per)), per

    def close(self) -> None:
        import cupy

        self.inputs = self.harness = None
        cupy.get_default_memory_pool().free_all_blocks()
