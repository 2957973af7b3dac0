"""The GPU tests' watchdog (tests/gpu_deadline.py): it ends a stuck process, and only a stuck one."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_deadline import EXIT_STATUS, seconds_from_env

_TESTS = str(Path(__file__).resolve().parent)


def _run(body: str) -> tuple[subprocess.CompletedProcess, float]:
    code = f"import sys, time; sys.path.insert(0, {_TESTS!r}); from gpu_deadline import arm\n{body}"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - start


def test_a_stuck_process_is_ended_with_the_test_named():
    done, elapsed = _run("arm(0.5, 'GPU test tests/gpu/x.py::stuck')\ntime.sleep(30)")
    assert done.returncode == EXIT_STATUS
    assert "GPU test tests/gpu/x.py::stuck still running after 0.5 s" in done.stderr
    assert 'File "<string>", line 3' in done.stderr  # the stuck main thread's stack
    assert elapsed < 20


def test_the_report_follows_the_hook_and_is_kept_in_a_file(tmp_path):
    # The conftest suspends pytest's capture in the hook, and a parallel run's main process prints
    # the file: a worker's stderr never reaches the terminal.
    report = tmp_path / "reports" / "gw0.txt"
    done, _ = _run(f"from pathlib import Path\n"
                   f"arm(0.5, 'GPU test t', before=lambda: sys.stderr.write('capture suspended\\n'), "
                   f"also_to=Path({str(report)!r}))\ntime.sleep(30)")
    assert done.returncode == EXIT_STATUS
    assert done.stderr.index("capture suspended") < done.stderr.index("watchdog: GPU test t still running")
    kept = report.read_text()
    assert "watchdog: GPU test t still running after 0.5 s" in kept and 'File "<string>", line 4' in kept


def test_a_cancelled_deadline_never_fires():
    done, _ = _run("timer = arm(0.5, 'quick')\ntimer.cancel()\ntime.sleep(1.5)\nprint('finished')")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "finished"


def test_timeout_setting(monkeypatch):
    monkeypatch.delenv("SPLITKV_TEST_TIMEOUT", raising=False)
    assert seconds_from_env(180.0) == 180.0
    monkeypatch.setenv("SPLITKV_TEST_TIMEOUT", "0")
    assert seconds_from_env(180.0) == 0.0
    monkeypatch.setenv("SPLITKV_TEST_TIMEOUT", "42.5")
    assert seconds_from_env(180.0) == 42.5
    for bad in ("soon", "-1"):
        monkeypatch.setenv("SPLITKV_TEST_TIMEOUT", bad)
        with pytest.raises(ValueError, match="SPLITKV_TEST_TIMEOUT"):
            seconds_from_env(180.0)
