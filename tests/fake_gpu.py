"""A fake GPU for the runtime's host logic: CuPy's device, allocations, the program loader, the
tensor-map encoder and the stream switch are replaced by recorders, so what plan(), run() and
decode() would launch (and what they refuse) can be checked on any machine. The programs
themselves are checked on a GPU by tests/gpu.

pytest looks a fixture up by name in the test's module, so a module that uses ``fake_gpu`` imports
it: ``from tests.fake_gpu import fake_gpu  # noqa: F401 - a fixture, used by name``."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import types

import numpy as np
import pytest

from splitkv import arrays, launch as launching, oneshot, runtime, streams
from splitkv.params import DECODE, MERGE
from splitkv.spec import MergeSpec
from tests.test_inputs import FakeCAI


_next_address = [0x7E00_0000_0000]


def _allocate(nbytes: int) -> int:
    """A fresh device address for ``nbytes``: allocations never overlap (the runtime checks that
    its outputs do not overlap its inputs), each 16 MiB-aligned as a pool's large blocks are."""
    address = _next_address[0]
    _next_address[0] += -(-max(int(nbytes), 1) // (1 << 24)) * (1 << 24)
    return address


class _DeviceArray(FakeCAI):
    """A device array as far as the runtime sees one: an interface at a fresh address, a shape,
    and (for lengths) the values a read-back returns."""

    def __init__(self, shape, typestr="<f2", values=None):
        super().__init__(shape, typestr, ptr=_allocate(int(np.prod(shape)) * np.dtype(typestr).itemsize))
        self.shape = tuple(shape)
        self.host = None if values is None else np.asarray(values, dtype=np.int32)

    def get(self):
        return self.host.copy()


class _Buffer:
    """What cupy.zeros returns here: a pointer and host-side contents."""

    def __init__(self, size, dtype):
        self.size, self.host = size, np.zeros(size, dtype)
        self.data = types.SimpleNamespace(ptr=_allocate(self.host.nbytes))

    def __getitem__(self, _):
        return self

    def fill(self, value):
        self.host[:] = value

    def set(self, values):
        self.host[: values.size] = values


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    import cupy

    from splitkv import tensor_map
    from splitkv.codegen import load, occupancy

    record = types.SimpleNamespace(launches=[], maps=[], loads=[], current=0, stream=0, allocations=[])

    class Device(contextlib.AbstractContextManager):
        """Two GPUs; entering one makes it current until the block ends."""
        compute_capability = "90"
        attributes = {"MultiProcessorCount": 132}

        def __init__(self, ordinal=None):
            self.id = record.current if ordinal is None else ordinal

        def __enter__(self):
            self._previous, record.current = record.current, self.id
            return self

        def __exit__(self, *exc):
            record.current = self._previous

    programs = {}  # a loaded function's handle -> its spec

    def load_kernel(spec, source=None):
        record.loads.append((spec, record.current))
        function = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=len(programs) + 1))
        programs[function.kernel.ptr] = spec
        return function, types.SimpleNamespace(registers=96)

    def launch_kernel(call, stream, argument):
        # The one kernel argument points at the program's Params: read back as the kernel would.
        spec = programs[call[0]]
        struct = ctypes.c_uint64.from_address(argument).value
        params = (MERGE if isinstance(spec, MergeSpec) else DECODE).read(struct)
        record.launches.append(types.SimpleNamespace(spec=spec, grid=tuple(call[1:4]), block=call[4], smem=call[7],
                                                     params=params, device=record.current, stream=stream))

    def encode(ptr, rows, cols, elem_bytes, box_rows, box_bytes):
        tensor_map.box_geometry(rows, cols, elem_bytes, box_rows, box_bytes)  # the real checks of the view
        record.maps.append((ptr, rows, cols))
        return tensor_map._aligned_buffer()

    def to_cupy(x):
        if isinstance(x, _DeviceArray):
            return types.SimpleNamespace(get=x.get, data=types.SimpleNamespace(ptr=x.__cuda_array_interface__["data"][0]))
        raise AssertionError(f"unexpected array {x!r}")

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: record.current)
    monkeypatch.setattr(cupy, "zeros", lambda size, dtype: _Buffer(size, dtype))
    def empty(shape, dtype):
        record.allocations.append((tuple(shape), np.dtype(dtype).str, record.stream))
        return _DeviceArray(shape, np.dtype(dtype).str)

    @contextlib.contextmanager
    def current_stream(ptr):
        previous, record.stream = record.stream, ptr
        try:
            yield
        finally:
            record.stream = previous

    monkeypatch.setattr(cupy, "empty", empty)
    monkeypatch.setattr(load, "load_kernel", load_kernel)
    monkeypatch.setattr(launching, "launch_kernel", launch_kernel)
    monkeypatch.setattr(cupy.cuda.runtime, "setDevice", lambda ordinal: None)
    monkeypatch.setattr(occupancy, "max_active_clusters", lambda function, cluster, threads, smem: 132 // cluster)
    monkeypatch.setattr(tensor_map, "encode", encode)
    monkeypatch.setattr(arrays, "to_cupy", to_cupy)
    monkeypatch.setattr(arrays, "stream_ptr", lambda like, stream=None: 0 if stream is None else int(stream))
    monkeypatch.setattr(arrays, "launch_stream", lambda like, stream, device: 0 if stream is None else int(stream))
    monkeypatch.setattr(streams, "use_stream", current_stream)
    # Events between streams: which stream waits for which event, by the event's number.
    events = itertools.count(1)
    record.event_records, record.event_waits = [], []
    record.host_waits = []

    def new_event():
        event = types.SimpleNamespace(ptr=next(events))
        event.synchronize = lambda: record.host_waits.append(event.ptr)
        return event
    monkeypatch.setattr(streams, "_new_event", new_event)
    monkeypatch.setattr(streams, "_record", lambda event, ptr: record.event_records.append((event.ptr, ptr)))
    monkeypatch.setattr(streams, "_wait", lambda ptr, event, in_capture=False: record.event_waits.append((ptr, event.ptr)))
    monkeypatch.setattr(streams, "is_capturing", lambda ptr: False)
    monkeypatch.setattr(oneshot, "_instances", type(oneshot._instances)())
    monkeypatch.setattr(oneshot, "_described", type(oneshot._described)())
    # Tuned tables: none shipped, none in a user folder, unless a test writes one to record.tables.
    from splitkv.tuned import lookup

    record.tables = tmp_path / "tuned"
    monkeypatch.setattr(runtime, "gpu_name", lambda device: "NVIDIA Fake GPU")
    monkeypatch.setattr(lookup, "shipped_dir", lambda: tmp_path / "shipped")
    monkeypatch.setenv(lookup.ENV_DIR, str(record.tables))
    lookup.forget()
    return record


def _qkv(batch, num_qo_heads, num_kv_heads, head_dim, cache_len):
    return (_DeviceArray((batch, num_qo_heads, head_dim)), _DeviceArray((batch, cache_len, num_kv_heads, head_dim)),
            _DeviceArray((batch, cache_len, num_kv_heads, head_dim)))
