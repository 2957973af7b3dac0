"""Timing a sequence of calls as an engine issues them: captured in one CUDA graph and replayed,
or launched back to back from the host.

A decode step runs one attention call per layer, each layer reading K/V of its own. Timing one
layer alone after an L2 flush (`Harness.time`) leaves out how calls follow each other; these two
time the whole sequence and give the time per call:

* `time_replays`: a torch CUDA graph of the calls, replayed; CUDA events around each replay, so
  that no host time is in the figure (the serving protocol);
* `time_back_to_back`: the calls issued one after another by the host, from an idle GPU to the end
  of a synchronize, on the host clock, so that the host time of each call is in the figure
  wherever it exceeds the GPU time (the eager protocol).
"""

from __future__ import annotations

import contextlib
import math
import time

from .events import cupy_stream_of


def capture_graph(calls, torch_mod, context=None):
    """A ``torch.cuda.CUDAGraph`` holding ``calls`` (no-argument launches) in order, captured on
    torch's capture stream, with CuPy's current stream pointed at it too (so that CuPy launches,
    the read floor's say, land in the graph). The calls must have run once before (compiles, JIT
    and lazy allocations stay out of the capture)."""
    import cupy

    graph = torch_mod.cuda.CUDAGraph()
    with torch_mod.cuda.graph(graph):
        with cupy_stream_of(cupy, torch_mod.cuda.current_stream()), \
                (context() if context is not None else contextlib.nullcontext()):
            for call in calls:
                call()
    return graph


def time_replays(graph, replays: int, calls_per_replay: int, torch_mod) -> list[float]:
    """µs per call of each of ``replays`` replays of ``graph`` on the current stream.

    One untimed replay goes first and the timed ones are queued behind it without a wait: a replay
    takes far longer on the GPU than its launch on the host, so the queue never runs dry and no
    host time enters the events' interval.
    """
    cuda = torch_mod.cuda
    starts = [cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [cuda.Event(enable_timing=True) for _ in range(replays)]
    graph.replay()
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    ends[-1].synchronize()
    return [start.elapsed_time(end) * 1000.0 / calls_per_replay for start, end in zip(starts, ends)]


def back_to_back_count(num_calls: int, min_calls: int) -> int:
    """Passes over the calls that one back-to-back sample makes: at least ``min_calls`` calls, so
    that the start from an idle GPU and the final synchronize weigh little per call."""
    if num_calls <= 0:
        raise ValueError(f"num_calls: expected a positive int, got {num_calls!r}")
    return max(1, math.ceil(min_calls / num_calls))


def time_back_to_back(calls, samples: int, min_calls: int, synchronize, context=None,
                      clock=time.perf_counter) -> list[float]:
    """µs per call of each of ``samples`` samples: the calls issued in order, the sequence repeated
    `back_to_back_count` times, timed on the host from a synchronized (idle) GPU to the return of
    ``synchronize()`` after the last call, divided by the number of calls."""
    sequence = list(calls) * back_to_back_count(len(calls), min_calls)
    out = []
    with (context() if context is not None else contextlib.nullcontext()):
        for call in calls:  # warm: every call once, untimed
            call()
        synchronize()
        for _ in range(samples):
            t0 = clock()
            for call in sequence:
                call()
            synchronize()
            out.append((clock() - t0) * 1e6 / len(sequence))
    return out
