"""One Optuna study per (GPU model, key, bucket); a key's studies are searched together: ask for
candidates, prune the invalid ones before compiling, compile them on a thread pool while the GPU
measures those already compiled, tell the results.

Resumable and shareable: the study lives in the Optuna storage given (an SQLite or PostgreSQL URL,
a journal file, or memory). Every told trial is in the storage at once, so a run that is killed
loses at most the trials it was measuring; a later run (or another worker on the same storage)
counts the measured trials and runs only the rest. Trials a killed process left RUNNING on this
host are failed as interrupted when the study is next searched here (they do not count). A
confirmed outcome is kept in its study (`save_outcome`), and a process tuning a key marks it
(`claim`), so that workers tune keys apart and the parent of the workers reads their entries back.

``--trials`` counts measured candidates: invalid combinations (pruned before compiling),
candidates the sampler returns to, and candidates that launch what a measured one launched on the
bucket (`Objective.runs`: a tuned dense program where the planner splits runs the built-in split
program) reuse a figure, cost no measurement and do not count, up to `MAX_ASKS` asks per trial
asked for.

The heuristic's own programs (its split and its dense program) are enqueued first, so the search
starts from the default. The winner is then confirmed: the best few candidates that launch
something else than the built-in choice, and the built-in choice (planned as the runtime plans
it), are measured again with more iterations, in rounds whose order alternates; the fastest of
that round is measured once more against the built-in choice, and replaces it only when `MARGIN`
faster there. Otherwise the entry is ``spec: None``, so a tuned table is never slower than the
default on the figures it was tuned on, and no entry is the noise of one median.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import socket
import time
import warnings
from concurrent import futures
from pathlib import Path

from . import lookup, space
from .keys import Bucket, TuneKey
from .objective import ContextLost, Measurement, Objective, TrialFailed
from .tables import CURRENT_PLANNER, Entry, today

#: Candidates each study keeps in flight (asked, compiling or waiting for the GPU).
BATCH = 8
#: Best candidates measured again against the built-in choice before one is written.
CONFIRM_TOP = 3
CONFIRM_ROUNDS = 3
#: How much faster than the built-in choice a candidate must be, in the final round, to replace it.
MARGIN = 0.01
#: Asks per study at most, as a multiple of the trials asked for (invalid or repeated candidates
#: are asked for again, but not forever: a small space runs out of new candidates). Candidates in
#: flight make the sampler return to points more often than batches told at once did.
MAX_ASKS = 10
_HOST = socket.gethostname()
#: Prefix of the study attributes holding one process's seconds per phase (see `_Clock`).
SECONDS_ATTR = "seconds"
#: Prefix of the study attributes naming each process that asked for trials of it (host and pid),
#: written before its first ask (see `fail_interrupted`).
ASKER_ATTR = "asker"
#: The phases, in the order the summary shows them: asking the sampler, waiting for candidates to
#: compile (the GPU idle), measuring them (planning, checking against the reference, timing),
#: confirming the winner. Not counted: building the study's inputs, storage reads, `exhaustive`.
PHASES = ("sample", "compile", "measure", "confirm")


class _Clock:
    """Seconds this process spends on a study, per phase; `flush` adds them to the study's attribute
    of this process (one per host and pid, so workers never overwrite each other, and a killed run
    keeps what it flushed)."""

    def __init__(self, study):
        self.study = study
        self.attr = f"{SECONDS_ATTR} {_HOST} {os.getpid()}"
        self.spent = dict(study.user_attrs.get(self.attr) or {})

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.monotonic()
        try:
            yield
        finally:
            self.spent[name] = self.spent.get(name, 0.0) + time.monotonic() - start

    def add(self, name: str, seconds: float) -> None:
        """Seconds of a phase spent for this study and others at once (its share of them)."""
        self.spent[name] = self.spent.get(name, 0.0) + seconds

    def flush(self) -> None:
        """Write the seconds; a storage that refuses is warned about, never raised, so that a
        flush on the way out of a failure (a lost GPU context) cannot replace that failure."""
        try:
            self.study.set_user_attr(self.attr, {k: round(v, 3) for k, v in self.spent.items()})
        except Exception as e:  # noqa: BLE001 - the figures are a report, the run's own error matters more
            warnings.warn(f"splitkv: could not record the study's seconds: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=2)


def study_seconds(study) -> dict:
    """Seconds spent on ``study`` per phase, summed over every process that worked on it."""
    total: dict = {}
    for attr, spent in study.user_attrs.items():
        if attr.startswith(SECONDS_ATTR + " ") and isinstance(spent, dict):
            for phase, seconds in spent.items():
                total[phase] = total.get(phase, 0.0) + float(seconds)
    return total


@dataclasses.dataclass
class Outcome:
    """What a study found: the entry to write, and the trials behind it (for the report)."""

    entry: Entry
    trials: list  # (spec name, chunk_size, variant, µs or None, state, reason)
    confirm: dict  # spec name (or 'built-in') -> confirmed µs
    objective: str
    seconds: dict = dataclasses.field(default_factory=dict)  # phase -> seconds spent (`study_seconds`)


def _optuna():
    try:
        import optuna
    except ImportError as e:
        raise ImportError("splitkv-gen --tune needs Optuna: pip install 'splitkv[tune]'") from e
    return optuna


def open_study(name: str, storage, seed: int | None = None, worker: int = 0):
    """The study ``name`` in ``storage`` (see `make_storage`), created if it does not exist. Its
    sampler's seed mixes ``seed`` with ``worker`` and the trials already there, so a resumed run
    or a second worker does not propose the first one's candidates again."""
    optuna = _optuna()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=make_storage(storage), load_if_exists=True,
                                direction="minimize")
    if seed is not None:
        seed = (seed * 1_000_003 + worker * 7_919 + len(study.trials)) % 2**32
    with warnings.catch_warnings():  # multivariate and group are marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                                   n_startup_trials=10)
    return study


def make_storage(storage):
    """Optuna storage from a CLI value: '*.log' / '*.journal' / 'journal:PATH' is a journal file
    (shared through file locks: fine for the workers of one host or a shared file system; its
    folder is created); any other string is an RDB URL (sqlite:///tune.db, postgresql://...);
    None is a new in-memory storage."""
    optuna = _optuna()
    if storage is None:
        return optuna.storages.InMemoryStorage()
    if not isinstance(storage, str):
        return storage
    path = journal_path(storage)
    if path is not None:
        from optuna.storages.journal import JournalFileBackend

        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    return optuna.storages.RDBStorage(storage)


def journal_path(storage) -> Path | None:
    """The journal file a --storage value names ('*.log', '*.journal', 'journal:PATH'), else None."""
    if not isinstance(storage, str):
        return None
    if storage.startswith("journal:"):
        return Path(storage[len("journal:"):])
    return Path(storage) if storage.endswith((".log", ".journal")) else None


def finished(study) -> list:
    optuna = _optuna()
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED)
    return study.get_trials(deepcopy=False, states=done)


def measured(study) -> list:
    """The finished trials that measured a candidate (or failed trying): what ``trials`` counts."""
    optuna = _optuna()
    return [t for t in finished(study) if "repeat_of" not in t.user_attrs
            and (t.state == optuna.trial.TrialState.COMPLETE
                 or (t.state == optuna.trial.TrialState.FAIL and "interrupted" not in t.user_attrs))]


def fail_interrupted(study) -> int:
    """Fail the trials a process of this host left RUNNING and is no longer there to finish
    (killed mid-batch); returns how many. Trials of live processes and other hosts are left.

    A trial names its process (user attributes host and pid) only once `_ask` has written them,
    journal records after Optuna made it RUNNING: a process killed in between leaves a RUNNING
    trial that names no process, or only its host. Such a trial is failed when the processes that
    asked for trials of the study (`ASKER_ATTR`) are all of this host and gone; while one of them
    may be alive, it may be between those records itself, and the trial is left to a later run."""
    optuna = _optuna()
    askers = [(owner.get("host"), owner.get("pid")) for attr, owner in study.user_attrs.items()
              if attr.startswith(ASKER_ATTR + " ") and isinstance(owner, dict)]
    askers_gone = bool(askers) and all(host == _HOST and not _alive(pid) for host, pid in askers)
    failed = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if "pid" in t.user_attrs:
            if t.user_attrs.get("host") != _HOST or _alive(t.user_attrs["pid"]):
                continue
        elif not askers_gone:
            continue
        _mark_interrupted(study, t)
        failed += 1
    return failed


def _mark_interrupted(study, trial) -> None:
    """Tell a RUNNING trial (a Trial or a FrozenTrial) failed and interrupted: it does not count."""
    study._storage.set_trial_user_attr(trial._trial_id, "interrupted", True)
    study.tell(trial.number, state=_optuna().trial.TrialState.FAIL)


def _alive(pid) -> bool:
    if not isinstance(pid, int):
        return True  # not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    clock: _Clock
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
        study.set_user_attr(f"{ASKER_ATTR} {_HOST} {os.getpid()}", dict(host=_HOST, pid=os.getpid()))
        states.append(_Searching(study, objective, progress, _Clock(study)))
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
                        _advance(run.progress)
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
    optuna = _optuna()
    try:
        if study._storage.get_trial(trial._trial_id).state != optuna.trial.TrialState.RUNNING:
            return
        _mark_interrupted(study, trial)
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
    optuna = _optuna()
    asked = []
    for _ in range(count):
        # RUNNING in the storage from here, but naming its process only from the records below
        # (a kill in between: see `fail_interrupted`).
        trial = study.ask()
        trial.set_user_attr("host", _HOST)
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
        optuna = _optuna()
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
    optuna = _optuna()
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


def _advance(progress):
    if progress is not None:
        progress.update(1)


#: Study attribute holding the confirmed outcome (see `save_outcome`).
OUTCOME_ATTR = "outcome"
#: Study attribute naming the process tuning the study (see `claim`).
CLAIM_ATTR = "claim"


def save_outcome(study, outcome: Outcome, settings: dict, trials: int) -> None:
    """Keep ``outcome`` (its entry and confirmation figures) in the study, with the number of measured
    trials it was confirmed on, the ``trials`` asked for, whether the study's asks were used up
    (`MAX_ASKS`: a small space may end below ``trials`` for good) and the run's ``settings`` (what
    else the confirmation depends on): a later run, or the parent of the workers, takes it from
    there instead of confirming again (`saved_outcome`)."""
    study.set_user_attr(OUTCOME_ATTR, dict(entry=outcome.entry.to_dict(), confirm=outcome.confirm,
                                           objective=outcome.objective, measured=len(measured(study)),
                                           trials=trials, asks_spent=len(finished(study)) >= MAX_ASKS * trials,
                                           settings=settings))


def saved_outcome(study, arch: str, trials: int, settings: dict) -> Outcome | None:
    """The outcome `save_outcome` kept in the study, when it still stands: the same ``settings``, no
    trial measured since, and at least ``trials`` of them (or, for a study whose asks were used up,
    as many trials asked for then as now); else None."""
    saved = study.user_attrs.get(OUTCOME_ATTR)
    if not isinstance(saved, dict) or saved.get("settings") != settings:
        return None
    count = len(measured(study))
    spent = saved.get("asks_spent") is True and isinstance(saved.get("trials"), int) and saved["trials"] >= trials
    if saved.get("measured") != count or (count < trials and not spent):
        return None
    try:
        entry = Entry.from_dict(saved["entry"], arch)
    except (KeyError, TypeError, ValueError):
        return None  # written by another version: confirmed again
    return Outcome(entry, trial_rows(study), dict(saved.get("confirm") or {}), str(saved.get("objective", "")),
                   study_seconds(study))


def claim(study, run: str) -> None:
    """Mark the study as being tuned by this process, a worker of ``run`` (see `claimed_elsewhere`)."""
    study.set_user_attr(CLAIM_ATTR, dict(host=_HOST, pid=os.getpid(), run=run))


def claimed_elsewhere(study, run: str) -> bool:
    """Whether another worker of the same ``run`` (one parent's workers) claimed the study and may
    still be tuning it: a live process of this host, or any of another host (which this one cannot
    see). Claims of other runs are stale (a killed run, another container): ignored."""
    owner = study.user_attrs.get(CLAIM_ATTR)
    if not isinstance(owner, dict) or owner.get("run") != run \
            or (owner.get("host"), owner.get("pid")) == (_HOST, os.getpid()):
        return False
    return owner.get("host") != _HOST or _alive(owner.get("pid"))


def best_specs(study, key: TuneKey, arch: str, top: int | None) -> list:
    """The ``top`` (None: all) fastest distinct candidates of the study's completed trials, fastest
    first."""
    optuna = _optuna()
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
    clock = _Clock(study)
    try:
        with clock.phase("confirm"):
            outcome = _confirmed(study, key, bucket, arch, objective, top, iters, exhaustive_results)
    finally:  # a failed confirmation still took its time
        clock.flush()
    outcome.seconds = study_seconds(study)
    return outcome


def _confirmed(study, key, bucket, arch, objective, top, iters, exhaustive_results) -> Outcome:
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
        elif final[winner].us <= final[None].us * (1 - MARGIN):
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


def trial_rows(study) -> list:
    rows = []
    for t in study.get_trials(deepcopy=False):
        p = t.params
        chunk = p.get("warps", 0) * p.get("tile_tokens", 0) * p.get("chunk_tiles", 1)
        rows.append(dict(number=t.number, spec=t.user_attrs.get("spec"), variant=p.get("variant"), chunk_size=chunk,
                         us=t.value, state=t.state.name, reason=t.user_attrs.get("reason"),
                         repeat_of=t.user_attrs.get("repeat_of")))
    return rows


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
            _advance(progress)
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
