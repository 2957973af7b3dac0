"""Several tuning processes on one storage, one of them killed and resumed, as separate hosts run
`splitkv-gen --tune --storage URL`: a journal file (everywhere) and a PostgreSQL database (where
SPLITKV_TEST_POSTGRES_URL names one). Each process is the real command line (the cost model as
its objective, slowed down so that the kill lands mid-study); the search is exhaustive (every
distinct program of the key's space on the bucket is enqueued before the workers start), so the
interrupted run must end with the table of an uninterrupted one.

SPLITKV_TEST_POSTGRES_URL is a --storage URL such as postgresql+psycopg://postgres@127.0.0.1:5432/postgres
(the run's studies get a prefix of their own, and are deleted afterwards). Without it, or without
the driver or a server that answers, the PostgreSQL case is skipped with the reason; with
SPLITKV_REQUIRE_POSTGRES=1 (set by .ci/run, which starts a server) it fails instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from splitkv.autotune import costmodel, search, space, studies, versions
from splitkv.tuned import tables
from splitkv.tuned.keys import TuneKey, parse_bucket
from splitkv.tuned.lookup import COST_MODEL_GPU

REPO = Path(__file__).resolve().parent.parent
POSTGRES_ENV = "SPLITKV_TEST_POSTGRES_URL"
REQUIRE_POSTGRES_ENV = "SPLITKV_REQUIRE_POSTGRES"

ARCH = "sm_90"
#: A small space: on a bucket whose rows fill the SMs, every split candidate runs the built-in dense
#: program and each dense candidate its own, so its 288 candidates launch 32 distinct programs (one
#: candidate each, but the built-in's), whose predicted figures hold no tie among the best three.
KEY = TuneKey(64, 4, "bf16", "fp8_e4m3")
BUCKET = parse_bucket("b32-l4k")
#: Seconds each measurement of the slowed-down workers takes; the kill waits for this many
#: measured trials in the storage.
DELAY = 0.1
MEASURED_BEFORE_KILL = 4
#: The bound of every wait on the workers.
TIMEOUT = 180.0

# The command line `splitkv-gen ...` in a process of its own, with each cost-model measurement
# taking DELAY seconds, and none starting while the file HOLD exists; a file MARKS/measuring-<pid>
# exists while this process measures (so the test can kill it there, and not while it writes to
# the storage: a journal's lock left behind by a kill stalls the others for its grace period).
_WORKER = """
import os, sys, time
from pathlib import Path
from splitkv import cli
from splitkv.autotune import costmodel

delay, hold, marks = float(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
predict = costmodel.CostModelObjective.measure

def measure(self, spec, iters=None):
    held_until = time.monotonic() + 120
    while hold.exists() and time.monotonic() < held_until:
        time.sleep(0.02)
    mark = marks / f"measuring-{os.getpid()}"
    mark.touch()
    time.sleep(delay)
    mark.unlink()
    return predict(self, spec, iters)

costmodel.CostModelObjective.measure = measure
sys.exit(cli.main(sys.argv[4:]))
"""


@pytest.fixture
def postgres_url():
    """The PostgreSQL URL of SPLITKV_TEST_POSTGRES_URL, when its driver is installed and its server
    answers; else a skip (a failure under SPLITKV_REQUIRE_POSTGRES=1)."""
    def unavailable(reason):
        if os.environ.get(REQUIRE_POSTGRES_ENV) == "1":
            pytest.fail(f"{REQUIRE_POSTGRES_ENV}=1, but {reason}")
        pytest.skip(reason)

    url = os.environ.get(POSTGRES_ENV, "").strip()
    if not url:
        unavailable(f"no PostgreSQL server to tune on: {POSTGRES_ENV} is not set")
    sqlalchemy = pytest.importorskip("sqlalchemy")  # with Optuna
    try:
        engine = sqlalchemy.create_engine(url)
    except ImportError as e:
        unavailable(f"the driver of {POSTGRES_ENV} is not installed ({e}): pip install 'splitkv[tune-pg]'")
    try:
        with engine.connect():
            pass
    except Exception as e:  # noqa: BLE001 - whatever the driver says: no server to test on
        first_line = next(iter(str(e).splitlines()), "")
        unavailable(f"the PostgreSQL server of {POSTGRES_ENV} does not answer: {type(e).__name__}: {first_line}")
    finally:
        engine.dispose()
    return url


def _study_name(prefix: str) -> str:
    return versions.study_name(prefix, COST_MODEL_GPU, ARCH, KEY, BUCKET, versions.code_version())


def _programs() -> dict:
    """{program launched on BUCKET: the candidates of the space that launch it, in the space's order}."""
    objective = costmodel.CostModelObjective(KEY, BUCKET, ARCH)
    programs: dict = {}
    for spec in space.enumerate_specs(KEY, ARCH)[0]:
        programs.setdefault(objective.runs(spec), []).append(spec)
    return programs


def _enqueue_every_program(storage: str, prefix: str) -> tuple[int, int]:
    """The exhaustive search: the study as the command line opens it (the built-in split and dense
    programs first, which launch the same on this bucket), then a candidate of each other program,
    and a third candidate of the built-in program at queue position `search.BATCH`: the first
    candidate of the second worker's first batch (see `_killed_and_resumed`). Returns the number of
    distinct programs and that position."""
    study = studies.open_study(_study_name(prefix), storage)
    search.enqueue_defaults(study, KEY, BUCKET, ARCH)
    builtin = costmodel.CostModelObjective(KEY, BUCKET, ARCH).runs(None)
    programs = _programs()
    defaults = [t.params for t in study.trials]
    assert len(defaults) == 2, "the built-in split and dense programs are the study's first trials"
    third = next(s for s in programs[builtin] if space.params_of(s, KEY, ARCH) not in defaults)
    queue = [specs[0] for program, specs in programs.items() if program != builtin]
    queue.insert(search.BATCH - len(defaults), third)
    for spec in queue:
        study.enqueue_trial(space.params_of(spec, KEY, ARCH))
    return len(programs), search.BATCH


def _argv(storage: str, prefix: str, out: Path, trials: int) -> list:
    return ["--arch", "sm90", "--tune", "--cost-model", "--head-dim", str(KEY.head_dim), "--group",
            str(KEY.group_size), "--dtype", KEY.kv_dtype, "--bucket", BUCKET.name, "--trials", str(trials),
            "--storage", storage, "--study", prefix, "--out", str(out)]


def _start(argv: list, scratch: Path, delay: float, log: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with open(scratch / log, "w") as out:
        return subprocess.Popen([sys.executable, "-c", _WORKER, str(delay), str(scratch / "hold"), str(scratch),
                                 *argv], env=env, stdout=out, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, scratch: Path, log: str) -> None:
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, f"{log} ended with status {proc.returncode}:\n{(scratch / log).read_text()}"


def _wait_for(what: str, condition, procs) -> None:
    """Poll ``condition`` until it holds; fails when a worker ended or after TIMEOUT seconds."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        for proc in procs:
            assert proc.poll() is None, f"a worker ended (status {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {TIMEOUT:.0f} s"
        time.sleep(0.02)


def _snapshot(study) -> dict:
    """{trial number: what a finished trial holds} of the study's finished trials."""
    return {t.number: (t.state.name, t.params, t.value, t.user_attrs.get("spec"), t.user_attrs.get("repeat_of"))
            for t in studies.finished(study)}


def _table(out: Path) -> list:
    """The entries written under ``out``, as dicts without their date: with the cost model every
    figure is a deterministic prediction and the choice follows from them, so an interrupted run
    must agree on all the rest (spec, µs, plans, the trials counted, the planner); the date is the
    day each run confirmed its entry."""
    entries = tables.load(tables.table_path(out, ARCH, COST_MODEL_GPU)).entries
    return [{k: v for k, v in e.to_dict().items() if k != "date"} for e in entries]


def _running(study, pid: int) -> list:
    """The numbers of the study's RUNNING trials that process ``pid`` asked for."""
    running = study.get_trials(deepcopy=False, states=(studies.import_optuna().trial.TrialState.RUNNING,))
    return [t.number for t in running if t.user_attrs.get("pid") == pid]


def _killed_and_resumed(storage: str, prefix: str, scratch: Path) -> tuple:
    """Workers A and B search the study together, A having asked for the first batch of the queue
    and B for the second before either measures: so both measure the built-in program at once (A
    as trial 0, B as trial `search.BATCH`). A is killed (SIGKILL) while it measures, once the
    storage holds MEASURED_BEFORE_KILL measured trials; the same command (A') resumes beside B.
    Returns (the study at the end, its finished trials right after the kill, the trials A left
    RUNNING, the trial B measured the built-in program with, the table written)."""
    optuna = studies.import_optuna()
    programs, second_batch = _enqueue_every_program(storage, prefix)
    out, hold = scratch / "tables", scratch / "hold"
    argv = _argv(storage, prefix, out, programs)
    handle = studies.make_storage(storage)

    def study():
        return optuna.load_study(study_name=_study_name(prefix), storage=handle)

    hold.touch()  # each worker asks for its first batch, and waits to measure it
    a = _start(argv, scratch, DELAY, "a.log")
    workers = [a]
    try:
        _wait_for("A asking for its first batch", lambda: len(_running(study(), a.pid)) == search.BATCH, workers)
        b = _start(argv, scratch, DELAY, "b.log")
        workers.append(b)
        _wait_for("B asking for its first batch", lambda: len(_running(study(), b.pid)) == search.BATCH, workers)
        assert _running(study(), a.pid) == list(range(search.BATCH))
        assert _running(study(), b.pid)[0] == second_batch
        hold.unlink()

        mark = scratch / f"measuring-{a.pid}"

        def a_is_measuring_mid_study():
            measured = len(studies.measured(study()))
            assert measured < programs, "the study finished before the kill: nothing to resume"
            if measured < MEASURED_BEFORE_KILL:
                return False
            try:  # in the first half of a measurement: still in it when killed
                return time.time() - mark.stat().st_mtime < DELAY / 2
            except FileNotFoundError:
                return False

        _wait_for(f"{MEASURED_BEFORE_KILL} measured trials while A measures", a_is_measuring_mid_study, workers)
        hold.touch()  # B (and A', once started) measure nothing more until A' has cleaned up after A
        a.kill()
        a.wait(timeout=TIMEOUT)
        assert a.returncode == -signal.SIGKILL
        before = _snapshot(study())
        left_by_a = _running(study(), a.pid)
        assert left_by_a, "A was killed while measuring: its trial must be RUNNING in the storage"

        resumed = _start(argv, scratch, DELAY, "a-resumed.log")
        workers.append(resumed)

        def a_cleaned_up():
            trials = study().trials
            return all(trials[n].state.name == "FAIL" for n in left_by_a)

        _wait_for("the resumed run failing A's trials as interrupted", a_cleaned_up, [b, resumed])
        hold.unlink()
        _finish(b, scratch, "b.log")
        _finish(resumed, scratch, "a-resumed.log")
    finally:
        hold.unlink(missing_ok=True)
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return study(), before, left_by_a, second_batch, _table(out)


def _uninterrupted(storage: str, prefix: str, scratch: Path) -> list:
    programs, _ = _enqueue_every_program(storage, prefix)
    proc = _start(_argv(storage, prefix, scratch / "tables", programs), scratch, 0.0, "alone.log")
    _finish(proc, scratch, "alone.log")
    return _table(scratch / "tables")


def _check_resumed(storage: str, prefix: str, tmp_path: Path) -> None:
    optuna = pytest.importorskip("optuna")
    complete = optuna.trial.TrialState.COMPLETE
    (tmp_path / "alone").mkdir()
    (tmp_path / "shared").mkdir()
    expected = _uninterrupted(storage, prefix + "alone-", tmp_path / "alone")
    study, before, left_by_a, b_builtin, table = _killed_and_resumed(storage, prefix + "shared-",
                                                                      tmp_path / "shared")
    programs = _programs()
    trials = study.trials

    # Nothing finished before the kill was lost or changed.
    after = _snapshot(study)
    assert {n: after.get(n) for n in before} == before
    # The trials A left do not count, their candidates were measured after all (queued again, and
    # asked for before the sampler's own), and nothing is left running.
    for n in left_by_a:
        assert trials[n].state.name == "FAIL" and trials[n].user_attrs.get("interrupted") is True
        if "spec" in trials[n].user_attrs:
            (retry,) = [t for t in trials if t.user_attrs.get(studies.RETRY_ATTR) == n]
            assert retry.state == complete and retry.params == trials[n].params
    assert not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    # Both workers measured the built-in program (trials 0 and B's first): it counts once. The
    # search was exhaustive and counted each program once: the measured trials are the space's
    # programs, each once, and so many the table says.
    builtin = trials[0].user_attrs["runs"]
    assert [t.number for t in trials if t.state == complete and "repeat_of" not in t.user_attrs
            and t.user_attrs.get("runs") == builtin] == [0, b_builtin]
    counted = [t.user_attrs["runs"] for t in studies.measured(study)]
    assert sorted(counted) == sorted(programs)
    (entry,) = table
    assert entry["trials"] == len(programs)
    assert table == expected


def test_a_killed_worker_resumes_on_a_shared_journal(tmp_path):
    """Two workers on one journal file, one killed mid-study and resumed: no finished trial lost,
    none counted twice, and the table of an uninterrupted run."""
    _check_resumed(str(tmp_path / "tune.log"), "", tmp_path)


def test_a_killed_worker_resumes_on_a_shared_postgresql_database(tmp_path, postgres_url):
    """The same on a PostgreSQL database, as hosts tuning one table share it."""
    optuna = pytest.importorskip("optuna")
    prefix = f"test-resume-{uuid.uuid4().hex[:8]}-"
    try:
        _check_resumed(postgres_url, prefix, tmp_path)
    finally:  # the run's studies only: the database may be someone's own
        storage = studies.make_storage(postgres_url)
        for summary in optuna.get_all_study_summaries(storage):
            if summary.study_name.startswith(prefix):
                optuna.delete_study(study_name=summary.study_name, storage=storage)
