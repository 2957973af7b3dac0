"""The search of a key's studies (one Optuna study per GPU model, key and bucket, searched
together): ask for candidates, prune the invalid ones before compiling, compile them on a thread
pool while the GPU measures those already compiled, tell the results. The studies themselves
(storage, resuming, workers): `splitkv.autotune.studies`; the winner's confirmation:
`splitkv.autotune.confirm`.

``--trials`` counts measured candidates: invalid combinations (pruned before compiling),
candidates the sampler returns to, and candidates that launch what a measured one launched on the
bucket (`Objective.runs`: a tuned dense program where the planner splits runs the built-in split
program) reuse a figure, cost no measurement and do not count, up to `MAX_ASKS` asks per trial
asked for.

The heuristic's own programs (its split and its dense program) are enqueued first, so the search
starts from the default.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from concurrent import futures

from ..tuned import lookup
from ..tuned.keys import Bucket, TuneKey
from . import space
from .objective import ContextLost, Objective, TrialFailed
from .studies import (ASKER_ATTR, HOST, MAX_ASKS, PhaseClock, fail_interrupted, finished, import_optuna,
                      mark_interrupted, measured)

#: Candidates each study keeps in flight (asked, compiling or waiting for the GPU).
BATCH = 8


def enqueue_defaults(study, key: TuneKey, bucket: Bucket, arch: str) -> None:
    """The heuristic's split and dense programs as the first trials (once per study)."""
    split, dense, _ = lookup.programs(None, arch, key)
    for variant, spec in (("split", split), ("dense", dense)):
        try:
            params = space.params_of(spec, key, arch)
        except ValueError as e:  # the built-in choice is still measured when the study finishes
            warnings.warn(f"splitkv: the built-in {variant} program is not a point of the search space: {e}",
                          RuntimeWarning, stacklevel=2)
            continue
        study.enqueue_trial(params, user_attrs={"builtin": variant}, skip_if_exists=True)


def run_trials(study, key: TuneKey, arch: str, objective: Objective, *, trials: int, timeout: float | None = None,
               batch: int = BATCH, progress=None) -> int:
    """Ask, prune, compile and measure until the study holds ``trials`` measured trials (counting
    those of earlier runs and other workers), ``MAX_ASKS`` times as many asks, or ``timeout``
    seconds; returns how many this call measured. Workers sharing a study may overshoot by up to a
    batch each, since each asks for what was missing when its batch began. A lost GPU context
    (`ContextLost`) fails the trial that lost it and is raised: nothing after it could be trusted."""
    return run_studies([(study, objective, progress)], key, arch, trials=trials, timeout=timeout, batch=batch)


@dataclasses.dataclass
class _Searching:
    """One study of `run_studies`: its objective, progress bar, clock, what it knows, and its
    trials in flight (asked, compiling or compiled, not yet told): (trial, spec, pending programs)."""

    study: object
    objective: Objective
    progress: object
    clock: PhaseClock
    known: "_Known | None" = None
    flight: list = dataclasses.field(default_factory=list)
    spent: bool = False  # asks for nothing more


def run_studies(runs, key: TuneKey, arch: str, *, trials: int, timeout: float | None = None,
                batch: int = BATCH) -> int:
    """`run_trials` for several studies of one key at once, ``runs`` being (study, objective,
    progress) of each bucket (the buckets of a key search the same programs).

    A pipeline: each study keeps up to ``batch`` candidates in flight, whose programs compile on a
    thread pool (`Compiler`, ``objective.jobs`` at a time, each program once for all the studies),
    while the GPU measures whichever candidate is compiled first and the study that measured it asks
    for the next. The GPU waits only when nothing compiled is left to measure; that wait is the
    'compile' phase, shared equally among the studies waiting. ``timeout`` stops the asking for the
    whole call; what is in flight is still measured."""
    from .compiling import Compiler

    start = time.monotonic()
    states = []
    for study, objective, progress in runs:
        fail_interrupted(study)
        # Named before any ask, so that a trial this process leaves naming no one (killed between
        # Optuna's ask and `_ask`'s records) is judged by whether this process is alive.
        study.set_user_attr(f"{ASKER_ATTR} {HOST} {os.getpid()}", dict(host=HOST, pid=os.getpid()))
        states.append(_Searching(study, objective, progress, PhaseClock(study)))
        states[-1].clock.add("compile", 0.0)  # a phase of every search, even one that never waits
    if not states:
        return 0
    measured_here = 0
    compiler = Compiler(states[0].objective)
    try:
        while True:
            if timeout is None or time.monotonic() - start <= timeout:
                for run in states:
                    _fill(run, compiler, key, arch, trials, batch)
            ready = next(((run, item) for run in states for item in run.flight if compiler.ready(item[2])), None)
            if ready is None:
                waiting = [run for run in states if run.flight]
                if not waiting:
                    return measured_here
                begun = time.monotonic()
                futures.wait([f for run in waiting for _, _, pending in run.flight for _, f in pending if not f.done()],
                             return_when=futures.FIRST_COMPLETED)
                for run in waiting:
                    run.clock.add("compile", (time.monotonic() - begun) / len(waiting))
                continue
            run, (trial, spec, pending) = ready
            try:
                with run.clock.phase("measure"):
                    if _settle(run.study, trial, spec, run.objective, run.known, compiler.failure(pending)):
                        measured_here += 1
                        advance(run.progress)
            finally:  # a lost context still leaves the time it took
                run.clock.flush()
            run.flight.remove(ready[1])  # told: only now, so an error inside leaves it to the cleanup
    finally:
        compiler.close()
        for run in states:  # stopped by an error: what was in flight is failed, and measured by no one
            for trial, _, _ in run.flight:
                _fail_interrupted_trial(run.study, trial)
            run.flight.clear()
            run.clock.flush()


def _fail_interrupted_trial(study, trial) -> None:
    """Tell a trial in flight as failed and interrupted (it does not count); one already told (by
    the `_settle` an error came out of) is left as it is, and a storage that refuses is warned
    about, so the error that stopped the search is the one raised."""
    optuna = import_optuna()
    try:
        if study._storage.get_trial(trial._trial_id).state != optuna.trial.TrialState.RUNNING:
            return
        mark_interrupted(study, trial)
    except Exception as e:  # noqa: BLE001 - the search's own error matters more
        warnings.warn(f"splitkv: could not fail trial {trial.number} as interrupted: {type(e).__name__}: {e}",
                      RuntimeWarning, stacklevel=2)


def _fill(run: _Searching, compiler, key: TuneKey, arch: str, trials: int, batch: int) -> None:
    """Ask ``run``'s study for candidates until ``batch`` are in flight, or as many as its trials
    still need, or its asks are spent; candidates it measured before are told their figure at once
    (and asked for again), the others start compiling."""
    while not run.spent and len(run.flight) < batch:
        in_flight = len(run.flight)
        room = min(trials - len(measured(run.study)), MAX_ASKS * trials - len(finished(run.study))) - in_flight
        if room <= 0:
            # With nothing in flight, its trials are measured or its asks used up: for good. (What is
            # in flight may yet be a repeat, which counts for nothing and is asked for again.)
            run.spent = not in_flight
            return
        room = min(room, batch - in_flight)
        run.known = _Known(run.study)  # other workers' figures count too
        with run.clock.phase("sample"):
            for trial, spec in _ask(run.study, key, arch, room):
                if spec.name in run.known.by_spec or spec.name in run.known.failed:  # a point tried before
                    _settle(run.study, trial, spec, run.objective, run.known, None)
                else:
                    run.flight.append((trial, spec, compiler.submit(spec)))


def _ask(study, key: TuneKey, arch: str, count: int) -> list:
    """``count`` new trials of ``study``: (trial, spec) of the valid ones; the invalid ones are told
    as pruned at once."""
    optuna = import_optuna()
    asked = []
    for _ in range(count):
        # RUNNING in the storage from here, but naming its process only from the records below
        # (a kill in between: see `fail_interrupted`).
        trial = study.ask()
        trial.set_user_attr("host", HOST)
        trial.set_user_attr("pid", os.getpid())
        try:
            spec = space.build_spec(lambda name, values: trial.suggest_categorical(name, values), key, arch)
        except space.Invalid as e:
            _tell(study, trial, None, optuna.trial.TrialState.PRUNED, f"invalid: {e}")
            continue
        trial.set_user_attr("spec", spec.name)
        asked.append((trial, spec))
    return asked


class _Known:
    """The figures a study holds: by candidate (spec name -> figure, trial measured, launch), by
    what a candidate launches (launch -> figure, trial measured), and the candidates that failed."""

    def __init__(self, study):
        optuna = import_optuna()
        self.by_spec, self.by_launch = {}, {}
        self.failed = {}  # spec name -> (trial that failed, reason)
        for t in finished(study):
            if t.state == optuna.trial.TrialState.FAIL and "spec" in t.user_attrs \
                    and "interrupted" not in t.user_attrs:
                self.failed.setdefault(t.user_attrs["spec"], (t.user_attrs.get("repeat_of", t.number),
                                                              t.user_attrs.get("reason") or "failed"))
            if t.state != optuna.trial.TrialState.COMPLETE:
                continue
            number, runs = t.user_attrs.get("repeat_of", t.number), t.user_attrs.get("runs")
            if "spec" in t.user_attrs:
                self.by_spec[t.user_attrs["spec"]] = (t.value, number, runs)
            if runs is not None:
                self.by_launch[runs] = (t.value, number)

    def add(self, name: str, runs: str, value: float, number: int) -> None:
        self.by_spec[name] = (value, number, runs)
        self.by_launch.setdefault(runs, (value, number))


def _settle(study, trial, spec, objective: Objective, known: _Known, failure: str | None) -> bool:
    """Tell ``trial`` what ``spec`` gives: a figure already known (a candidate measured before, or
    one that launches the same on the bucket: not measured, returns False), its compile
    ``failure``, or a measurement (returns True, also when it failed). `ContextLost` is raised once
    told."""
    optuna = import_optuna()
    complete, fail = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL
    if spec.name in known.by_spec:  # the sampler came back to a measured point: its figure stands
        value, number, runs = known.by_spec[spec.name]
        if runs is not None:
            trial.set_user_attr("runs", runs)
        _tell(study, trial, value, complete, None, repeat_of=number)
        return False
    if spec.name in known.failed:  # a failed one (asked twice while in flight): failed again, not counted
        number, reason = known.failed[spec.name]
        _tell(study, trial, None, fail, reason, repeat_of=number)
        return False
    if failure:
        _tell(study, trial, None, fail, failure)
        known.failed[spec.name] = (trial.number, failure)
        return True
    try:
        runs = objective.runs(spec)
        trial.set_user_attr("runs", runs)
        if runs in known.by_launch:  # it launches what a measured candidate did: that figure stands
            value, number = known.by_launch[runs]
            known.add(spec.name, runs, value, number)
            _tell(study, trial, value, complete, None, repeat_of=number)
            return False
        m = objective.measure(spec)
    except ContextLost as e:
        _tell(study, trial, None, fail, str(e))
        raise
    except TrialFailed as e:
        _tell(study, trial, None, fail, str(e))
        known.failed[spec.name] = (trial.number, str(e))
        return True
    trial.set_user_attr("bandwidth_pct", m.bandwidth_pct)
    _tell(study, trial, m.us, complete, None)
    known.add(spec.name, runs, m.us, trial.number)
    return True


def _tell(study, trial, value, state, reason, repeat_of=None):
    if reason:
        trial.set_user_attr("reason", reason[:2000])
    if repeat_of is not None:
        trial.set_user_attr("repeat_of", repeat_of)
    study.tell(trial, value, state=state)


def advance(progress):
    if progress is not None:
        progress.update(1)

