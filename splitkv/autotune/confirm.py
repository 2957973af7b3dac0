"""Confirming a study's winner, and the exhaustive comparison.

The best few candidates that launch something else than the built-in choice, and the built-in
choice (planned as the runtime plans it), are measured again with more iterations, in rounds whose
order alternates; the fastest of that round is measured once more against the built-in choice, and
replaces it only when `MARGIN` faster there. Otherwise the entry is ``spec: None``, so a tuned
table is never slower than the default on the figures it was tuned on, and no entry is the noise
of one median.
"""

from __future__ import annotations

import math
import warnings

from ..tuned.keys import Bucket, TuneKey
from ..tuned.tables import CURRENT_PLANNER, Entry
from . import space
from .objective import ContextLost, Measurement, Objective, TrialFailed
from .search import BATCH, advance
from .studies import Outcome, PhaseClock, import_optuna, measured, study_seconds, trial_rows
from .writing import today

#: Best candidates measured again against the built-in choice before one is written.
CONFIRM_TOP = 3
CONFIRM_ROUNDS = 3

#: How much faster than the built-in choice a candidate must be, in the final round, to replace it.
MARGIN = 0.01


def beats_built_in(tuned_us: float, default_us: float) -> bool:
    """Whether ``tuned_us`` is `MARGIN` faster than ``default_us`` as a table records the two (to
    3 decimals), so that an entry read back from its table still passes the rule it was kept by."""
    return round(tuned_us, 3) <= round(default_us, 3) * (1 - MARGIN)


def best_specs(study, key: TuneKey, arch: str, top: int | None) -> list:
    """The ``top`` (None: all) fastest distinct candidates of the study's completed trials, fastest
    first."""
    optuna = import_optuna()
    ranked = sorted((t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                     if t.value is not None and math.isfinite(t.value)), key=lambda t: t.value)
    out = {}
    for t in ranked:
        spec = space.build_spec(lambda name, values: t.params[name], key, arch)
        out.setdefault(spec.name, (spec, t.value))
        if len(out) == top:
            break
    return list(out.values())


def confirm(objective: Objective, candidates, *, rounds: int = CONFIRM_ROUNDS, iters: int | None = None) -> dict:
    """Measure the candidates and the built-in choice (None) in turn, ``rounds`` times; the median
    per candidate. A candidate that fails here is dropped; the built-in choice failing raises."""
    figures: dict = {None: []}
    for spec in candidates:
        figures[spec.name] = []
    specs = {s.name: s for s in candidates}
    for round_ in range(rounds):
        # Every other round in reverse, so that no candidate is always measured first or last.
        for name in list(figures)[::-1 if round_ % 2 else 1]:
            if name not in figures:
                continue
            try:
                figures[name].append(objective.measure(specs.get(name), iters=iters))
            except ContextLost:
                raise
            except TrialFailed:
                if name is None:
                    raise
                figures.pop(name)
    return {name: _median_measurement(ms) for name, ms in figures.items()}


def _median_measurement(ms: list) -> Measurement:
    ordered = sorted(ms, key=lambda m: m.us)
    return ordered[len(ordered) // 2]


def finish(study, key: TuneKey, bucket: Bucket, arch: str, objective: Objective, *, top: int = CONFIRM_TOP,
           iters: int | None = None, exhaustive_results: dict | None = None) -> Outcome:
    """The study's entry: its best candidates confirmed against the built-in choice (see the module
    notes). With ``exhaustive_results`` (see `exhaustive`), the entry also says how the search
    compares. Raises TrialFailed when the built-in choice itself fails on this bucket."""
    clock = PhaseClock(study)
    try:
        with clock.phase("confirm"):
            outcome = _confirmed_outcome(study, key, bucket, arch, objective, top, iters, exhaustive_results)
    finally:  # a failed confirmation still took its time
        clock.flush()
    outcome.seconds = study_seconds(study)
    return outcome


def _confirmed_outcome(study, key, bucket, arch, objective, top, iters, exhaustive_results) -> Outcome:
    """`finish` but its clock."""
    # Candidates that launch what the built-in choice launches on this bucket are the built-in
    # choice, measured as None; of several that launch the same, the fastest stands for them.
    builtin_runs = objective.runs(None)
    launches = {builtin_runs}
    candidates = {}
    for spec, _ in best_specs(study, key, arch, None):
        try:
            runs = objective.runs(spec)
        except TrialFailed:
            continue
        if runs not in launches:
            launches.add(runs)
            candidates[spec.name] = spec
        if len(candidates) == top:
            break
    figures = confirm(objective, list(candidates.values()), iters=iters)
    report = {("built-in" if k is None else k): m.us for k, m in figures.items()}
    winner = min(figures, key=lambda name: (figures[name].us, name is not None))  # ties: built-in
    spec, tuned, default = None, figures[None], figures[None]
    if winner is not None:  # a fresh round of the two, so the winner's own figure is not the luckiest
        final = confirm(objective, [candidates[winner]], iters=iters)
        report.update({f"final {winner}": final[winner].us, "final built-in": final[None].us})
        problem = objective.verify(candidates[winner])
        if problem:
            warnings.warn(f"splitkv: {key.label} {bucket.name}: {winner} failed its last check; the built-in "
                          f"choice is kept: {problem}", RuntimeWarning, stacklevel=2)
        elif beats_built_in(final[winner].us, final[None].us):
            spec, tuned, default = candidates[winner], final[winner], final[None]
    compared = None
    if exhaustive_results is not None:
        compared = compare_with_exhaustive(study, exhaustive_results)
        mine = None if spec is None else exhaustive_results.get(spec.name)
        compared["tuned_spec_us"] = None if mine is None else round(mine, 3)
        compared["builtin_spec_us"] = _builtin_figure(objective, exhaustive_results, key, arch, builtin_runs)
    entry = Entry(key, bucket, spec, tuned.us, default.us, tuned.bandwidth_pct, len(measured(study)), today(),
                  compared, tuned.detail.get("plan"), None if spec is None else builtin_runs, CURRENT_PLANNER)
    return Outcome(entry, trial_rows(study), report, objective.name)


def _builtin_figure(objective: Objective, results: dict, key: TuneKey, arch: str, builtin: str) -> float | None:
    """The built-in choice's figure in an exhaustive run: the best of the candidates that launch
    what it launches on the bucket (``builtin``, `Objective.runs`; None when none of them ran)."""
    same = []
    for spec in space.enumerate_specs(key, arch)[0]:
        if results.get(spec.name) is None:
            continue
        try:
            if objective.runs(spec) == builtin:
                same.append(results[spec.name])
        except TrialFailed:
            continue
    return round(min(same), 3) if same else None


def exhaustive(key: TuneKey, arch: str, objective: Objective, progress=None) -> dict:
    """Every valid candidate of the space measured once: {spec name: µs or None (failed)}."""
    specs, _ = space.enumerate_specs(key, arch)
    results = {}
    for i in range(0, len(specs), BATCH * 4):
        chunk = specs[i:i + BATCH * 4]
        failures = objective.prepare(chunk)
        for spec in chunk:
            if spec.name in failures:
                results[spec.name] = None
            else:
                try:
                    results[spec.name] = objective.measure(spec).us
                except ContextLost:
                    raise
                except TrialFailed:
                    results[spec.name] = None
            advance(progress)
    return results


def compare_with_exhaustive(study, results: dict, within: float = 0.03) -> dict:
    """How the search did against the exhaustive figures: the best of both, and the first trial
    whose candidate is within ``within`` of the exhaustive best (by the exhaustive figures, so
    noise between the two runs does not count)."""
    figures = {name: us for name, us in results.items() if us is not None}
    out = dict(points=len(results), failed=len(results) - len(figures), best_us=None, trials_to_within_3pct=None)
    if not figures:
        return out
    best = min(figures.values())
    out["best_us"] = round(best, 3)
    # Counted as --trials counts: measured candidates only (pruned and repeated asks are free).
    for count, t in enumerate(sorted(measured(study), key=lambda t: t.number), start=1):
        us = figures.get(t.user_attrs.get("spec"))
        if us is not None and us <= best * (1 + within):
            out["trials_to_within_3pct"] = count
            break
    return out

