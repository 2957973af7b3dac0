"""The Optuna studies of a tuning run: where they live, what they hold, and how processes share them.

Resumable and shareable: a study lives in the Optuna storage given (an SQLite or PostgreSQL URL, a
journal file, or memory). Every told trial is in the storage at once, so a run that is killed loses
at most the trials it was measuring; a later run (or another worker on the same storage) counts the
measured trials and runs only the rest; a program two processes both measured counts once.
Trials a killed process left RUNNING on this host are failed as interrupted when the study is next
searched here (they do not count), and their candidates are queued again. A confirmed
outcome is kept in its study (`save_outcome`), and a process tuning a key marks it (`claim`), so
that workers tune keys apart and the parent of the workers reads their entries back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
import warnings
from pathlib import Path

from ..tuned.tables import Entry

#: Asks per study at most, as a multiple of the trials asked for (invalid or repeated candidates
#: are asked for again, but not forever: a small space runs out of new candidates). Candidates in
#: flight make the sampler return to points more often than batches told at once did.
MAX_ASKS = 10
HOST = socket.gethostname()

#: Prefix of the study attributes holding one process's seconds per phase (see `PhaseClock`).
SECONDS_ATTR = "seconds"

#: Prefix of the study attributes naming each process that asked for trials of it (host and pid),
#: written before its first ask (see `fail_interrupted`).
ASKER_ATTR = "asker"

#: The phases, in the order the summary shows them: asking the sampler, waiting for candidates to
#: compile (the GPU idle), measuring them (planning, checking against the reference, timing),
#: confirming the winner. Not counted: building the study's inputs, storage reads, `exhaustive`.
PHASES = ("sample", "compile", "measure", "confirm")

#: Study attribute holding the confirmed outcome (see `save_outcome`).
OUTCOME_ATTR = "outcome"

#: Study attribute naming the process tuning the study (see `claim`).
CLAIM_ATTR = "claim"

#: Trial attribute of a candidate queued again after its trial was interrupted: that trial's number
#: (see `mark_interrupted`).
RETRY_ATTR = "retry_of"


def import_optuna():
    try:
        import optuna
    except ImportError as e:
        raise ImportError("splitkv-gen --tune needs Optuna: pip install 'splitkv[tune]'") from e
    return optuna


class PhaseClock:
    """Seconds this process spends on a study, per phase; `flush` adds them to the study's attribute
    of this process (one per host and pid, so workers never overwrite each other, and a killed run
    keeps what it flushed)."""

    def __init__(self, study):
        self.study = study
        self.attr = f"{SECONDS_ATTR} {HOST} {os.getpid()}"
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


def open_study(name: str, storage, seed: int | None = None, worker: int = 0):
    """The study ``name`` in ``storage`` (see `make_storage`), created if it does not exist. Its
    sampler's seed mixes ``seed`` with ``worker`` and the trials already there, so a resumed run
    or a second worker does not propose the first one's candidates again."""
    optuna = import_optuna()
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
    optuna = import_optuna()
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
    optuna = import_optuna()
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED)
    return study.get_trials(deepcopy=False, states=done)


def measured(study) -> list:
    """The finished trials that measured a candidate (or failed trying), one per program launched
    (the first): what ``trials`` counts. Processes sharing a study may each measure a program
    before the other has told it (the built-in split and dense programs, which often launch the
    same, are the first trials both ask for): it counts once, so that a study ends with as many
    distinct programs as asked for."""
    optuna = import_optuna()
    counted, programs = [], set()
    for t in finished(study):
        if "repeat_of" in t.user_attrs or not (
                t.state == optuna.trial.TrialState.COMPLETE
                or (t.state == optuna.trial.TrialState.FAIL and "interrupted" not in t.user_attrs)):
            continue
        # What it launched (`Objective.runs`), else its candidate (a compile failure: it launched nothing).
        program = t.user_attrs.get("runs", t.user_attrs.get("spec", t.number))
        if program not in programs:
            programs.add(program)
            counted.append(t)
    return counted


def fail_interrupted(study) -> int:
    """Fail the trials a process of this host left RUNNING and is no longer there to finish
    (killed mid-batch); returns how many. Trials of live processes and other hosts are left.

    A trial names its process (user attributes host and pid) only once `_ask` has written them,
    journal records after Optuna made it RUNNING: a process killed in between leaves a RUNNING
    trial that names no process, or only its host. Such a trial is failed when the processes that
    asked for trials of the study (`ASKER_ATTR`) are all of this host and gone; while one of them
    may be alive, it may be between those records itself, and the trial is left to a later run."""
    optuna = import_optuna()
    askers = [(owner.get("host"), owner.get("pid")) for attr, owner in study.user_attrs.items()
              if attr.startswith(ASKER_ATTR + " ") and isinstance(owner, dict)]
    askers_gone = bool(askers) and all(host == HOST and not _alive(pid) for host, pid in askers)
    failed = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if "pid" in t.user_attrs:
            if t.user_attrs.get("host") != HOST or _alive(t.user_attrs["pid"]):
                continue
        elif not askers_gone:
            continue
        mark_interrupted(study, t)
        failed += 1
    return failed


def mark_interrupted(study, trial) -> None:
    """Tell a RUNNING trial (a Trial or a FrozenTrial) failed and interrupted: it does not count.
    Its candidate, when it had one, is queued again (`RETRY_ATTR`), so that the search goes on with
    what was left unmeasured: the sampler need not come back to it, and a queued candidate (a
    built-in program) would be lost. Once only: a candidate interrupted on its retry too may be
    what ends the process, and is left."""
    storage = study._storage
    asked = storage.get_trial(trial._trial_id)
    storage.set_trial_user_attr(trial._trial_id, "interrupted", True)
    study.tell(trial.number, state=import_optuna().trial.TrialState.FAIL)
    if "spec" in asked.user_attrs and RETRY_ATTR not in asked.user_attrs:  # "spec": its params are complete
        again = {RETRY_ATTR: asked.number}
        if "builtin" in asked.user_attrs:
            again["builtin"] = asked.user_attrs["builtin"]
        study.enqueue_trial(asked.params, user_attrs=again)


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
    study.set_user_attr(CLAIM_ATTR, dict(host=HOST, pid=os.getpid(), run=run))


def claimed_elsewhere(study, run: str) -> bool:
    """Whether another worker of the same ``run`` (one parent's workers) claimed the study and may
    still be tuning it: a live process of this host, or any of another host (which this one cannot
    see). Claims of other runs are stale (a killed run, another container): ignored."""
    owner = study.user_attrs.get(CLAIM_ATTR)
    if not isinstance(owner, dict) or owner.get("run") != run \
            or (owner.get("host"), owner.get("pid")) == (HOST, os.getpid()):
        return False
    return owner.get("host") != HOST or _alive(owner.get("pid"))


def trial_rows(study) -> list:
    rows = []
    for t in study.get_trials(deepcopy=False):
        p = t.params
        chunk = p.get("warps", 0) * p.get("tile_tokens", 0) * p.get("chunk_tiles", 1)
        rows.append(dict(number=t.number, spec=t.user_attrs.get("spec"), variant=p.get("variant"), chunk_size=chunk,
                         us=t.value, state=t.state.name, reason=t.user_attrs.get("reason"),
                         repeat_of=t.user_attrs.get("repeat_of")))
    return rows

