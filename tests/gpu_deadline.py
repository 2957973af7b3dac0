"""A per-test deadline for the GPU tests: a kernel that never finishes (a barrier that waits for
bytes that never come, say) blocks the test process inside a CUDA call forever, and with it the
whole GPU job. The watchdog ends the process instead, naming the test and printing every thread's
stack, so one hung kernel costs one deadline rather than the job's time limit.

The timer runs on its own thread; CuPy releases the GIL while it waits on the device, so the timer
fires even when the main thread is stuck in a synchronize.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

#: Exit status of a process the watchdog ended (distinct from pytest's own 1-5).
EXIT_STATUS = 86


def arm(seconds: float, what: str, *, before: Callable[[], None] | None = None,
        also_to: Path | None = None) -> threading.Timer:
    """Start a deadline of ``seconds`` for ``what``; ``cancel()`` the returned timer when it is done.

    At expiry, ``before()`` runs first (pytest's output capture is suspended there, or the report
    would go into a capture that the exit discards), then the report goes to stderr and, appended,
    to the file ``also_to`` (which a parallel run's main process prints: a worker's stderr does not
    reach the terminal).
    """

    def expire():
        if before is not None:
            try:
                before()
            except Exception:  # the report matters more than the capture's state
                pass
        message = (f"\nwatchdog: {what} still running after {seconds:g} s; ending the process "
                   f"(a kernel that never finished?). Stacks:\n")
        streams = [sys.stderr]
        if also_to is not None:
            try:
                also_to.parent.mkdir(parents=True, exist_ok=True)
                streams.append(open(also_to, "a"))
            except OSError:
                pass
        for stream in streams:
            stream.write(message)
            stream.flush()
            faulthandler.dump_traceback(file=stream, all_threads=True)
            stream.flush()
        os._exit(EXIT_STATUS)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def seconds_from_env(default: float) -> float:
    """``SPLITKV_TEST_TIMEOUT`` (seconds per GPU test; 0 turns the watchdog off), else ``default``."""
    text = os.environ.get("SPLITKV_TEST_TIMEOUT", "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"SPLITKV_TEST_TIMEOUT: expected seconds (0: off), got {text!r}") from None
    if value < 0:
        raise ValueError(f"SPLITKV_TEST_TIMEOUT: expected seconds >= 0 (0: off), got {text!r}")
    return value
