"""`splitkv-gen --arch sm90 --tune ...`: read the command line once into a `TuneRun`, check it, and
tune every (key, bucket) asked for (`splitkv.autotune.tuning`), in one process on the current GPU
or in one worker per listed GPU (``--devices``, `splitkv.autotune.workers`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ..arch import arch_number
from ..choices import KV_DTYPES, Q_DTYPES, QUANTIZED_KV_DTYPES
from ..gpu import unavailable_reason
from ..tuned.keys import BUCKETS, TuneKey, parse_bucket
from ..tuned.lookup import COST_MODEL_GPU
from .flags import bucket_names, path_arg
from .flags import check as check_flags
from .tuning import TuneRun
from .workers import WORKER_FLAG

#: Head dims, groups of the default tuning run (the shipped table); every K/V dtype of the arch.
DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_GROUPS = (1, 4, 8)
#: What the shipped H200 table was tuned with: `splitkv-gen --arch sm90 --tune` reproduces it.
DEFAULT_TRIALS = 20
DEFAULT_ITERS = 20


def keys_for(arch: str, head_dims, group_sizes, kv_dtypes, page_sizes, kv_layout, query_tokens=(1,)) -> list[TuneKey]:
    """The keys to tune: 16-bit K/V with queries of their own type, quantized ones with bf16 queries;
    each for every count of ``query_tokens`` per sequence."""
    head_dims = head_dims or DEFAULT_HEAD_DIMS
    group_sizes = group_sizes or DEFAULT_GROUPS
    kv_dtypes = kv_dtypes or tuple(d for d in KV_DTYPES if d not in QUANTIZED_KV_DTYPES
                                   or arch_number(arch) >= 89)
    keys = []
    for kv_dtype in kv_dtypes:
        q_dtype = kv_dtype if kv_dtype in Q_DTYPES else "bf16"
        for head_dim in head_dims:
            if kv_dtype == "nvfp4" and head_dim % 64:
                continue
            for group in group_sizes:
                for page_size in page_sizes or (0,):
                    for tokens in query_tokens:
                        keys.append(TuneKey(head_dim, group, q_dtype, kv_dtype, page_size,
                                            kv_layout if page_size else "NHD", tokens))
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
    g.add_argument("--query-tokens", dest="query_tokens", default="1", metavar="T,...",
                   help="query tokens per sequence of the keys tuned (default 1; e.g. 1,2,4,8 for "
                        "speculative verification: each count is a key of its own)")
    g.add_argument("--bucket", dest="buckets", action="append", metavar="NAME,...",
                   help="workload buckets, e.g. b1-l32k (default: " + ",".join(b.name for b in BUCKETS) + ")")
    g.add_argument("--out", type=path_arg, default=None, metavar="DIR",
                   help="write the table under DIR/<arch>/ (default: the package's tuned_configs)")
    g.add_argument("--report", type=path_arg, default=None, metavar="DIR", help="write plots and a markdown summary to DIR")
    g.add_argument("--report-from", type=path_arg, default=None, metavar="TABLE",
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
    g.add_argument("--remeasure", action="store_true",
                   help="measure the table's entries again (each tuned spec and the built-in choice, as the tuner "
                        "confirms a winner) and write their new figures, keeping each choice that still wins by the "
                        "confirm margin (the built-in choice takes the place of one that does not); --head-dim, --group, "
                        "--dtype, --page-size and --bucket select entries; without them the unit_costs are measured "
                        "too, and with --unit-costs alone")
    g.add_argument("--cost-model", action="store_true",
                   help="score candidates with the cost model instead of the GPU (a dry run: figures are "
                        "predictions, and no table is written unless --out is given)")
    g.add_argument(WORKER_FLAG, dest="tune_worker", action="store_true", help=argparse.SUPPRESS)  # workers' own


def run_description(args, parser, arch: str, head_dims, group_sizes, kv_dtypes, page_sizes) -> TuneRun:
    """The run the parsed command line asks for (its flags checked: `parser.error` otherwise)."""
    if args.trials < 1:
        parser.error(f"--trials: expected a positive number, got {args.trials}")
    for flag, given in (("--emit", args.emit is not None), ("--list", args.list)):
        if given:  # they name the built-in programs to compile; a tuning run compiles its candidates
            parser.error(f"{flag} does not go with --tune")
    names = bucket_names(parser, args.buckets)
    try:
        buckets = [parse_bucket(name) for name in names] if names else list(BUCKETS)
    except ValueError as e:
        parser.error(f"--{e}")
    if arch != f"sm_{arch_number(arch)}":
        parser.error(f"--arch: tune {arch.rstrip('a')}, not {arch}: the runtime looks tables up by the GPU's "
                     f"compute capability, and arch-specific programs are not tuned separately")
    try:
        tokens = sorted({int(t) for t in str(args.query_tokens).split(",") if t.strip()})
        keys = keys_for(arch, head_dims, group_sizes, kv_dtypes, page_sizes, args.kv_layout, tokens or (1,))
    except ValueError as e:
        parser.error(f"--query-tokens: {e}")
    check_flags(args, parser, keys, buckets)
    return TuneRun(arch=arch, keys=tuple(keys), buckets=tuple(buckets), trials=args.trials, iters=args.iters,
                   seed=args.seed, timeout=args.timeout, storage=args.storage, study_prefix=args.study,
                   out=args.out, report=args.report, exhaustive=bool(args.exhaustive),
                   cost_model=bool(args.cost_model), jobs=args.jobs, argv=tuple(getattr(args, "argv", ()) or ()))


def run(args, parser, arch: str, head_dims, group_sizes, kv_dtypes, page_sizes) -> int:
    from . import studies, tuning, workers

    tune = run_description(args, parser, arch, head_dims, group_sizes, kv_dtypes, page_sizes)
    if args.report_from is not None and (args.report is None or args.storage is None):
        parser.error("--report-from: give the --report DIR to write and the --storage the run used")
    if args.remeasure:
        return _remeasure(args, parser, tune, head_dims, group_sizes, kv_dtypes)
    devices = _devices(parser, args.devices)
    several = bool(devices) and (len(devices) > 1 or devices[0] != 0)
    if several and not args.storage:
        parser.error("--devices: workers share their studies through --storage (e.g. --storage tune.log)")
    try:
        studies.import_optuna()
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
        return _report_from(tune, args.report_from)
    if several and not tune.cost_model:  # this process confirms the winners on the first listed GPU
        for device in devices:  # every worker's GPU, before any worker starts
            reason = unavailable_reason(device)
            if reason is not None:
                print(f"splitkv-gen: --devices {args.devices}: GPU {device} is not usable here: {reason}",
                      file=sys.stderr)
                return 2
        import cupy

        cupy.cuda.Device(devices[0]).use()
    gpu = _check_gpu(arch, tune.cost_model)
    if isinstance(gpu, int):
        return gpu
    problem = tuning.table_refusal(tune, gpu)
    if problem:
        print(f"splitkv-gen: {problem}", file=sys.stderr)
        return 2
    if args.unit_costs:
        return tuning.tune_unit_costs(tune, gpu)
    try:
        handle = studies.make_storage(tune.storage)
    except Exception as e:  # noqa: BLE001 - a server that does not answer, refused credentials, ...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"splitkv-gen: --storage: cannot open {_shown_url(tune.storage)}: {reason}", file=sys.stderr)
        return 2
    tune = dataclasses.replace(tune, storage_handle=handle)
    print(f"tuning {len(tune.keys)} keys x {len(tune.buckets)} buckets = {len(tune.keys) * len(tune.buckets)} "
          f"studies of {tune.trials} trials on {gpu['name']} ({arch})", file=sys.stderr)
    if args.tune_worker:
        return workers.work(tune, gpu)
    workers_rc = 0
    if several:
        names = [tuning.run_study_name(tune, gpu, k, b) for k in tune.keys for b in tune.buckets]
        workers_rc = workers.run_workers(tune, devices, names)
    # The workers' outcomes are read back from the storage; what they left (nothing, unless one
    # stopped early) is tuned here.
    return tuning.tune_all(tune, gpu) or workers_rc


def _report_from(tune: TuneRun, table_file) -> int:
    """--report-from: the report of the table's entries of this run's keys and buckets, with each
    study's trials read from --storage; nothing is measured (no confirmation figures, no sweeps)."""
    from ..tuned import tables
    from . import report, studies

    try:
        table = tables.load(table_file)
    except (OSError, tables.TableError) as e:
        print(f"splitkv-gen: --report-from: {e}", file=sys.stderr)
        return 2
    if table.arch != tune.arch:
        print(f"splitkv-gen: --report-from: {table_file} is a table of {table.arch}, not {tune.arch}", file=sys.stderr)
        return 2
    journal = studies.journal_path(tune.storage)
    if journal is not None and not journal.is_file():
        print(f"splitkv-gen: --storage: no journal file {journal}", file=sys.stderr)
        return 2
    keys, bucket_names = set(tune.keys), {b.name for b in tune.buckets}
    entries = [e for e in table.entries if e.key in keys and e.bucket.name in bucket_names]
    try:
        storage = studies.make_storage(tune.storage)
        outcomes, missing = report.outcomes_from_storage(entries, table, storage, tune.study_prefix)
    except Exception as e:  # noqa: BLE001 - an RDB URL that does not connect, a journal that does not parse
        print(f"splitkv-gen: --storage {tune.storage}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for e in missing:
        print(f"splitkv-gen: {e.key.label} {e.bucket.name}: no study of it in {tune.storage}; left out of the report",
              file=sys.stderr)
    if not outcomes:
        print("splitkv-gen: --report-from: no entry of the table has its study in --storage; nothing written",
              file=sys.stderr)
        return 1
    written = report.write(tune.report, outcomes, table.header, {})
    print(f"wrote the report of {len(outcomes)} entries to {written}", file=sys.stderr)
    return 0


def _remeasure(args, parser, tune: TuneRun, head_dims, group_sizes, kv_dtypes) -> int:
    """--remeasure: the table's figures measured again (`remeasure`); the search's flags are refused."""
    from . import remeasure

    selectors = (("--bucket", bool(args.buckets)), ("--head-dim", bool(head_dims)), ("--group", bool(group_sizes)),
                 ("--dtype", bool(kv_dtypes)), ("--page-size", bool(args.page_sizes)))
    for flag, given in (("--devices", args.devices is not None), ("--storage", bool(args.storage)),
                        ("--study", bool(args.study)), ("--timeout", args.timeout is not None),
                        ("--exhaustive", args.exhaustive), ("--report-from", args.report_from is not None),
                        *((f"{f} with --unit-costs", g and args.unit_costs) for f, g in selectors)):
        if given:
            parser.error(f"{flag} does not go with --remeasure (it measures the table's own entries again)")
    gpu = _check_gpu(tune.arch, tune.cost_model)
    if isinstance(gpu, int):
        return gpu
    selection = remeasure.Selection(
        head_dims, group_sizes, kv_dtypes, None if args.page_sizes is None else tuple(p for g in args.page_sizes for p in g),
        args.kv_layout, None if not args.buckets else tuple(b.name for b in tune.buckets))
    return remeasure.run(tune, gpu, selection, unit_costs_only=bool(args.unit_costs))


def _shown_url(storage) -> str:
    """A storage URL as it may be printed: its password hidden."""
    text = str(storage)
    if "://" not in text:
        return text
    try:
        from sqlalchemy.engine import make_url

        return make_url(text).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: the scheme alone
        return text.split("://", 1)[0] + "://..."


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
    reason = unavailable_reason()
    if reason is not None:
        print(f"splitkv-gen: --tune measures on a GPU of {arch}, and none is usable here: {reason} "
              f"(--cost-model tunes without one, on predicted figures)", file=sys.stderr)
        return 2
    try:
        from ..timing import gpu_info

        info = gpu_info()
    except Exception as e:  # noqa: BLE001 - no driver, no device
        print(f"splitkv-gen: --tune measures on a GPU of {arch}, and none is usable here "
              f"({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    if arch_number(info["arch"]) != arch_number(arch):
        print(f"splitkv-gen: --arch {arch} asks for tuning on {arch}, but this GPU ({info['name']}) is "
              f"{info['arch']}; tune each arch on its own GPUs", file=sys.stderr)
        return 2
    return dict(name=info["name"], sm_count=info["sm_count"], cuda_runtime=info["cuda_runtime_version"],
                nvrtc=info["nvrtc_version"] or "unknown")
