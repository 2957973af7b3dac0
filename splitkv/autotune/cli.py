"""`splitkv-gen --arch sm90 --tune ...`: tune every (key, bucket) asked for, write the table.

A key's studies (one per bucket) are searched together, then each is confirmed and its entry
written at once (`_tune_key`). In one process by default, on the current GPU. ``--devices 0,1``
starts one worker process per listed GPU (a GPU may be listed twice: two workers share it); each
worker tunes whole keys, starting at its share of the key list and leaving a key another live
worker claimed, and keeps each confirmed entry in ``--storage``; this process then reads the
entries back, tunes whatever a stopped worker left, and prints the summary. A run that is stopped
resumes from the storage: finished trials and confirmed entries are kept, and the table is written
after every study, so what was finished is never lost.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import spec as spec_module
from .keys import BUCKETS, TuneKey, code_version, parse_bucket, planner_version, study_name
from .lookup import COST_MODEL_GPU

#: Head dims, groups of the default tuning run (the shipped table); every K/V dtype of the arch.
DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_GROUPS = (1, 4, 8)
#: What the shipped H200 table was tuned with: `splitkv-gen --arch sm90 --tune` reproduces it.
DEFAULT_TRIALS = 20
DEFAULT_ITERS = 20
WORKER_FLAG = "--tune-worker"
#: A worker's index (from 1) among those of one run (mixed into its sampler's seed), and their number.
WORKER_ENV = "SPLITKV_TUNE_WORKER"
WORKERS_ENV = "SPLITKV_TUNE_WORKERS"
#: The run a worker belongs to (its parent's host, pid and start), which its claims carry.
RUN_ENV = "SPLITKV_TUNE_RUN"
#: Exit status when a candidate left the GPU unusable (EX_TEMPFAIL: run it again to go on).
EXIT_CONTEXT_LOST = 75
#: Times a worker whose context was lost is started again.
WORKER_RESTARTS = 3


def keys_for(arch: str, head_dims, group_sizes, kv_dtypes, page_sizes, kv_layout) -> list[TuneKey]:
    """The keys to tune: 16-bit K/V with queries of their own type, quantized ones with bf16 queries."""
    head_dims = head_dims or DEFAULT_HEAD_DIMS
    group_sizes = group_sizes or DEFAULT_GROUPS
    kv_dtypes = kv_dtypes or tuple(d for d in spec_module.KV_DTYPES if d not in spec_module.QUANTIZED_KV_DTYPES
                                   or spec_module.arch_number(arch) >= 89)
    keys = []
    for kv_dtype in kv_dtypes:
        q_dtype = kv_dtype if kv_dtype in spec_module.Q_DTYPES else "bf16"
        for head_dim in head_dims:
            if kv_dtype == "nvfp4" and head_dim % 64:
                continue
            for group in group_sizes:
                for page_size in page_sizes or (0,):
                    keys.append(TuneKey(head_dim, group, q_dtype, kv_dtype, page_size,
                                        kv_layout if page_size else "NHD"))
    return keys


def add_arguments(p) -> None:
    g = p.add_argument_group("tuning (--tune)")
    g.add_argument("--trials", type=int, default=DEFAULT_TRIALS, metavar="N",
                   help=f"trials per study, counting those already in --storage (default {DEFAULT_TRIALS})")
    g.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop a key's search (its buckets' studies together) after S seconds")
    g.add_argument("--storage", default=None, metavar="URL",
                   help="Optuna storage shared by workers and resumed runs: sqlite:///tune.db, postgresql://..., "
                        "or a journal file (tune.log)")
    g.add_argument("--study", default="", metavar="NAME", help="prefix of the study names (default none)")
    g.add_argument("--devices", default=None, metavar="0,1",
                   help="one worker process per listed GPU (a GPU listed twice runs two workers); needs --storage")
    g.add_argument("--bucket", dest="buckets", action="append", metavar="NAME,...",
                   help="workload buckets, e.g. b1-l32k (default: " + ",".join(b.name for b in BUCKETS) + ")")
    g.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write the table under DIR/<arch>/ (default: the package's tuned_configs)")
    g.add_argument("--report", type=Path, default=None, metavar="DIR", help="write plots and a markdown summary to DIR")
    g.add_argument("--report-from", type=Path, default=None, metavar="TABLE",
                   help="write --report DIR from TABLE's entries and the trials in --storage, measuring nothing "
                        "(no GPU needed): the report of a run stopped before it wrote one")
    g.add_argument("--exhaustive", action="store_true",
                   help="also measure every candidate of each study's space, and record how the search compares")
    g.add_argument("--iters", type=int, default=DEFAULT_ITERS, metavar="N",
                   help=f"timed calls per measurement, twice as many when confirming (default {DEFAULT_ITERS})")
    g.add_argument("--seed", type=int, default=0, help="sampler and input seed (default 0)")
    g.add_argument("--unit-costs", action="store_true",
                   help="tune the work-unit planner's costs for this GPU (unit overhead, merge costs, split "
                        "threshold) on ragged batches, instead of the kernel keys; --trials counts the distinct "
                        "plans measured; writes the table's unit_costs")
    g.add_argument("--cost-model", action="store_true",
                   help="score candidates with the cost model instead of the GPU (a dry run: figures are "
                        "predictions, and no table is written unless --out is given)")
    g.add_argument(WORKER_FLAG, dest="tune_worker", action="store_true", help=argparse.SUPPRESS)  # workers' own


def run(args, parser, arch: str, head_dims, group_sizes, kv_dtypes, page_sizes) -> int:
    from . import search

    if args.trials < 1:
        parser.error(f"--trials: expected a positive number, got {args.trials}")
    for flag, given in (("--emit", args.emit is not None), ("--list", args.list)):
        if given:  # they name the built-in programs to compile; a tuning run compiles its candidates
            parser.error(f"{flag} does not go with --tune")
    try:
        buckets = [parse_bucket(b.strip()) for group in (args.buckets or []) for b in group.split(",") if b.strip()] \
            or list(BUCKETS)
    except ValueError as e:
        parser.error(f"--{e}")
    if arch != f"sm_{spec_module.arch_number(arch)}":
        parser.error(f"--arch: tune {arch.rstrip('a')}, not {arch}: the runtime looks tables up by the GPU's "
                     f"compute capability, and arch-specific programs are not tuned separately")
    keys = keys_for(arch, head_dims, group_sizes, kv_dtypes, page_sizes, args.kv_layout)
    if args.report_from is not None and (args.report is None or args.storage is None):
        parser.error("--report-from: give the --report DIR to write and the --storage the run used")
    devices = _devices(parser, args.devices)
    workers = bool(devices) and (len(devices) > 1 or devices[0] != 0)
    if workers and not args.storage:
        parser.error("--devices: workers share their studies through --storage (e.g. --storage tune.log)")
    try:
        search._optuna()
    except ImportError as e:
        print(f"splitkv-gen: {e}", file=sys.stderr)
        return 2
    if args.unit_costs:  # a search of its own: the kernel search's flags would be ignored, so they are refused
        for flag, given in (("--cost-model", args.cost_model), ("--devices", bool(devices)),
                            ("--exhaustive", args.exhaustive), ("--report", args.report is not None),
                            ("--report-from", args.report_from is not None), ("--storage", bool(args.storage)),
                            ("--timeout", args.timeout is not None), ("--study", bool(args.study)),
                            ("--bucket", bool(args.buckets)), ("--head-dim", bool(args.head_dims)),
                            ("--group", bool(args.group_sizes)), ("--dtype", bool(args.kv_dtypes)),
                            ("--page-size", bool(args.page_sizes))):
            if given:
                parser.error(f"{flag} does not go with --unit-costs (one short search on the current GPU)")
    if args.report_from is not None:
        return _report_from(args, arch, set(keys), {b.name for b in buckets})
    if workers and not args.cost_model:  # this process confirms the winners on the first listed GPU
        import cupy

        try:
            cupy.cuda.Device(devices[0]).use()
        except Exception as e:  # noqa: BLE001 - no driver, no such device
            print(f"splitkv-gen: --devices {args.devices}: GPU {devices[0]} is not usable here "
                  f"({type(e).__name__}: {e})", file=sys.stderr)
            return 2
    gpu = _check_gpu(arch, args.cost_model)
    if isinstance(gpu, int):
        return gpu
    problem = _check_table(args, arch, gpu)
    if problem:
        print(f"splitkv-gen: {problem}", file=sys.stderr)
        return 2
    if args.unit_costs:
        return _tune_unit_costs(args, arch, gpu)
    args.storage_handle = search.make_storage(args.storage)  # one handle: an in-memory study lives in it
    print(f"tuning {len(keys)} keys x {len(buckets)} buckets = {len(keys) * len(buckets)} studies of "
          f"{args.trials} trials on {gpu['name']} ({arch})", file=sys.stderr)
    if args.tune_worker:
        return _work(args, arch, gpu, keys, buckets)
    workers_rc = 0
    if workers:
        workers_rc = _run_workers(args, devices, [_study_name(args, gpu, arch, k, b) for k in keys for b in buckets])
    # The workers' outcomes are read back from the storage; what they left (nothing, unless one
    # stopped early) is tuned here.
    return _tune_all(args, arch, gpu, keys, buckets) or workers_rc


def _report_from(args, arch, keys, bucket_names) -> int:
    """--report-from: the report of the table's entries of this run's keys and buckets, with each
    study's trials read from --storage; nothing is measured (no confirmation figures, no sweeps)."""
    from . import report, search, tables

    try:
        table = tables.load(args.report_from)
    except (OSError, tables.TableError) as e:
        print(f"splitkv-gen: --report-from: {e}", file=sys.stderr)
        return 2
    if table.arch != arch:
        print(f"splitkv-gen: --report-from: {args.report_from} is a table of {table.arch}, not {arch}", file=sys.stderr)
        return 2
    journal = search.journal_path(args.storage)
    if journal is not None and not journal.is_file():
        print(f"splitkv-gen: --storage: no journal file {journal}", file=sys.stderr)
        return 2
    entries = [e for e in table.entries if e.key in keys and e.bucket.name in bucket_names]
    try:
        storage = search.make_storage(args.storage)
        outcomes, missing = report.outcomes_from_storage(entries, table, storage, args.study)
    except Exception as e:  # noqa: BLE001 - an RDB URL that does not connect, a journal that does not parse
        print(f"splitkv-gen: --storage {args.storage}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for e in missing:
        print(f"splitkv-gen: {e.key.label} {e.bucket.name}: no study of it in {args.storage}; left out of the report",
              file=sys.stderr)
    if not outcomes:
        print("splitkv-gen: --report-from: no entry of the table has its study in --storage; nothing written",
              file=sys.stderr)
        return 1
    written = report.write(args.report, outcomes, table.header, {})
    print(f"wrote the report of {len(outcomes)} entries to {written}", file=sys.stderr)
    return 0


def _devices(parser, text):
    if text is None:
        return None
    try:
        devices = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--devices: expected comma-separated GPU ordinals, got {text!r}")
    if not devices or min(devices) < 0:
        parser.error(f"--devices: expected comma-separated GPU ordinals, got {text!r}")
    return devices


def _check_gpu(arch: str, cost_model: bool):
    """The local GPU's name, SM count, versions; an exit status when it is not of ``arch``."""
    if cost_model:
        return dict(name=COST_MODEL_GPU, sm_count=132, cuda_runtime="n/a", nvrtc="n/a")
    try:
        from ..timing import gpu_info

        info = gpu_info()
    except Exception as e:  # noqa: BLE001 - no driver, no device
        print(f"splitkv-gen: --tune measures on a GPU of {arch}, and none is usable here "
              f"({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    if spec_module.arch_number(info["arch"]) != spec_module.arch_number(arch):
        print(f"splitkv-gen: --arch {arch} asks for tuning on {arch}, but this GPU ({info['name']}) is "
              f"{info['arch']}; tune each arch on its own GPUs", file=sys.stderr)
        return 2
    return dict(name=info["name"], sm_count=info["sm_count"], cuda_runtime=info["cuda_runtime_version"],
                nvrtc=info["nvrtc_version"] or "unknown")


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


def _table_path(args, arch, gpu):
    """Where the table goes (None: a cost-model run without --out writes none)."""
    from . import tables
    from .lookup import shipped_dir

    out_dir = args.out if args.out is not None or args.cost_model else shipped_dir()
    return None if out_dir is None else tables.table_path(out_dir, arch, gpu["name"])


def _check_table(args, arch, gpu) -> str | None:
    """Why the table could not take this run's entries (before hours of tuning), or None."""
    from . import tables

    path = _table_path(args, arch, gpu)
    if path is None or not path.exists():
        return None
    try:
        old = tables.load(path)
    except tables.TableError as e:
        return f"the table there cannot be merged into: {e}; move it away or give --out"
    if old.gpu != gpu["name"] or old.arch != arch:
        return f"{path} holds {old.gpu} ({old.arch}), not {gpu['name']} ({arch}); give --out"
    if not os.access(path.parent, os.W_OK):
        return f"{path.parent} is not writable; give --out"
    return None


def _objective(args, key, bucket, arch) -> _Lazy:
    if args.cost_model:
        from .costmodel import CostModelObjective

        return _Lazy(lambda: CostModelObjective(key, bucket, arch))
    from .measure import GpuObjective

    return _Lazy(lambda: GpuObjective(key, bucket, iters=args.iters, seed=args.seed, jobs=compile_jobs(args.jobs)))


def compile_jobs(jobs: int | None, workers: int = 1) -> int:
    """Candidates compiled at a time: ``--jobs``, else the host's CPUs shared among the workers."""
    return jobs if jobs is not None else max(1, (os.cpu_count() or 1) // max(1, workers))


def _study_name(args, gpu, arch, key, bucket) -> str:
    return study_name(args.study, gpu["name"], arch, key, bucket, code_version())


def _study(args, gpu, arch, key, bucket):
    from . import search

    study = search.open_study(_study_name(args, gpu, arch, key, bucket), args.storage_handle, args.seed,
                              worker=int(os.environ.get(WORKER_ENV, "0")))
    search.enqueue_defaults(study, key, bucket, arch)
    return study


def _work(args, arch, gpu, keys, buckets) -> int:
    """What a worker does: tune keys (search, confirm, write) until none is left that no other
    worker of its run has claimed. Worker i of N starts at the i-th N-th of the keys and goes round,
    so the workers start apart and meet only at the end; a key another live worker of the run
    claimed is left to it (claims of other runs are stale: see `search.claimed_elsewhere`)."""
    from . import search
    from .objective import ContextLost

    index = max(1, int(os.environ.get(WORKER_ENV, "1")))
    count = max(index, int(os.environ.get(WORKERS_ENV, "1")))
    run = os.environ.get(RUN_ENV, f"{index} of {count}")
    first = (index - 1) * len(keys) // count
    failed = 0
    try:
        for key in keys[first:] + keys[:first]:
            lead = _study(args, gpu, arch, key, buckets[0])
            if search.claimed_elsewhere(lead, run):
                continue
            search.claim(lead, run)
            failed += _tune_key(args, gpu, arch, key, buckets, overall=None, progress=False)[1]
    except ContextLost as e:
        return _context_lost(e)
    except _TableUnwritable as e:
        print(f"splitkv-gen: {e}", file=sys.stderr)
        return 2
    return 1 if failed else 0


class _TableUnwritable(OSError):
    """The table cannot be written: the run stops (its trials are kept in --storage)."""


def _settings(args) -> dict:
    """What a study's confirmation depends on beyond its trials (see `search.save_outcome`): the
    run's options, and the planner's code (a changed planner plans the candidates anew)."""
    return dict(iters=args.iters, exhaustive=bool(args.exhaustive), cost_model=bool(args.cost_model),
                planner=planner_version())


def _tune_key(args, gpu, arch, key, buckets, overall, progress: bool) -> tuple[list, int]:
    """Tune the key's studies, one per bucket: search them together (`search.run_studies`), then
    confirm each and write its entry at once. A study whose outcome the storage already holds (a
    worker's, or a stopped run's) is taken as it is. Returns (outcomes, studies that failed)."""
    import contextlib

    from . import search
    from .objective import ContextLost

    settings = _settings(args)
    studies = {b: _study(args, gpu, arch, key, b) for b in buckets}
    outcomes, failed, todo = {}, 0, []
    for bucket in buckets:
        saved = search.saved_outcome(studies[bucket], arch, args.trials, settings)
        if saved is None:
            todo.append(bucket)
        else:
            outcomes[bucket] = saved
        if overall is not None:
            overall.update(min(len(search.measured(studies[bucket])), args.trials))
    with contextlib.ExitStack() as stack:
        objectives = {b: stack.enter_context(_objective(args, key, b, arch)) for b in todo}
        searching = []
        for bucket in list(todo):
            if len(search.measured(studies[bucket])) >= args.trials:
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
            done = sum(min(len(search.measured(studies[b])), args.trials) for b, _ in searching)
            bar = _bar(progress, total=len(searching) * args.trials, initial=done, position=1, leave=False,
                       desc=f"{key.label} " + ",".join(b.name for b, _ in searching))
            try:
                search.run_studies([(studies[b], objective, _Both(bar, overall)) for b, objective in searching],
                                   key, arch, trials=args.trials, timeout=args.timeout)
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
            outcome = _confirmed(args, arch, key, bucket, studies[bucket], objectives[bucket])
            if outcome is None:
                failed += 1
                continue
            search.save_outcome(studies[bucket], outcome, settings, args.trials)
            _write(args, arch, gpu, [outcome.entry])
            outcomes[bucket] = outcome
    return [outcomes[b] for b in buckets if b in outcomes], failed


def _header(arch, gpu) -> dict:
    """The table header of this run's GPU."""
    from . import tables

    return tables.make_header(gpu["name"], arch, gpu["sm_count"], gpu["cuda_runtime"], gpu["nvrtc"], _version())


def _confirmed(args, arch, key, bucket, study, objective):
    """`_finish`, with its failures said (None); a lost GPU context is raised."""
    from .objective import ContextLost, TrialFailed

    try:
        return _finish(args, arch, key, bucket, study, objective)
    except ContextLost:
        raise
    except TrialFailed as e:  # the built-in choice itself failed here: say so, go on
        print(f"splitkv-gen: {key.label} {bucket.name}: the built-in choice failed, so nothing is written "
              f"for it: {e}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - e.g. no memory for this bucket's inputs: the next may fit
        print(f"splitkv-gen: {key.label} {bucket.name}: {type(e).__name__}: {e}; nothing is written for it",
              file=sys.stderr)
    return None


def _write(args, arch, gpu, entries) -> None:
    """Merge ``entries`` into the run's table (none for a cost-model run without --out)."""
    from . import tables

    path = _table_path(args, arch, gpu)
    if path is None:
        return
    try:
        tables.save(path, _header(arch, gpu), entries)
    except (OSError, tables.TableError) as e:
        raise _TableUnwritable(f"cannot write the table {path}: {e}; give a writable folder with --out (the "
                               f"trials are kept in --storage, if one was given)") from e


def _tune_unit_costs(args, arch, gpu) -> int:
    """``--unit-costs``: search the work-unit planner's costs on this GPU (`unit_costs`), print what
    was kept against the built-in costs per workload, and merge them into the table."""
    from . import tables, unit_costs
    from .objective import ContextLost

    print(f"tuning the work-unit planner's costs on {gpu['name']} ({arch}): {len(unit_costs.WORKLOADS)} "
          f"workloads, {args.trials} distinct plans at most", file=sys.stderr)
    measure = unit_costs.GpuMeasure(iters=args.iters, seed=args.seed)
    try:
        outcome = unit_costs.search(measure, measure.plans, trials=args.trials, seed=args.seed)
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
    result = tables.UnitCosts(outcome.costs, outcome.tuned_us, outcome.default_us, outcome.trials, tables.today(),
                              tuple(name for name, _ in unit_costs.WORKLOADS))
    path = _table_path(args, arch, gpu)
    if path is None:
        return 0
    try:
        # The header describes the kernel entries' run (versions, date): a table that has one keeps
        # it, since no kernel was measured here (the costs carry their own date).
        header = tables.load(path).header if path.exists() else _header(arch, gpu)
        tables.save(path, header, [], unit_costs=result)
    except (OSError, tables.TableError) as e:
        print(f"splitkv-gen: cannot write the table {path}: {e}; give a writable folder with --out", file=sys.stderr)
        return 1
    print(f"wrote unit_costs to {path}", file=sys.stderr)
    return 0


def _context_lost(e) -> int:
    print(f"splitkv-gen: the GPU can run nothing more in this process: {e}\nThe candidate that did it is "
          f"recorded as failed; run the same command again (same --storage) to go on past it.", file=sys.stderr)
    return EXIT_CONTEXT_LOST


def _run_workers(args, devices, names) -> int:
    """One worker process per listed device, each with only that GPU visible; overall progress is
    read from the shared storage while they run. A worker whose GPU context was lost (status 75)
    is started again, up to `WORKER_RESTARTS` times: it resumes past the candidate that did it."""
    argv = [sys.executable, "-m", "splitkv.cli", *_without_devices(args.argv), WORKER_FLAG]
    run = f"{socket.gethostname()} {os.getpid()} {time.time():.0f}"  # this run's workers' claims
    if args.jobs is None:  # the workers compile at once on one host: each takes its share of the CPUs
        argv += ["--jobs", str(compile_jobs(None, len(devices)))]
    log_dir = Path(tempfile.mkdtemp(prefix="splitkv-tune-workers-"))
    logs = [open(log_dir / f"worker-{i}-gpu{d}.log", "w") for i, d in enumerate(devices)]  # noqa: SIM115

    def start(index):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(devices[index]),
                   **{WORKER_ENV: str(index + 1), WORKERS_ENV: str(len(devices)), RUN_ENV: run})
        return subprocess.Popen(argv, env=env, stdout=logs[index], stderr=subprocess.STDOUT)

    workers = [start(i) for i in range(len(devices))]
    restarts = [0] * len(devices)
    print(f"started {len(workers)} workers on devices {devices}; their logs are in {log_dir}", file=sys.stderr)
    overall = _bar(True, total=len(names) * args.trials, desc="all studies (all workers)", position=0)
    try:
        while any(p.poll() is None for p in workers):
            time.sleep(2.0)
            for i, p in enumerate(workers):
                if p.poll() == EXIT_CONTEXT_LOST and restarts[i] < WORKER_RESTARTS:
                    restarts[i] += 1
                    workers[i] = start(i)
            if overall is not None:
                overall.n = _count_trials(args, names)
                overall.refresh()
    finally:
        for p in workers:
            if p.poll() is None:
                p.terminate()
            p.wait()
        for log in logs:
            log.close()
        if overall is not None:
            overall.close()
    failed = [(devices[i], p.returncode) for i, p in enumerate(workers) if p.returncode]
    for device, rc in failed:
        print(f"splitkv-gen: the worker on device {device} exited with status {rc} (its log is in {log_dir})",
              file=sys.stderr)
    return 1 if failed else 0


def _without_devices(argv) -> list:
    """The command line for a worker: this one without --devices (as '--devices X' or '--devices=X')."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--devices":
            skip = True
        elif not arg.startswith("--devices="):
            out.append(arg)
    return out


def _count_trials(args, names) -> int:
    """Trials the workers have started in these studies so far (each counted up to --trials)."""
    from . import search

    summaries = search._optuna().get_all_study_summaries(args.storage_handle)
    wanted = set(names)
    return sum(min(s.n_trials, args.trials) for s in summaries if s.study_name in wanted)


def _tune_all(args, arch, gpu, keys, buckets) -> int:
    """Tune every key (`_tune_key`; after workers, mostly reading their outcomes back), print the
    summary, write the report."""
    from .objective import ContextLost

    outcomes, failed = [], 0
    overall = _bar(True, total=len(keys) * len(buckets) * args.trials, desc="all studies", position=0)
    try:
        for key in keys:
            done, broke = _tune_key(args, gpu, arch, key, buckets, overall, progress=True)
            outcomes += done
            failed += broke
    except ContextLost as e:
        return _context_lost(e)
    except _TableUnwritable as e:
        print(f"splitkv-gen: {e}", file=sys.stderr)
        return 2
    finally:
        if overall is not None:
            overall.close()
    from .report import format_summary

    print(format_summary([o.entry for o in outcomes], [o.seconds for o in outcomes]))
    path = _table_path(args, arch, gpu)
    if path is not None and outcomes:
        _write(args, arch, gpu, [o.entry for o in outcomes])  # outcomes read back may come from another --out
        print(f"wrote {len(outcomes)} entries to {path}", file=sys.stderr)
    if args.report is not None and outcomes:
        from . import report

        sweeps = {} if args.cost_model else _sweeps(outcomes, path.parent.parent)
        written = report.write(args.report, outcomes, _header(arch, gpu), sweeps)
        print(f"wrote the report to {written}", file=sys.stderr)
    return 0 if outcomes and not failed else 1


def _finish(args, arch, key, bucket, study, objective):
    """One searched study's outcome, or None when no candidate succeeded. ``objective`` is a `_Lazy`."""
    from . import search, space

    if not search.best_specs(study, key, arch, 1):
        print(f"splitkv-gen: {key.label} {bucket.name}: no candidate succeeded; nothing written for it",
              file=sys.stderr)
        return None
    results = None
    if args.exhaustive:
        bar = _bar(True, total=len(space.enumerate_specs(key, arch)[0]), desc=f"exhaustive {key.label} {bucket.name}",
                   position=0)
        results = search.exhaustive(key, arch, objective.get(), progress=bar)
        if bar is not None:
            bar.close()
    return search.finish(study, key, bucket, arch, objective.get(), iters=args.iters * 2, exhaustive_results=results)


def _sweeps(outcomes, table_dir) -> dict:
    """The report's bandwidth sweep of every tuned key the benchmark's inputs cover, with the table
    just written (see `sweep`); {} without torch, which the benchmark's inputs and peers need."""
    from . import lookup, sweep

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
        bar = _bar(True, total=len(keys), desc="bandwidth sweep", position=0)
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


class _Both:
    def __init__(self, *bars):
        self.bars = [b for b in bars if b is not None]

    def update(self, n):
        for b in self.bars:
            b.update(n)


def _bar(enabled: bool, **kwargs):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with Optuna; without it, no bars
        return None
    return tqdm(file=sys.stderr, dynamic_ncols=True, **kwargs)


def _version() -> str:
    from .. import __version__

    return __version__
