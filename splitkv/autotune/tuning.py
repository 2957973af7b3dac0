"""Tuning the keys of one run (`TuneRun`, read once from the command line by `splitkv.autotune.cli`).

A key's studies (one per bucket) are searched together, then each is confirmed and its entry
written at once (`tune_key`). The table is written after every study, so what was finished is
never lost; a stopped run resumes from its storage (finished trials and confirmed entries are kept).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path

from ..tuned.keys import Bucket, TuneKey
from .objective import ContextLost, TrialFailed
from .progress import progress_bar
from .versions import code_version, planner_version, study_name

#: Exit status when a candidate left the GPU unusable (EX_TEMPFAIL: run it again to go on).
EXIT_CONTEXT_LOST = 75
#: A worker's index (from 1) among those of one run (mixed into its sampler's seed).
WORKER_ENV = "SPLITKV_TUNE_WORKER"


@dataclasses.dataclass(frozen=True)
class TuneRun:
    """What one tuning run does, read once from its command line."""

    arch: str
    keys: tuple                 # TuneKey, in the order they are tuned
    buckets: tuple              # Bucket
    trials: int                 # measured trials per study, counting those already in the storage
    iters: int                  # timed calls per measurement (twice as many when confirming)
    seed: int = 0
    timeout: float | None = None  # seconds per key's search
    storage: str | None = None  # the --storage value (None: in memory)
    study_prefix: str = ""
    out: Path | None = None     # the table's folder (None: the shipped tables; none for a cost-model run)
    report: Path | None = None
    exhaustive: bool = False
    cost_model: bool = False
    jobs: int | None = None     # candidates compiled at a time (None: the CPUs, shared among workers)
    argv: tuple = ()            # the command line, which workers are started with
    storage_handle: object = None  # the opened storage: one handle, since an in-memory study lives in it


class _Lazy:
    """A study's objective, built at its first use (its inputs cost GPU memory and seconds) and
    closed when its key is tuned, so that one key's inputs are never held beside the next's."""

    def __init__(self, build):
        self._build, self._objective = build, None

    def get(self):
        if self._objective is None:
            self._objective = self._build()
        return self._objective

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._objective is not None:
            self._objective.close()
            self._objective = None


class TableUnwritable(OSError):
    """The table cannot be written: the run stops (its trials are kept in --storage)."""


def table_path(run: TuneRun, gpu: dict) -> Path | None:
    """Where the table goes (None: a cost-model run without --out writes none)."""
    from ..tuned import tables
    from ..tuned.lookup import shipped_dir

    out_dir = run.out if run.out is not None or run.cost_model else shipped_dir()
    return None if out_dir is None else tables.table_path(out_dir, run.arch, gpu["name"])


def table_refusal(run: TuneRun, gpu: dict) -> str | None:
    """Why the table could not take this run's entries (asked before hours of tuning), or None."""
    from ..tuned import tables

    path = table_path(run, gpu)
    if path is None or not path.exists():
        return None
    try:
        old = tables.load(path)
    except tables.TableError as e:
        return f"the table there cannot be merged into: {e}; move it away or give --out"
    if old.gpu != gpu["name"] or old.arch != run.arch:
        return f"{path} holds {old.gpu} ({old.arch}), not {gpu['name']} ({run.arch}); give --out"
    if not os.access(path.parent, os.W_OK):
        return f"{path.parent} is not writable; give --out"
    return None


def header(run: TuneRun, gpu: dict) -> dict:
    """The table header of this run's GPU."""
    from .. import __version__
    from .writing import make_header

    return make_header(gpu["name"], run.arch, gpu["sm_count"], gpu["cuda_runtime"], gpu["nvrtc"], __version__)


def write_entries(run: TuneRun, gpu: dict, entries) -> None:
    """Merge ``entries`` into the run's table (none for a cost-model run without --out)."""
    from ..tuned import tables
    from .writing import save

    path = table_path(run, gpu)
    if path is None:
        return
    try:
        save(path, header(run, gpu), entries)
    except (OSError, tables.TableError) as e:
        raise TableUnwritable(f"cannot write the table {path}: {e}; give a writable folder with --out (the "
                              f"trials are kept in --storage, if one was given)") from e


def compile_jobs(jobs: int | None, workers: int = 1) -> int:
    """Candidates compiled at a time: ``--jobs``, else the host's CPUs shared among the workers."""
    return jobs if jobs is not None else max(1, (os.cpu_count() or 1) // max(1, workers))


def _objective(run: TuneRun, key: TuneKey, bucket: Bucket) -> _Lazy:
    if run.cost_model:
        from .costmodel import CostModelObjective

        return _Lazy(lambda: CostModelObjective(key, bucket, run.arch))
    from .measure import GpuObjective

    return _Lazy(lambda: GpuObjective(key, bucket, iters=run.iters, seed=run.seed, jobs=compile_jobs(run.jobs)))


def run_study_name(run: TuneRun, gpu: dict, key: TuneKey, bucket: Bucket) -> str:
    return study_name(run.study_prefix, gpu["name"], run.arch, key, bucket, code_version())


def open_run_study(run: TuneRun, gpu: dict, key: TuneKey, bucket: Bucket):
    from . import search, studies

    study = studies.open_study(run_study_name(run, gpu, key, bucket), run.storage_handle, run.seed,
                               worker=int(os.environ.get(WORKER_ENV, "0")))
    search.enqueue_defaults(study, key, bucket, run.arch)
    return study


def confirmation_settings(run: TuneRun) -> dict:
    """What a study's confirmation depends on beyond its trials (see `studies.save_outcome`): the
    run's options, and the planner's code (a changed planner plans the candidates anew)."""
    return dict(iters=run.iters, exhaustive=bool(run.exhaustive), cost_model=bool(run.cost_model),
                planner=planner_version())


def tune_key(run: TuneRun, gpu: dict, key: TuneKey, overall, progress: bool) -> tuple[list, int]:
    """Tune the key's studies, one per bucket: search them together (`search.run_studies`), then
    confirm each and write its entry at once. A study whose outcome the storage already holds (a
    worker's, or a stopped run's) is taken as it is. Returns (outcomes, studies that failed)."""
    from . import search, studies

    settings = confirmation_settings(run)
    opened = {b: open_run_study(run, gpu, key, b) for b in run.buckets}
    outcomes, failed, todo = {}, 0, []
    for bucket in run.buckets:
        saved = studies.saved_outcome(opened[bucket], run.arch, run.trials, settings)
        if saved is None:
            todo.append(bucket)
        else:
            outcomes[bucket] = saved
        if overall is not None:
            overall.update(min(len(studies.measured(opened[bucket])), run.trials))
    with contextlib.ExitStack() as stack:
        objectives = {b: stack.enter_context(_objective(run, key, b)) for b in todo}
        searching = []
        for bucket in list(todo):
            if len(studies.measured(opened[bucket])) >= run.trials:
                continue
            try:
                searching.append((bucket, objectives[bucket].get()))
            except ContextLost:
                raise
            except Exception as e:  # noqa: BLE001 - e.g. no memory for this bucket's inputs: the others go on
                print(f"splitkv-gen: {key.label} {bucket.name}: {type(e).__name__}: {e}; nothing is written for it",
                      file=sys.stderr)
                failed += 1
                todo.remove(bucket)
        if searching:
            done = sum(min(len(studies.measured(opened[b])), run.trials) for b, _ in searching)
            bar = progress_bar(progress, total=len(searching) * run.trials, initial=done, position=1, leave=False,
                               desc=f"{key.label} " + ",".join(b.name for b, _ in searching))
            try:
                search.run_studies([(opened[b], objective, Bars(bar, overall)) for b, objective in searching],
                                   key, run.arch, trials=run.trials, timeout=run.timeout)
            except ContextLost:
                raise
            except Exception as e:  # noqa: BLE001 - said; the next key goes on
                print(f"splitkv-gen: {key.label}: the search failed ({type(e).__name__}: {e}); nothing is written "
                      f"for {', '.join(b.name for b, _ in searching)}", file=sys.stderr)
                failed += len(searching)
                todo = [b for b in todo if b not in dict(searching)]
            finally:
                if bar is not None:
                    bar.close()
        for bucket in todo:
            outcome = _confirmed_or_said_why(run, key, bucket, opened[bucket], objectives[bucket])
            if outcome is None:
                failed += 1
                continue
            studies.save_outcome(opened[bucket], outcome, settings, run.trials)
            write_entries(run, gpu, [outcome.entry])
            outcomes[bucket] = outcome
    return [outcomes[b] for b in run.buckets if b in outcomes], failed


def _confirmed_or_said_why(run: TuneRun, key: TuneKey, bucket: Bucket, study, objective: _Lazy):
    """`_outcome`, with its failures said (None); a lost GPU context is raised."""
    try:
        return _outcome(run, key, bucket, study, objective)
    except ContextLost:
        raise
    except TrialFailed as e:  # the built-in choice itself failed here: say so, go on
        print(f"splitkv-gen: {key.label} {bucket.name}: the built-in choice failed, so nothing is written "
              f"for it: {e}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - e.g. no memory for this bucket's inputs: the next may fit
        print(f"splitkv-gen: {key.label} {bucket.name}: {type(e).__name__}: {e}; nothing is written for it",
              file=sys.stderr)
    return None


def _outcome(run: TuneRun, key: TuneKey, bucket: Bucket, study, objective: _Lazy):
    """One searched study's outcome, or None when no candidate succeeded."""
    from . import confirm, space

    if not confirm.best_specs(study, key, run.arch, 1):
        print(f"splitkv-gen: {key.label} {bucket.name}: no candidate succeeded; nothing written for it",
              file=sys.stderr)
        return None
    results = None
    if run.exhaustive:
        bar = progress_bar(True, total=len(space.enumerate_specs(key, run.arch)[0]),
                           desc=f"exhaustive {key.label} {bucket.name}", position=0)
        results = confirm.exhaustive(key, run.arch, objective.get(), progress=bar)
        if bar is not None:
            bar.close()
    return confirm.finish(study, key, bucket, run.arch, objective.get(), iters=run.iters * 2,
                          exhaustive_results=results)


def context_lost(e) -> int:
    print(f"splitkv-gen: the GPU can run nothing more in this process: {e}\nThe candidate that did it is "
          f"recorded as failed; run the same command again (same --storage) to go on past it.", file=sys.stderr)
    return EXIT_CONTEXT_LOST


def tune_all(run: TuneRun, gpu: dict) -> int:
    """Tune every key (`tune_key`; after workers, mostly reading their outcomes back), print the
    summary, write the report."""
    outcomes, failed = [], 0
    overall = progress_bar(True, total=len(run.keys) * len(run.buckets) * run.trials, desc="all studies",
                           position=0)
    try:
        for key in run.keys:
            done, broke = tune_key(run, gpu, key, overall, progress=True)
            outcomes += done
            failed += broke
    except ContextLost as e:
        return context_lost(e)
    except TableUnwritable as e:
        print(f"splitkv-gen: {e}", file=sys.stderr)
        return 2
    finally:
        if overall is not None:
            overall.close()
    from .report import format_summary

    print(format_summary([o.entry for o in outcomes], [o.seconds for o in outcomes]))
    if run.cost_model:
        print("(a dry run: every µs above is the cost model's prediction; nothing was measured on a GPU)")
    path = table_path(run, gpu)
    if path is not None and outcomes:
        write_entries(run, gpu, [o.entry for o in outcomes])  # outcomes read back may come from another --out
        print(f"wrote {len(outcomes)} entries to {path}", file=sys.stderr)
    if run.report is not None and outcomes:
        from . import report

        sweeps = {} if run.cost_model else _sweeps(outcomes, path.parent.parent)
        written = report.write(run.report, outcomes, header(run, gpu), sweeps)
        print(f"wrote the report to {written}", file=sys.stderr)
    return 0 if outcomes and not failed else 1


def _sweeps(outcomes, table_dir) -> dict:
    """The report's bandwidth sweep of every tuned key the benchmark's inputs cover, with the table
    just written (see `sweep`); {} without torch, which the benchmark's inputs and peers need."""
    from ..tuned import lookup
    from . import sweep

    try:
        import torch  # noqa: F401 - only whether it is there
    except ImportError:
        print("splitkv-gen: --report: no bandwidth sweep without torch (the benchmark's inputs and peers)",
              file=sys.stderr)
        return {}
    keys = list(dict.fromkeys(o.entry.key for o in outcomes if sweep.sweepable(o.entry.key)))
    previous = os.environ.get(lookup.ENV_DIR)
    os.environ[lookup.ENV_DIR] = str(table_dir)  # the runtime reads the table just written
    lookup.forget()
    try:
        bar = progress_bar(True, total=len(keys), desc="bandwidth sweep", position=0)
        sweeps = {}
        for key in keys:
            try:
                sweeps[key.label] = sweep.sweep(key)
            except Exception as e:  # noqa: BLE001 - the table is written; the report goes on without it
                print(f"splitkv-gen: --report: the bandwidth sweep of {key.label} failed "
                      f"({type(e).__name__}: {e}); its plot is left out", file=sys.stderr)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return sweeps
    finally:
        if previous is None:
            os.environ.pop(lookup.ENV_DIR, None)
        else:
            os.environ[lookup.ENV_DIR] = previous
        lookup.forget()


def tune_unit_costs(run: TuneRun, gpu: dict) -> int:
    """``--unit-costs``: search the work-unit planner's costs on this GPU (`unit_costs`), print what
    was kept against the built-in costs per workload, and merge them into the table."""
    from ..tuned import tables
    from . import unit_costs
    from .writing import save, today

    print(f"tuning the work-unit planner's costs on {gpu['name']} ({run.arch}): {len(unit_costs.WORKLOADS)} "
          f"workloads, {run.trials} distinct plans at most", file=sys.stderr)
    measure = unit_costs.GpuMeasure(iters=run.iters, seed=run.seed)
    try:
        outcome = unit_costs.search(measure, measure.plans, trials=run.trials, seed=run.seed)
    except ContextLost as e:
        print(f"splitkv-gen: the GPU can run nothing more in this process: {e}\nNothing was written; run "
              f"the search again (it keeps no storage).", file=sys.stderr)
        return EXIT_CONTEXT_LOST
    except RuntimeError as e:
        print(f"splitkv-gen: {e}", file=sys.stderr)
        return 1
    finally:
        measure.close()
    print(f"{'workload':24s} {'built-in µs':>12s} {'tuned µs':>9s}")
    for name, (tuned, prior) in outcome.workloads_us.items():
        print(f"{name:24s} {prior:12.2f} {tuned:9.2f}")
    kept = "the built-in costs" if outcome.costs == unit_costs.PRIOR_COSTS else "tuned costs"
    print(f"geometric mean: {outcome.default_us:.2f} µs built-in, {outcome.tuned_us:.2f} µs with {kept}: "
          f"{outcome.costs.as_dict()}")
    result = tables.UnitCosts(outcome.costs, outcome.tuned_us, outcome.default_us, outcome.trials, today(),
                              tuple(name for name, _ in unit_costs.WORKLOADS))
    path = table_path(run, gpu)
    if path is None:
        return 0
    try:
        # The header describes the kernel entries' run (versions, date): a table that has one keeps
        # it, since no kernel was measured here (the costs carry their own date).
        kept_header = tables.load(path).header if path.exists() else header(run, gpu)
        save(path, kept_header, [], unit_costs=result)
    except (OSError, tables.TableError) as e:
        print(f"splitkv-gen: cannot write the table {path}: {e}; give a writable folder with --out", file=sys.stderr)
        return 1
    print(f"wrote unit_costs to {path}", file=sys.stderr)
    return 0


class Bars:
    """Several progress bars advanced together (None: no bar)."""

    def __init__(self, *bars):
        self.bars = [b for b in bars if b is not None]

    def update(self, n):
        for b in self.bars:
            b.update(n)

