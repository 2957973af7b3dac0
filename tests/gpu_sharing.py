"""One GPU shared by the processes of a parallel test run (pytest -n N), and tests that need it alone.

Most GPU tests check outputs, which do not depend on what else runs on the device, so pytest-xdist
can run them in several processes at once. A test marked ``gpu_exclusive`` times kernels, or races
the host against a busy kernel, and must have the GPU to itself. Two lock files shared by the run's
processes arrange that: every GPU test holds the gate shared while it runs, an exclusive one holds
it alone. The turnstile in front of the gate keeps an exclusive test from waiting for ever behind a
stream of shared holders: while it waits for the gate, no other test passes the turnstile.

``flock`` locks belong to the open file, so each process opens the files once, and a process that
dies (a test ended by the watchdog) lets go of its locks with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class GpuGate:
    """The locks of one run, in ``folder`` (shared by all its processes)."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self._turnstile = os.open(folder / "turnstile.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._gate = os.open(folder / "gate.lock", os.O_RDWR | os.O_CREAT, 0o600)

    @contextlib.contextmanager
    def held(self, exclusive: bool):
        """Hold the GPU for one test: with others (``exclusive`` False) or alone."""
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            # Exclusive: wait here for the shared holders to finish, while newcomers wait at the
            # turnstile. Shared: pass at once unless an exclusive test holds the gate.
            fcntl.flock(self._gate, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in (self._turnstile, self._gate):
            os.close(fd)
