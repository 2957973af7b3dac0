"""Test-wide setup: GPU tests are marked and skipped cleanly where no CUDA device can be used.

Everything under tests/gpu/ is marked `gpu`; tests elsewhere may carry the mark explicitly. On a
machine without a usable device those tests are skipped with the reason, so the CPU suite runs the
same way on a laptop and in CI. On a GPU host, set SPLITKV_REQUIRE_GPU=1 to turn that skip into an
error: a GPU run that silently tests nothing is worse than one that fails.

Each GPU test that runs has a deadline (``SPLITKV_TEST_TIMEOUT`` seconds, default 180; 0: none):
past it, the watchdog (tests/gpu_deadline.py) ends the run and names the test, so a kernel that hangs
costs one deadline instead of the GPU job's whole time limit.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from gpu_deadline import arm, seconds_from_env

_GPU_DIR = Path(__file__).resolve().parent / "gpu"


@functools.lru_cache(maxsize=None)
def _no_gpu_reason() -> str | None:
    """None when a CUDA device is usable, else why not. Asked once, and only when a GPU test runs."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CuPy build that cannot find its CUDA libraries
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError without a driver or device
        return f"no usable CUDA device (cupy.cuda.runtime.getDeviceCount() raised {type(e).__name__}: {e})"
    if count == 0:
        return "no CUDA device (cupy.cuda.runtime.getDeviceCount() returned 0)"
    return None


def _under_gpu_dir(item) -> bool:
    try:
        Path(item.path).resolve().relative_to(_GPU_DIR)
    except ValueError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    gpu_items = []
    for item in items:
        if _under_gpu_dir(item):
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("gpu") is not None:
            gpu_items.append(item)
    if not gpu_items:
        return
    reason = _no_gpu_reason()
    if reason is None:
        return
    if os.environ.get("SPLITKV_REQUIRE_GPU") == "1":
        raise pytest.UsageError(f"SPLITKV_REQUIRE_GPU=1 but {reason}")
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_test_deadline(request):
    """Arms the watchdog around every GPU test that runs (skipped ones never get here)."""
    seconds = seconds_from_env(180.0) if request.node.get_closest_marker("gpu") is not None else 0
    if not seconds:
        yield
        return
    timer = arm(seconds, f"GPU test {request.node.nodeid}")
    try:
        yield
    finally:
        timer.cancel()
