"""Tuning on several GPUs: ``--devices 0,1`` starts one worker process per listed GPU (a GPU may be
listed twice: two workers share it). Each worker tunes whole keys, starting at its share of the key
list and leaving a key another live worker claimed, and keeps each confirmed entry in ``--storage``;
the parent then reads the entries back and tunes whatever a stopped worker left.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .objective import ContextLost
from .progress import progress_bar
from .tuning import (EXIT_CONTEXT_LOST, WORKER_ENV, TableUnwritable, TuneRun, compile_jobs, context_lost,
                     open_run_study, tune_key)

#: The flag a worker's command line carries (hidden from --help).
WORKER_FLAG = "--tune-worker"
#: The number of workers of one run (`WORKER_ENV`: a worker's index among them, from 1).
WORKERS_ENV = "SPLITKV_TUNE_WORKERS"
#: The run a worker belongs to (its parent's host, pid and start), which its claims carry.
RUN_ENV = "SPLITKV_TUNE_RUN"
#: Times a worker whose context was lost is started again.
WORKER_RESTARTS = 3


def work(run: TuneRun, gpu: dict) -> int:
    """What a worker does: tune keys (search, confirm, write) until none is left that no other
    worker of its run has claimed. Worker i of N starts at the i-th N-th of the keys and goes round,
    so the workers start apart and meet only at the end; a key another live worker of the run
    claimed is left to it (claims of other runs are stale: see `studies.claimed_elsewhere`)."""
    from . import studies

    index = max(1, int(os.environ.get(WORKER_ENV, "1")))
    count = max(index, int(os.environ.get(WORKERS_ENV, "1")))
    claim = os.environ.get(RUN_ENV, f"{index} of {count}")
    keys = list(run.keys)
    first = (index - 1) * len(keys) // count
    failed = 0
    try:
        for key in keys[first:] + keys[:first]:
            lead = open_run_study(run, gpu, key, run.buckets[0])
            if studies.claimed_elsewhere(lead, claim):
                continue
            studies.claim(lead, claim)
            failed += tune_key(run, gpu, key, overall=None, progress=False)[1]
    except ContextLost as e:
        return context_lost(e)
    except TableUnwritable as e:
        print(f"splitkv-gen: {e}", file=sys.stderr)
        return 2
    return 1 if failed else 0


def run_workers(run: TuneRun, devices, names) -> int:
    """One worker process per listed device, each with only that GPU visible; overall progress is
    read from the shared storage (the studies ``names``) while they run. A worker whose GPU context
    was lost (status 75) is started again, up to `WORKER_RESTARTS` times: it resumes past the
    candidate that did it."""
    argv = [sys.executable, "-m", "splitkv.cli", *without_devices(run.argv), WORKER_FLAG]
    claim = f"{socket.gethostname()} {os.getpid()} {time.time():.0f}"  # this run's workers' claims
    if run.jobs is None:  # the workers compile at once on one host: each takes its share of the CPUs
        argv += ["--jobs", str(compile_jobs(None, len(devices)))]
    log_dir = Path(tempfile.mkdtemp(prefix="splitkv-tune-workers-"))
    logs = [open(log_dir / f"worker-{i}-gpu{d}.log", "w") for i, d in enumerate(devices)]  # noqa: SIM115

    def start(index):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(devices[index]),
                   **{WORKER_ENV: str(index + 1), WORKERS_ENV: str(len(devices)), RUN_ENV: claim})
        return subprocess.Popen(argv, env=env, stdout=logs[index], stderr=subprocess.STDOUT)

    workers = [start(i) for i in range(len(devices))]
    restarts = [0] * len(devices)
    print(f"started {len(workers)} workers on devices {devices}; their logs are in {log_dir}", file=sys.stderr)
    overall = progress_bar(True, total=len(names) * run.trials, desc="all studies (all workers)", position=0)
    try:
        while any(p.poll() is None for p in workers):
            time.sleep(2.0)
            for i, p in enumerate(workers):
                if p.poll() == EXIT_CONTEXT_LOST and restarts[i] < WORKER_RESTARTS:
                    restarts[i] += 1
                    workers[i] = start(i)
            if overall is not None:
                overall.n = count_trials(run, names)
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


def without_devices(argv) -> list:
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


def count_trials(run: TuneRun, names) -> int:
    """Trials the workers have started in these studies so far (each counted up to --trials)."""
    from .studies import import_optuna

    summaries = import_optuna().get_all_study_summaries(run.storage_handle)
    wanted = set(names)
    return sum(min(s.n_trials, run.trials) for s in summaries if s.study_name in wanted)
