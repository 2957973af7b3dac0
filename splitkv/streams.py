"""CUDA devices and streams for the runtime: switching to them, and ordering work between them.

`use_stream` and `on_device` make a stream or device current for a block. `StreamOrder` orders a
`DecodeAttention`'s plan() writes (lengths, zeroed counters, workspace) before the kernels of
its run() calls, and those kernels before the next plan's writes, when the caller plans on one
stream and runs on another (a common mix: host lengths planned on CuPy's current stream, torch
tensors run on torch's). `wait_for_producer` honours the ``stream`` entry of an input's
``__cuda_array_interface__``. All of it is events recorded and waited on by the GPU: the host
never waits.
"""

from __future__ import annotations

import contextlib

#: cudaEventWaitExternal: a wait recorded into a graph under capture as an event-wait node, which
#: each replay then honours (a plain wait may not name an event recorded outside the capture).
_WAIT_EXTERNAL = 1
#: The interface's (and the runtime API's) handle of the legacy default stream, which CuPy and
#: torch call 0.
_LEGACY_DEFAULT = 1

_streams: dict[tuple, object] = {}


@contextlib.contextmanager
def on_device(ordinal: int):
    """CUDA device ``ordinal`` current for the block (its programs, workspace and streams live
    there); nothing is switched when it already is, the common case on a launch's path."""
    import cupy

    if cupy.cuda.runtime.getDevice() == ordinal:
        yield
    else:
        with cupy.cuda.Device(ordinal):
            yield


@contextlib.contextmanager
def use_stream(ptr: int):
    """Makes the stream with handle ``ptr`` CuPy's current one for the block, then gives back the
    caller's current stream, whether it was entered with ``with`` or set with ``.use()``.

    The CuPy stream objects are cached per (device, handle) and never dropped: creating one per
    launch costs host time, handle 0 is a different stream on every device, and a collected one
    would destroy the caller's stream."""
    import cupy

    key = (cupy.cuda.Device().id, ptr)
    stream = _streams.get(key)
    if stream is None:
        stream = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        _streams[key] = stream
    previous = cupy.cuda.get_current_stream()
    stream.use()
    try:
        yield stream
    finally:
        previous.use()


class _StreamHandle:
    """A raw stream handle in the CUDA stream protocol, which CuPy's Stream.from_external takes."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def same_stream(a: int, b: int) -> bool:
    """Whether two handles name one stream (0 and 1 both name the legacy default stream)."""
    return _canonical(a) == _canonical(b)


def _canonical(ptr: int) -> int:
    return 0 if ptr == _LEGACY_DEFAULT else ptr


def is_capturing(ptr: int) -> bool:
    """Whether stream ``ptr`` is being captured into a CUDA graph (a query; it never waits)."""
    import cupy

    runtime = cupy.cuda.runtime
    return runtime.streamIsCapturing(ptr) != runtime.streamCaptureStatusNone


def _new_event():
    import cupy

    return cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)


def _wait(waiter: int, event) -> None:
    """Work queued on ``waiter`` from now on runs after what ``event`` recorded."""
    import cupy

    flags = _WAIT_EXTERNAL if is_capturing(waiter) else 0
    cupy.cuda.runtime.streamWaitEvent(waiter, event.ptr, flags)


def _record(event, ptr: int) -> None:
    import cupy

    cupy.cuda.runtime.eventRecord(event.ptr, ptr)


class StreamOrder:
    """Orders one workspace's writers (plan) and readers (run) across streams.

    After `planned(stream)`, the first `before_run` on each other stream makes it wait for the
    plan's writes; `after_run` on a stream other than the plan's records the launch, and the next
    `before_plan` waits for every such launch before the workspace is written again. On a single
    stream (decode(), and every caller that passes the same stream to both) the only cost is the
    one event each plan records; nothing is waited on. Create it on the device whose streams it
    orders; its events live there.
    """

    def __init__(self):
        self._plan_stream: int | None = None
        self._plan_done = None  # event: the last plan's writes
        self._ordered: set[int] = set()  # streams whose later work already follows that plan
        self._runs_elsewhere: dict[int, object] = {}  # stream -> event after its last launch
        self._plan_moved = None  # event: the previous plan's stream, when the next plan is on another

    def before_plan(self, ptr: int) -> None:
        """Called on the plan's stream before it writes: it waits for runs on other streams,
        including the previous plan's stream when this plan moves to another one."""
        for stream, event in self._runs_elsewhere.items():
            if not same_stream(stream, ptr):
                _wait(ptr, event)
        self._runs_elsewhere.clear()
        previous = self._plan_stream
        if previous is not None and not same_stream(previous, ptr) and not is_capturing(previous):
            # Runs on the previous plan's stream were not recorded (they followed that plan anyway).
            if self._plan_moved is None:
                self._plan_moved = _new_event()
            _record(self._plan_moved, previous)
            _wait(ptr, self._plan_moved)

    def planned(self, ptr: int) -> None:
        """Called after the plan's writes were queued on stream ``ptr``."""
        if self._plan_done is None:
            self._plan_done = _new_event()
        _record(self._plan_done, ptr)
        self._plan_stream = ptr
        self._ordered = {_canonical(ptr)}

    def before_run(self, ptr: int) -> None:
        """Called before a launch on stream ``ptr``: the first on a stream other than the plan's
        waits for the plan's writes. A stream under graph capture waits on every capture (the wait
        becomes a node of that graph), so each graph's replays follow the latest plan."""
        if _canonical(ptr) in self._ordered or self._plan_done is None:
            return
        _wait(ptr, self._plan_done)
        if not is_capturing(ptr):
            self._ordered.add(_canonical(ptr))

    def after_run(self, ptr: int) -> None:
        """Called after a launch on stream ``ptr``: the next plan waits for it when the streams
        differ. Launches captured into a graph are not recorded: replays are the caller's to order."""
        if self._plan_stream is None or same_stream(ptr, self._plan_stream) or is_capturing(ptr):
            return
        event = self._runs_elsewhere.get(ptr)
        if event is None:
            event = self._runs_elsewhere[ptr] = _new_event()
        _record(event, ptr)


def wait_for_producer(producer: int | None, consumer: int, event_holder: dict) -> None:
    """Orders stream ``consumer`` after stream ``producer`` (an input's ``__cuda_array_interface__``
    ``stream``: None means no ordering is needed). ``event_holder`` keeps one reusable event per
    producer stream: a wait takes the event's state when it is queued, so reuse is safe."""
    if producer is None or same_stream(producer, consumer):
        return
    event = event_holder.get(producer)
    if event is None:
        event = event_holder[producer] = _new_event()
    _record(event, producer)
    _wait(consumer, event)
