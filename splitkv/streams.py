"""CUDA devices and streams for the runtime: switching to them, and ordering work between them.

`use_stream` and `on_device` make a stream or device current for a block. `StreamOrder` keeps a
`DecodeAttention`'s plan() writes (lengths, zeroed counters) and run() kernels (which write the
partials and counters) in call order when the caller uses more than one stream (a common mix:
host lengths planned on CuPy's current stream, torch tensors run on torch's).
`wait_for_producer` honours the ``stream`` entry of an input's ``__cuda_array_interface__``.
All of it is events recorded and waited on by the GPU: the host never waits.
"""

from __future__ import annotations

import contextlib
import threading

#: cudaEventWaitExternal: a wait recorded into a graph under capture as an event-wait node, which
#: each replay then honours (a plain wait may not name an event recorded outside the capture).
_WAIT_EXTERNAL = 1
#: The interface's (and the runtime API's) handle of the legacy default stream, which CuPy and
#: torch call 0.
_LEGACY_DEFAULT = 1
#: cudaStreamPerThread: one handle, and in every thread that thread's own default stream.
PER_THREAD_DEFAULT = 2

_streams: dict[tuple, object] = {}


def on_device(ordinal: int):
    """A context manager that makes CUDA device ``ordinal`` current for its block (its programs,
    workspace and streams live there); nothing is switched when it already is, the common case on
    a launch's path, which then costs one query (a generator-based manager costs several)."""
    if _runtime().getDevice() == ordinal:
        return _NO_SWITCH
    import cupy

    return cupy.cuda.Device(ordinal)


_NO_SWITCH = contextlib.nullcontext()


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


def stream_key(ptr: int):
    """What identifies the stream behind handle ``ptr`` in the calling thread: 0 and 1 both name the
    legacy default stream, and 2 names the calling thread's own default stream."""
    if ptr == _LEGACY_DEFAULT:
        return 0
    if ptr == PER_THREAD_DEFAULT:
        return (PER_THREAD_DEFAULT, threading.get_ident())
    return ptr


_cuda_runtime = None


def _runtime():
    """CuPy's CUDA runtime module, imported on first use (importing this module needs no CuPy)
    and kept: an import statement on every launch costs more than the query it serves."""
    global _cuda_runtime
    if _cuda_runtime is None:
        from cupy.cuda import runtime

        _cuda_runtime = runtime
    return _cuda_runtime


def is_capturing(ptr: int) -> bool:
    """Whether stream ``ptr`` is being captured into a CUDA graph (a query; it never waits)."""
    return bool((_cuda_runtime or _runtime()).streamIsCapturing(ptr))  # every run(): no call to _runtime


def capture_id(ptr: int) -> int | None:
    """The id of the capture that stream ``ptr`` is in (unique in the process), from
    cudaStreamGetCaptureInfo; None when it cannot be asked. Called only while ``ptr`` captures."""
    import ctypes

    function = _capture_info()
    if function is None:
        return None
    status, capture = ctypes.c_int(), ctypes.c_ulonglong()
    # The optional outputs passed as NULL: CUDA 12's runtime exports a version of the call with
    # fewer of them (it ignores the rest), CUDA 13's the one with all six.
    if function(ctypes.c_void_p(ptr), ctypes.byref(status), ctypes.byref(capture), None, None, None, None) != 0:
        return None
    return capture.value if status.value == _CAPTURE_ACTIVE else None


#: cudaStreamCaptureStatusActive.
_CAPTURE_ACTIVE = 1
_capture_info_function: list = []


def _capture_info():
    """cudaStreamGetCaptureInfo of the CUDA runtime CuPy loads (through cuda-pathfinder, as CuPy
    finds it), or None where it cannot be loaded."""
    if not _capture_info_function:
        import ctypes

        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib

            function = ctypes.CDLL(load_nvidia_dynamic_lib("cudart").abs_path).cudaStreamGetCaptureInfo
            function.restype = ctypes.c_int
        except Exception:  # noqa: BLE001 - no id: a wait per captured call, as correct and slower
            function = None
        _capture_info_function.append(function)
    return _capture_info_function[0]


def _new_event():
    import cupy

    return cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)


def _wait(waiter: int, event, *, in_capture: bool = False) -> None:
    """Work queued on ``waiter`` from now on runs after what ``event`` recorded. ``in_capture``:
    the event was recorded by work of the capture ``waiter`` belongs to (a plain wait, which
    becomes an edge of that graph); otherwise a capturing ``waiter`` gets an event-wait node."""
    import cupy

    flags = _WAIT_EXTERNAL if is_capturing(waiter) and not in_capture else 0
    cupy.cuda.runtime.streamWaitEvent(waiter, event.ptr, flags)


def _record(event, ptr: int) -> None:
    (_cuda_runtime or _runtime()).eventRecord(event.ptr, ptr)


class StreamOrder:
    """Puts one workspace's users (plan() writes it, run() writes and reads it) in call order on the
    GPU, whichever streams they are called on.

    `enter(stream)` before queuing work: when the last work was queued on another stream, this
    stream waits for it. `leave(stream)` after: an event is recorded there, so the next work on
    another stream can wait for it. One event, re-recorded each time: a wait takes its state when
    it is queued, and each wait follows the previous work, so the waits chain every plan and run
    in order. The event is recorded while its stream is alive, so later waits never touch a
    stream the caller may have destroyed. Under graph capture the wait becomes an event-wait node,
    which each replay honours (it then follows the latest plan or run outside the graph); one node
    per capture and stream: the work captured after it on that stream follows it in the graph, and
    each node costs every replay about a microsecond on the GPU. Work captured into a graph records
    nothing, so replays are the caller's to order against later plans. Create it on the device
    whose streams it orders; its event lives there.
    """

    def __init__(self):
        self._done = None  # event after the last work queued outside a capture
        self._last = None  # stream_key of the stream it was recorded on
        # its handle: a handle equal to it names the same stream, unless it is the per-thread
        # default stream's (one handle, a stream per thread), which is never kept here
        self._last_ptr = None
        self._waited_in = None  # (capture id, stream_key) of the capture whose graph waits already

    def enter(self, ptr: int) -> bool:
        """Orders stream ``ptr`` after the last work, when that was on another stream, or when
        ``ptr`` is being captured and this capture has no wait on it yet. Returns whether ``ptr``
        is being captured."""
        capturing = is_capturing(ptr)
        if self._done is None:
            return capturing
        if capturing:
            # The event-wait node waits at each replay for the event's latest record, so one per
            # capture and stream orders all the work captured there after it. Without the
            # capture's id (None) every captured call gets its own.
            capture = (capture_id(ptr), stream_key(ptr))
            if capture[0] is None or capture != self._waited_in:
                _wait(ptr, self._done)
                self._waited_in = capture
        elif ptr != self._last_ptr and stream_key(ptr) != self._last:
            _wait(ptr, self._done)
        return capturing

    def synchronize(self) -> None:
        """Waits on the host until the last recorded work is done (before memory it may still use
        goes back to a pool that may hand it out on another stream)."""
        if self._done is not None:
            self._done.synchronize()

    def leave(self, ptr: int, capturing: bool) -> None:
        """Records the work just queued on ``ptr`` (not when it was captured into a graph)."""
        if capturing:
            return
        if self._done is None:
            self._done = _new_event()
        _record(self._done, ptr)
        if ptr != self._last_ptr:
            self._last, self._last_ptr = stream_key(ptr), None if ptr == PER_THREAD_DEFAULT else ptr


def wait_for_producer(producer: int | None, consumer: int, event_holder: dict) -> None:
    """Orders stream ``consumer`` after stream ``producer`` (an input's ``__cuda_array_interface__``
    ``stream``: None means no ordering is needed). ``event_holder`` keeps one reusable event per
    producer stream: a wait takes the event's state when it is queued, so reuse is safe."""
    if producer is None or stream_key(producer) == stream_key(consumer):
        return
    if is_capturing(consumer) and stream_key(producer) == 0:
        # Recording on the legacy default stream would synchronise with, and so invalidate, the capture.
        raise RuntimeError("an input's __cuda_array_interface__ names the legacy default stream as its producer, "
                           "which cannot be waited for while the launch stream is being captured; finish the "
                           "producer's work before the capture, or produce the input on a non-default stream")
    event = event_holder.get(producer)
    if event is None:
        event = event_holder[producer] = _new_event()
    _record(event, producer)
    _wait(consumer, event, in_capture=is_capturing(producer))
