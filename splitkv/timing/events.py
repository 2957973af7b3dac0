"""CUDA events around calls on one stream, with the L2 flushed before each (the flush protocol).

`Harness` owns the stream every measured call runs on (created by torch when torch is given, so
that CuPy and torch launch into one queue), a flush buffer of at least twice the L2, and the
protocol of `Harness.time`. The benchmark's flush protocol and the tuner's objective both time
through it.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings

from .stats import percentile

#: A call whose host time exceeds this fraction of the flushes' GPU time may have left the GPU idle
#: inside its timed region: its figure is an upper bound (the benchmark marks it '~').
HOST_BOUND_FRACTION = 0.8
#: The flush is repeated until its GPU time exceeds the warm-up's p90 host time by this factor...
HOST_MARGIN = 1.5
#: ...but not beyond this many memsets per timed call.
MAX_FLUSH_REPS = 16


def cupy_stream_of(cupy, torch_stream):
    """A CuPy stream object for a torch stream (the same CUDA stream, owned by torch)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(torch_stream)
        except TypeError:  # a torch without the CUDA stream protocol
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(torch_stream.cuda_stream)


class Harness:
    """One stream shared by CuPy and torch, an L2 flush buffer, and the timing protocol."""

    def __init__(self, iters: int, warmup: int, flush_bytes: int, torch_mod=None):
        import cupy

        self.cupy = cupy
        self.torch = torch_mod
        self.iters = iters
        self.warmup = warmup
        if torch_mod is not None:
            # torch owns the stream and CuPy wraps it, so splitkv (whichever framework it asks for
            # the current stream), the peers, the flush and the events all share one queue.
            self.torch_stream = torch_mod.cuda.Stream()
            self.stream = cupy_stream_of(cupy, self.torch_stream)
        else:
            self.torch_stream = None
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.flush_bytes = int(flush_bytes)
        self._flush_buf = cupy.empty(self.flush_bytes, dtype=cupy.uint8)
        self.flush_us = None
        self.last_host_us = []
        self.last_flush_reps = 1

    @contextlib.contextmanager
    def active(self):
        """Make the harness stream current for both CuPy and torch."""
        with contextlib.ExitStack() as stack:
            if self.torch_stream is not None:
                stack.enter_context(self.torch.cuda.stream(self.torch_stream))
            stack.enter_context(self.stream)
            yield

    def flush_l2(self):
        runtime = self.cupy.cuda.runtime
        runtime.memsetAsync(self._flush_buf.data.ptr, 0, self.flush_bytes, self.stream.ptr)

    def synchronize(self):
        self.stream.synchronize()

    def time(self, fn, iters: int | None = None, context=None) -> list[float]:
        """Per-call times in µs: warm-up, then flush + event + call + event, ``iters`` times.

        The flush must take longer on the GPU than one iteration takes on the host, so that the
        queue stays ahead of the GPU and host-side launch overhead stays out of the figure. The
        warm-up calls measure that host time, and the flush is repeated as often as it takes
        (``last_flush_reps``): one flush or several leave the L2 in the same state. The host time
        of every timed call is kept in ``last_host_us`` to show when the queue ran dry anyway.
        """
        cupy = self.cupy
        n = int(iters or self.iters)
        clock = time.perf_counter
        host = [0.0] * n
        with (context() if context is not None else contextlib.nullcontext()):
            warm_host = []
            for _ in range(max(self.warmup, 3)):
                t0 = clock()
                fn()
                warm_host.append(clock() - t0)
            self.synchronize()
            reps = 1
            if self.flush_us:
                needed_us = HOST_MARGIN * percentile(warm_host, 90) * 1e6
                reps = min(MAX_FLUSH_REPS, max(1, math.ceil(needed_us / self.flush_us)))
            self.last_flush_reps = reps
            starts = [cupy.cuda.Event() for _ in range(n)]
            ends = [cupy.cuda.Event() for _ in range(n)]
            for i in range(n):
                for _ in range(reps):
                    self.flush_l2()
                starts[i].record(self.stream)
                t0 = clock()
                fn()
                host[i] = clock() - t0
                ends[i].record(self.stream)
            self.synchronize()
        self.last_host_us = [h * 1e6 for h in host]
        return [cupy.cuda.get_elapsed_time(s, e) * 1000.0 for s, e in zip(starts, ends)]

    def host_bound(self) -> bool:
        """Whether the last `time` may have measured the host: its calls' median host time
        exceeded `HOST_BOUND_FRACTION` of the flushes' GPU time before each."""
        if not self.flush_us or not self.last_host_us:
            return False
        return percentile(self.last_host_us, 50) > HOST_BOUND_FRACTION * self.flush_us * self.last_flush_reps

    def flush_time_us(self) -> float:
        """Median GPU time of one L2 flush: the host time an iteration may take unnoticed."""
        self.flush_l2()
        self.synchronize()
        samples = []
        for _ in range(20):
            start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
            start.record(self.stream)
            self.flush_l2()
            end.record(self.stream)
            end.synchronize()
            samples.append(self.cupy.cuda.get_elapsed_time(start, end) * 1000.0)
        return percentile(samples, 50)
