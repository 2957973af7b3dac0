"""The test run's own rules (tests/conftest.py), checked on runs of small test trees in subprocesses:
a GPU run fails when a GPU test module skips at import, one seed per run reaches every process,
compiles land in the run's cache and never in the user's, a run that writes into the package's
tuned tables fails, and a parallel run gives the GPU alone to the tests that need it
(tests/gpu_sharing.py)."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import seeds
from gpu_sharing import GpuGate

_TESTS = Path(__file__).resolve().parent
_ROOT = _TESTS.parent

_SKIPS_AT_IMPORT = '''import pytest

pytest.importorskip("splitkv_no_such_module")


def test_never_runs():
    pass
'''

_RECORDS = '''import json, os
import pytest


@pytest.mark.parametrize("n", range(4))
def test_records_what_it_sees(n):
    with open(os.path.join(os.environ["RECORDS"], f"{n}.json"), "w") as f:
        json.dump({"seed": os.environ["SPLITKV_TEST_SEED"], "cache": os.environ["SPLITKV_CACHE_DIR"],
                   "worker": os.environ.get("PYTEST_XDIST_WORKER")}, f)
'''

_COMPILES = '''from splitkv.codegen import MergeSpec, compile_cubin


def test_compiles():
    assert compile_cubin(MergeSpec(arch="sm_90", head_dim=64, out_dtype="bf16")).cubin_path.exists()
'''

_WRITES_A_TABLE = '''from pathlib import Path


def test_writes():
    Path("splitkv/tuned_configs/sm_90/X.yaml").write_text("{}")
'''


def _tree(tmp_path: Path, modules: dict) -> Path:
    """A project of ``modules`` ({path under tests/: source}) run with this project's conftest and
    its helpers, and its pytest settings."""
    root = tmp_path / "tree"
    (root / "tests" / "gpu").mkdir(parents=True)
    shutil.copy(_ROOT / "pyproject.toml", root)
    for helper in _TESTS.glob("*.py"):
        if not helper.name.startswith("test_"):
            shutil.copy(helper, root / "tests")
    for name, text in modules.items():
        (root / "tests" / name).write_text(text)
    return root


def _pytest(root: Path, env: dict, *args) -> subprocess.CompletedProcess:
    """pytest in ``root`` with this environment less the run's own settings (this run's seed, cache and
    folders, pytest's variables), plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SPLITKV_", "PYTEST_", "HYPOTHESIS_"))}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=root,
                          env={**base, **env}, capture_output=True, text=True, timeout=300)


def _header_seed(output: str) -> str:
    return re.search(r"^splitkv: SPLITKV_TEST_SEED=(\d+) ", output, re.M).group(1)


def test_a_gpu_module_that_skips_at_import_fails_a_run_that_requires_the_gpu(tmp_path):
    root = _tree(tmp_path, {"gpu/test_needs_missing.py": _SKIPS_AT_IMPORT,
                            "test_cpu_needs_missing.py": _SKIPS_AT_IMPORT,
                            "test_ok.py": "def test_ok():\n    pass\n"})
    plain = _pytest(root, {})
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "1 passed, 2 skipped" in plain.stdout
    required = _pytest(root, {"SPLITKV_REQUIRE_GPU": "1", "SPLITKV_TEST_SEED": "12345"})
    out = required.stdout
    assert required.returncode == 2, out + required.stderr
    assert "ERROR tests/gpu/test_needs_missing.py" in out
    assert ("SPLITKV_REQUIRE_GPU=1, but this GPU test module skipped at import: "
            "could not import 'splitkv_no_such_module'") in out
    # A module outside tests/gpu may still skip; the given seed is the run's.
    assert "SKIPPED [1] tests/test_cpu_needs_missing.py" in out
    assert _header_seed(out) == "12345"


def test_a_run_that_writes_into_the_tuned_tables_fails_and_names_the_file(tmp_path):
    root = _tree(tmp_path, {"test_writes.py": _WRITES_A_TABLE})
    (root / "splitkv" / "tuned_configs" / "sm_90").mkdir(parents=True)
    done = _pytest(root, {})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    assert "written or removed during the run: splitkv/tuned_configs/sm_90/X.yaml" in done.stdout


@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed")
@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="compiling needs CuPy's NVRTC")
def test_workers_share_the_seed_and_a_cache_of_the_run_and_nothing_lands_in_home(tmp_path):
    root = _tree(tmp_path, {"test_records.py": _RECORDS, "test_compiles.py": _COMPILES})
    records, home = tmp_path / "records", tmp_path / "home"
    records.mkdir()
    home.mkdir()
    # XDG_CACHE_HOME empty counts as unset: the user's cache would be ~/.cache/splitkv, in the empty home.
    done = _pytest(root, {"RECORDS": str(records), "HOME": str(home), "XDG_CACHE_HOME": ""}, "-n", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 passed" in done.stdout
    seed = _header_seed(done.stdout)
    cache = re.search(r"^splitkv: kernel cache (\S+) \(this run's", done.stdout, re.M).group(1)
    seen = [json.loads(p.read_text()) for p in sorted(records.glob("*.json"))]
    assert len(seen) == 4 and {s["worker"] for s in seen} <= {"gw0", "gw1"}
    assert all(s["seed"] == seed and s["cache"] == cache for s in seen), seen
    # CuPy makes its own kernel cache folder in the home as it is imported; nothing may be written.
    assert not [p for p in home.rglob("*") if not p.is_dir()], "the run wrote into the user's home"
    assert not (home / ".cache").exists(), "the run made the user's cache folder"
    assert not Path(cache).exists(), "a passing run leaves its cache behind"


def test_hypothesis_and_the_global_generators_draw_from_the_run_seed(request):
    pytest.importorskip("hypothesis")
    if not any(a.startswith("--hypothesis-seed") for a in request.config.invocation_params.args):
        assert request.config.getoption("--hypothesis-seed") == str(seeds.run_seed())
    seed = seeds.seed_of(request.node.nodeid)
    assert random.random() == random.Random(seed).random()
    assert np.random.random() == np.random.RandomState(seed).random()


def _locked(path: Path) -> bool:
    """Whether some holder has ``path`` locked (a probe on an open file of its own)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _enter(gate: GpuGate, exclusive: bool, release: threading.Event) -> tuple[threading.Thread, threading.Event]:
    """A thread that holds ``gate`` until ``release``; the event it returns says it got it."""
    inside = threading.Event()

    def hold():
        with gate.held(exclusive):
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    return thread, inside


def test_an_exclusive_gpu_test_waits_for_the_others_and_holds_back_the_next(tmp_path):
    # Each GpuGate opens the lock files anew, as each worker process does: here they are threads.
    folder = tmp_path / "locks"
    first, exclusive, later = gates = [GpuGate(folder) for _ in range(3)]
    releases = [threading.Event() for _ in range(3)]
    threads = []
    try:
        thread, first_in = _enter(first, False, releases[0])
        threads.append(thread)
        assert first_in.wait(10)
        thread, exclusive_in = _enter(exclusive, True, releases[1])
        threads.append(thread)
        for _ in range(1000):  # until the exclusive one waits at the gate, holding the turnstile
            assert not exclusive_in.is_set(), "an exclusive holder got in beside a shared one"
            if _locked(folder / "turnstile.lock"):
                break
            exclusive_in.wait(0.01)
        else:
            pytest.fail("the exclusive holder never held the turnstile while it waited")
        thread, later_in = _enter(later, False, releases[2])
        threads.append(thread)
        assert not exclusive_in.wait(0.2), "an exclusive holder got in beside a shared one"
        assert not later_in.is_set(), "a shared holder passed a waiting exclusive one"
        releases[0].set()
        assert exclusive_in.wait(10)
        assert not later_in.wait(0.2), "a shared holder got in beside an exclusive one"
        releases[1].set()
        assert later_in.wait(10)
    finally:
        for release in releases:
            release.set()
        for thread in threads:
            thread.join(10)
        for gate in gates:
            gate.close()
