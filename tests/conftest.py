"""Test-wide setup: the run's seed and kernel cache, GPU tests marked and skipped cleanly where no
CUDA device can be used, and GPU tests in parallel processes.

Everything under tests/gpu/ is marked `gpu`; tests elsewhere may carry the mark explicitly. On a
machine without a usable device those tests are skipped with the reason, so the CPU suite runs the
same way on a laptop and in CI. On a GPU host, set SPLITKV_REQUIRE_GPU=1 to turn that skip into an
error, and with it a GPU test module that skips as it is imported (CuPy or Optuna missing): a GPU
run that silently tests nothing is worse than one that fails.

One seed per run (tests/seeds.py): SPLITKV_TEST_SEED, else drawn at random; printed in the header
and exported, so that it replays the run. Hypothesis draws from it too (unless --hypothesis-seed
says otherwise; with a seed given, Hypothesis keeps no example database), and so do the global
generators (random, NumPy's, torch's), from the seed and each test's id. Hypothesis' other files
go to the run's folder, not the working folder.

The run compiles into a kernel cache of its own (SPLITKV_CACHE_DIR, unless the caller set one):
never the user's, and shared by the run's processes, so that a program one test compiled is
loaded from there by the others. The folder goes when the run ends, unless the run failed after
compiling something: then it stays, named in the summary, with the sources that compile errors
point at. Nor may the tests write into the package's tuned tables or the benchmark's results: a
run that did fails, naming the files.

Each GPU test that runs has a deadline (``SPLITKV_TEST_TIMEOUT`` seconds, default 180; 0: none):
past it, the watchdog (tests/gpu_deadline.py) ends the process and names the test, so a kernel that
hangs costs one deadline instead of the GPU job's whole time limit. (In a parallel run the worker
ends; the main process goes on and prints the watchdog's report in its summary.)

With pytest-xdist (``-n N``) the GPU tests run in N processes on one GPU; those marked
`gpu_exclusive` (they time kernels, or race the host against a busy kernel) wait for the GPU to be
theirs alone (tests/gpu_sharing.py).
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import seeds
from gpu_deadline import arm, seconds_from_env
from gpu_sharing import GpuGate

_TESTS = Path(__file__).resolve().parent
_GPU_DIR = _TESTS / "gpu"
_ROOT = _TESTS.parent
#: Folders of the project that hold data the tests read but must never write.
_PROJECT_DATA = (_ROOT / "splitkv" / "tuned_configs", _ROOT / "bench" / "results")

CACHE_ENV = "SPLITKV_CACHE_DIR"
#: The run's scratch folder (its kernel cache, unless the caller gave one, Hypothesis' files, the GPU
#: locks, the watchdog's reports), made by the process that starts the run; its workers inherit it.
RUN_DIR_ENV = "SPLITKV_TEST_RUN_DIR"
REQUIRE_GPU_ENV = "SPLITKV_REQUIRE_GPU"


class _Run:
    """What this process set up for the run."""

    seed: int = 0
    own_dir: Path | None = None  # the scratch folder, when this process created it
    cache_is_the_callers = False
    data_before: dict | None = None
    data_written: list = []  # files of _PROJECT_DATA that changed during the run
    gate: GpuGate | None = None
    keep_dir = False  # a failed run's compiled sources, for its errors to point at


def _require_gpu() -> bool:
    return os.environ.get(REQUIRE_GPU_ENV) == "1"


@functools.lru_cache(maxsize=None)
def _no_gpu_reason() -> str | None:
    """None when a CUDA device is usable, else why not (splitkv's own reason: no driver, a driver
    older than CuPy's runtime, no device). Asked once, and only when a GPU test runs."""
    from splitkv.gpu import unavailable_reason

    return unavailable_reason()


def _under_gpu_dir(path) -> bool:
    try:
        Path(path).resolve().relative_to(_GPU_DIR)
    except ValueError:
        return False
    return True


def _watchdog_dir() -> Path:
    """Where the watchdog leaves its reports, for the summary of a parallel run."""
    return Path(os.environ[RUN_DIR_ENV]) / "watchdog"


def _files(folders) -> dict:
    """{path: (size, mtime)} of every file under ``folders``."""
    found = {}
    for folder in folders:
        for root, _, names in os.walk(folder):
            for name in names:
                path = os.path.join(root, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                found[path] = (st.st_size, st.st_mtime_ns)
    return found


# ---- the run's seed, folders and header --------------------------------------------------------------
@pytest.hookimpl(tryfirst=True)  # before Hypothesis' plugin reads its seed option
def pytest_configure(config):
    try:
        _Run.seed = seeds.run_seed()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    if getattr(config.option, "hypothesis_seed", "absent") is None:
        config.option.hypothesis_seed = str(_Run.seed)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the run's folders are its main process's
        return
    _Run.own_dir = Path(tempfile.mkdtemp(prefix="splitkv-tests-"))
    os.environ[RUN_DIR_ENV] = str(_Run.own_dir)
    _Run.cache_is_the_callers = bool(os.environ.get(CACHE_ENV))
    if not _Run.cache_is_the_callers:
        os.environ[CACHE_ENV] = str(_Run.own_dir / "kernels")
    # Hypothesis keeps its files (the constants it draws from the sources) in the working folder,
    # the project's, unless told otherwise.
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(_Run.own_dir / "hypothesis"))
    _Run.data_before = _files(_PROJECT_DATA)


def pytest_report_header(config):
    cache = os.environ[CACHE_ENV]
    whose = "the caller's" if _Run.cache_is_the_callers else f"this run's; {CACHE_ENV} keeps one across runs"
    return [f"splitkv: {seeds.ENV}={_Run.seed} (set it to replay this run)",
            f"splitkv: kernel cache {cache} ({whose})"]


def pytest_sessionfinish(session, exitstatus):
    if _Run.data_before is not None:
        after = _files(_PROJECT_DATA)
        written = sorted(p for p in set(after) | set(_Run.data_before) if after.get(p) != _Run.data_before.get(p))
        if written:
            _Run.data_written = written
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
    passed = session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    _Run.keep_dir = not passed and _Run.own_dir is not None and any((_Run.own_dir / "kernels").glob("*"))


def pytest_terminal_summary(terminalreporter, config):
    if _Run.data_written:
        terminalreporter.write_sep("=", "project files changed during the run (tests must not write there)", red=True)
        for path in _Run.data_written:
            terminalreporter.write_line(f"written or removed during the run: {os.path.relpath(path, _ROOT)}")
    if _Run.own_dir is not None:
        for report in sorted(_watchdog_dir().glob("*.txt")):
            terminalreporter.write_sep("=", f"watchdog ({report.stem})", red=True)
            terminalreporter.write(report.read_text())
    if _Run.keep_dir:
        terminalreporter.write_line(f"splitkv: this run's kernel cache, with the sources compiled, is kept in "
                                    f"{_Run.own_dir}")


def pytest_unconfigure(config):
    if _Run.gate is not None:
        _Run.gate.close()
    if _Run.own_dir is not None and not _Run.keep_dir:
        shutil.rmtree(_Run.own_dir, ignore_errors=True)


# ---- GPU tests: marked, skipped without a device, an error where one is required ---------------------
@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """Under SPLITKV_REQUIRE_GPU=1, a GPU test module that skips as it is imported (an
    importorskip at its top, a module-level skip) fails to collect instead: its tests never reach
    the items, so the check on them below cannot see them."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _require_gpu() and _under_gpu_dir(collector.path):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_GPU_ENV}=1, but this GPU test module skipped at import: {reason}"


def pytest_sessionstart(session):
    """With pytest-xdist the workers collect, and each would fail on its own: a run that requires
    the GPU checks it here first, once."""
    if _require_gpu() and session.config.pluginmanager.hasplugin("dsession"):
        reason = _no_gpu_reason()
        if reason is not None:
            raise pytest.UsageError(f"{REQUIRE_GPU_ENV}=1 but {reason}")


def pytest_collection_modifyitems(config, items):
    gpu_items = []
    for item in items:
        if _under_gpu_dir(item.path):
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("gpu") is not None:
            gpu_items.append(item)
    if not gpu_items:
        return
    reason = _no_gpu_reason()
    if reason is None:
        return
    if _require_gpu():
        raise pytest.UsageError(f"{REQUIRE_GPU_ENV}=1 but {reason}")
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


# ---- each test -------------------------------------------------------------------------------------
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """In a parallel run (pytest-xdist), a GPU test holds the GPU with the others or, marked
    gpu_exclusive, alone, from its setup to its teardown."""
    if (not os.environ.get("PYTEST_XDIST_WORKER") or item.get_closest_marker("gpu") is None
            or _no_gpu_reason() is not None):  # without a GPU they are skipped: nothing to share
        yield
        return
    if _Run.gate is None:
        _Run.gate = GpuGate(Path(os.environ[RUN_DIR_ENV]) / "gpu-locks")
    with _Run.gate.held(exclusive=item.get_closest_marker("gpu_exclusive") is not None):
        yield
        _release_device_memory()


def _release_device_memory() -> None:
    """Hands the memory pools' cached blocks back to the driver after a test: in a parallel run the
    processes share one GPU's memory, and a pool keeping what one test freed starves the others."""
    for name, release in (("cupy", lambda m: m.get_default_memory_pool().free_all_blocks()),
                          ("torch", lambda m: m.cuda.empty_cache() if m.cuda.is_initialized() else None)):
        module = sys.modules.get(name)
        if module is not None:
            release(module)


def pytest_runtest_setup(item):
    """The global generators start from the run's seed and the test's id: a test that draws from
    them (torch.randn, say) gets the same values on a replay, whatever ran before it."""
    seed = seeds.seed_of(item.nodeid)
    random.seed(seed)
    np.random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


@pytest.fixture(autouse=True)
def _gpu_test_deadline(request):
    """Arms the watchdog around every GPU test that runs (skipped ones never get here)."""
    seconds = seconds_from_env(180.0) if request.node.get_closest_marker("gpu") is not None else 0
    if not seconds:
        yield
        return
    capture = request.config.pluginmanager.getplugin("capturemanager")
    timer = arm(seconds, f"GPU test {request.node.nodeid}", before=getattr(capture, "suspend", None),
                also_to=_watchdog_dir() / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.txt")
    try:
        yield
    finally:
        timer.cancel()
