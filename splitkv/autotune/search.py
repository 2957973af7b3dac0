"""One Optuna study per (GPU model, key, bucket): ask for candidates in batches, prune the invalid
ones before compiling, compile a batch at once, measure each, tell the results.

Resumable and shareable: the study lives in the Optuna storage given (an SQLite or PostgreSQL URL,
a journal file, or memory). Every told trial is in the storage at once, so a run that is killed
loses at most the trials it was measuring; a later run (or another worker on the same storage)
counts the finished trials and runs only the rest. Trials left RUNNING by a killed run are not
counted, and the sampler sees them as pending.

The heuristic's own programs (its split and its dense program) are enqueued first, so the search
starts from the default. The winner is then confirmed: the best few candidates and the built-in
choice (planned as the runtime plans it) are measured again, alternately, with more iterations,
and the fastest of that round wins; the built-in choice winning gives an entry of ``spec: None``,
so a tuned table is never slower than the default on the figures it was tuned on.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
import warnings

from ..heuristics import default_spec
from . import space
from .keys import Bucket, TuneKey
from .objective import Measurement, Objective, TrialFailed
from .tables import Entry, today

#: Candidates asked for at once (compiled together).
BATCH = 8
#: Best candidates measured again against the built-in choice before one is written.
CONFIRM_TOP = 3
CONFIRM_ROUNDS = 3


@dataclasses.dataclass
class Outcome:
    """What a study found: the entry to write, and the trials behind it (for the report)."""

    entry: Entry
    trials: list  # (spec name, chunk_size, variant, µs or None, state, reason)
    confirm: dict  # spec name (or 'built-in') -> confirmed µs
    objective: str


def _optuna():
    try:
        import optuna
    except ImportError as e:
        raise ImportError("splitkv-gen --tune needs Optuna: pip install 'splitkv[tune]'") from e
    return optuna


def open_study(name: str, storage, seed: int | None = None):
    """The study ``name`` in ``storage`` (a URL, a journal file path ending in .log/.journal, an
    Optuna storage object, or None for memory), created if it does not exist."""
    optuna = _optuna()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():  # multivariate and group are marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                             n_startup_trials=10)
    return optuna.create_study(study_name=name, storage=make_storage(storage), load_if_exists=True,
                               direction="minimize", sampler=sampler)


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
    path = storage[len("journal:"):] if storage.startswith("journal:") else storage
    if storage.startswith("journal:") or path.endswith((".log", ".journal")):
        from optuna.storages.journal import JournalFileBackend

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(path))
    return optuna.storages.RDBStorage(storage)


def finished(study) -> list:
    optuna = _optuna()
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED)
    return study.get_trials(deepcopy=False, states=done)


def enqueue_defaults(study, key: TuneKey, bucket: Bucket, arch: str) -> None:
    """The heuristic's split and dense programs as the first trials (once per study)."""
    for variant in ("split", "dense"):
        spec = default_spec(arch, key.head_dim, key.group_size, key.q_dtype, key.kv_dtype, variant,
                            key.page_size, key.kv_layout)
        study.enqueue_trial(space.params_of(spec, key, arch), user_attrs={"builtin": variant}, skip_if_exists=True)


def run_trials(study, key: TuneKey, arch: str, objective: Objective, *, trials: int, timeout: float | None = None,
               batch: int = BATCH, progress=None) -> int:
    """Ask, prune, compile and measure until the study holds ``trials`` finished trials (counting
    those of earlier runs and other workers) or ``timeout`` seconds pass; returns how many this
    call finished. Workers sharing a study may overshoot by up to a batch each, since each asks
    for what was missing when its batch began."""
    optuna = _optuna()
    start = time.monotonic()
    done_here = 0
    seen = {t.user_attrs["spec"]: (t.value, t.number) for t in finished(study)
            if t.state == optuna.trial.TrialState.COMPLETE and "spec" in t.user_attrs}
    while True:
        left = trials - len(finished(study))
        if left <= 0 or (timeout is not None and time.monotonic() - start > timeout):
            return done_here
        asked = []
        for _ in range(min(batch, left)):
            trial = study.ask()
            try:
                spec = space.build_spec(lambda name, values: trial.suggest_categorical(name, values), key, arch)
            except space.Invalid as e:
                _tell(study, trial, None, optuna.trial.TrialState.PRUNED, f"invalid: {e}")
                done_here += 1
                _advance(progress)
                continue
            trial.set_user_attr("spec", spec.name)
            asked.append((trial, spec))
        failures = objective.prepare([s for _, s in asked if s.name not in seen])
        for trial, spec in asked:
            if spec.name in seen:  # the sampler came back to a measured point: its figure stands
                value, number = seen[spec.name]
                _tell(study, trial, value, optuna.trial.TrialState.COMPLETE, None, repeat_of=number)
            elif spec.name in failures:
                _tell(study, trial, None, optuna.trial.TrialState.FAIL, failures[spec.name])
            else:
                try:
                    m = objective.measure(spec)
                except TrialFailed as e:
                    _tell(study, trial, None, optuna.trial.TrialState.FAIL, str(e))
                else:
                    trial.set_user_attr("bandwidth_pct", m.bandwidth_pct)
                    _tell(study, trial, m.us, optuna.trial.TrialState.COMPLETE, None)
                    seen[spec.name] = (m.us, trial.number)
            done_here += 1
            _advance(progress)


def _tell(study, trial, value, state, reason, repeat_of=None):
    if reason:
        trial.set_user_attr("reason", reason[:2000])
    if repeat_of is not None:
        trial.set_user_attr("repeat_of", repeat_of)
    study.tell(trial, value, state=state)


def _advance(progress):
    if progress is not None:
        progress.update(1)


def best_specs(study, key: TuneKey, arch: str, top: int) -> list:
    """The ``top`` fastest distinct candidates of the study's completed trials, fastest first."""
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
    per candidate. A candidate that fails here is dropped."""
    figures: dict = {None: []}
    for spec in candidates:
        figures[spec.name] = []
    specs = {s.name: s for s in candidates}
    for _ in range(rounds):
        for name in list(figures):
            try:
                figures[name].append(objective.measure(specs.get(name), iters=iters))
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
    """The study's entry: its best candidates confirmed against the built-in choice. With
    ``exhaustive_results`` (see `exhaustive`), the entry also says how the search compares."""
    candidates = [spec for spec, _ in best_specs(study, key, arch, top)]
    figures = confirm(objective, candidates, iters=iters)
    winner = min(figures, key=lambda name: (figures[name].us, name is not None))  # ties: built-in
    spec = next((s for s in candidates if s.name == winner), None)
    tuned, default = figures[winner], figures[None]
    compared = None
    if exhaustive_results is not None:
        compared = compare_with_exhaustive(study, exhaustive_results)
        compared["tuned_spec_us"] = None if spec is None else exhaustive_results.get(spec.name)
    entry = Entry(key, bucket, spec, tuned.us, default.us, tuned.bandwidth_pct, len(finished(study)), today(),
                  compared, tuned.detail.get("plan"))
    return Outcome(entry, trial_rows(study), {("built-in" if k is None else k): m.us for k, m in figures.items()},
                   objective.name)


def trial_rows(study) -> list:
    rows = []
    for t in study.get_trials(deepcopy=False):
        p = t.params
        chunk = p.get("warps", 0) * p.get("tile_tokens", 0) * p.get("chunk_tiles", 1)
        rows.append(dict(number=t.number, spec=t.user_attrs.get("spec"), variant=p.get("variant"), chunk_size=chunk,
                         us=t.value, state=t.state.name, reason=t.user_attrs.get("reason")))
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
                except TrialFailed:
                    results[spec.name] = None
            _advance(progress)
    return results


def compare_with_exhaustive(study, results: dict, within: float = 0.03) -> dict:
    """How the search did against the exhaustive figures: the best of both, and the first trial
    whose candidate is within ``within`` of the exhaustive best (by the exhaustive figures, so
    noise between the two runs does not count)."""
    measured = {name: us for name, us in results.items() if us is not None}
    best = min(measured.values())
    reached = None
    for t in sorted(finished(study), key=lambda t: t.number):
        us = measured.get(t.user_attrs.get("spec"))
        if us is not None and us <= best * (1 + within):
            reached = t.number + 1
            break
    return dict(best_us=round(best, 3), points=len(results), failed=len(results) - len(measured),
                trials_to_within_3pct=reached)
