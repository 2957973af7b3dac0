"""The runtime's host logic driven without a GPU: CuPy's device, allocations, the program loader,
the tensor-map encoder and the stream switch are replaced by recorders, so what plan(), run() and
decode() would launch (and what they refuse) can be checked on any machine. The programs
themselves are checked on a GPU by tests/gpu."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import types

import numpy as np
import pytest

from splitkv import arrays, launch as launching, oneshot, runtime, streams, tensors
from splitkv.heuristics import default_spec
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


@pytest.mark.parametrize("lens, message", [([5, 2000], r"seq_lens\[1\] = 2000"), ([5, -3], r"seq_lens\[1\] = -3"),
                                           ([5, 6, 7], r"seq_lens: expected shape \(2,\)")])
def test_decode_checks_device_lengths_against_the_batch_and_cache(fake_gpu, lens, message):
    q, k, v = _qkv(2, 8, 2, 128, 1024)
    with pytest.raises(ValueError, match=message):
        oneshot.decode(q, k, v, _DeviceArray((len(lens),), "<i4", lens))
    assert not fake_gpu.loads and not fake_gpu.launches  # refused before compiling or launching


def test_decode_plans_on_its_own_copy_of_device_lengths(fake_gpu):
    q, k, v = _qkv(2, 8, 2, 128, 1024)
    lens = _DeviceArray((2,), "<i4", [5, 1000])
    oneshot.decode(q, k, v, lens)
    (launch,) = fake_gpu.launches
    assert int(launch.params["seq_lens"]) != lens.__cuda_array_interface__["data"][0]  # the lengths' pointer
    (attn,) = oneshot._instances.values()
    assert attn._launch.seq_lens is not lens and attn._launch.max_len == 1000


def test_decode_of_an_empty_cache_maps_a_stand_in_tile(fake_gpu):
    # k.shape[1] == 0: every length is 0 and no tile is read, but the maps must describe memory.
    q, k, v = _qkv(2, 8, 2, 128, 0)
    oneshot.decode(q, k, v)
    (launch,) = fake_gpu.launches
    assert launch.spec.kv_copy == "tma"
    (attn,) = oneshot._instances.values()
    stand_in = attn._launch.empty_kv_ptr
    assert stand_in and fake_gpu.maps == [(stand_in, launch.spec.tile_tokens, 2 * 128)]  # K and V share it
    assert attn._launch.max_len == 0


def test_decode_of_an_empty_batch_returns_empty_results(fake_gpu):
    q, k, v = _qkv(0, 8, 2, 128, 64)
    out, lse = oneshot.decode(q, k, v, return_lse=True)
    assert out.shape == (0, 8, 128) and lse.shape == (0, 8)
    assert not fake_gpu.launches
    with pytest.raises(ValueError, match="out"):
        oneshot.decode(q, k, v, out=_DeviceArray((1, 8, 128)))


def test_decode_keeps_a_bounded_number_of_instances(fake_gpu):
    for head_dim in (64, 128):
        for num_kv_heads in range(1, 13):
            oneshot.decode(*_qkv(1, 2 * num_kv_heads, num_kv_heads, head_dim, 64))
    assert len(oneshot._instances) == oneshot._MAX_INSTANCES
    last = next(reversed(oneshot._instances))
    assert last[3:6] == (24, 12, 128)  # the most recent layout (num_qo_heads, num_kv_heads, head_dim) is kept


def test_dense_plans_do_not_need_the_split_chunk_in_whole_dense_tiles(fake_gpu):
    # A dense program streams each row whole: the split program's chunk size says nothing about it.
    split = default_spec("sm_90", 128, 4).replace(tile_tokens=16, chunk_size=16)
    dense = default_spec("sm_90", 128, 4, variant="dense")
    assert dense.tile_tokens == 32
    attn = runtime.DecodeAttention(32, 8, 128, spec=split, dense_spec=dense)
    plan = attn.plan([10, 5], variant="dense")
    assert plan.variant == "dense" and attn._launch.spec == dense


def test_plan_and_run_switch_to_the_device_of_the_instance(fake_gpu):
    # A torch caller on GPU 1 may leave CuPy's current device at 0: the programs must still be
    # loaded and launched on the instance's device, and the caller's device given back.
    attn = runtime.DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16", device=1)
    assert fake_gpu.current == 0
    attn.plan([5, 9])
    assert {device for _, device in fake_gpu.loads} == {1}
    q, k, v = _qkv(2, 8, 2, 128, 16)
    attn.run(q, k, v)
    assert [launch.device for launch in fake_gpu.launches] == [1]
    assert fake_gpu.current == 0


def test_cluster_queries_made_on_another_device_load_on_the_instances(fake_gpu):
    # The occupancy of a cluster size may be asked for outside plan(), with another GPU current: the
    # program it loads (and later plans reuse) must still live on the instance's GPU.
    attn = runtime.DecodeAttention(8, 2, 128, device=1)
    assert fake_gpu.current == 0
    attn._max_active_clusters(8)
    attn.plan([3000, 1500], variant="split", num_splits=8)
    assert {device for _, device in fake_gpu.loads} == {1}
    assert fake_gpu.current == 0


def test_units_plans_load_no_split_program(fake_gpu):
    attn = runtime.DecodeAttention(32, 8, 128, tuned=False)
    attn.plan([4096, 100], variant="units")
    decode_programs = [spec for spec, _ in fake_gpu.loads if not isinstance(spec, MergeSpec)]
    assert {spec.variant for spec in decode_programs} == {"units"}, [spec.name for spec in decode_programs]


def test_decode_keys_its_instances_by_the_resolved_device(fake_gpu):
    # Bare __cuda_array_interface__ inputs name no device: the current one is theirs.
    q, k, v = _qkv(1, 8, 2, 128, 16)
    oneshot.decode(q, k, v)
    with _current(fake_gpu, 1):
        oneshot.decode(q, k, v)
    assert sorted(key[0] for key in oneshot._instances) == [0, 1]
    assert [launch.device for launch in fake_gpu.launches] == [0, 1]


@contextlib.contextmanager
def _current(record, ordinal):
    previous, record.current = record.current, ordinal
    try:
        yield
    finally:
        record.current = previous


def test_run_allocates_its_outputs_on_the_launch_stream(fake_gpu):
    # A pool may hand a block out again once its stream has passed the free: the block must belong
    # to the stream the kernel writes it on, not to whatever stream was current.
    attn = runtime.DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16")
    attn.plan([5, 9], stream=77)
    attn.run(*_qkv(2, 8, 2, 128, 16), return_lse=True, stream=77)
    assert [(shape, stream) for shape, _, stream in fake_gpu.allocations] == [((2, 8, 128), 77), ((2, 8), 77)]


def test_decode_gives_each_thread_its_own_instance_on_the_per_thread_stream(fake_gpu):
    # cudaStreamPerThread (handle 2) is one handle but a different stream in every thread: threads
    # must not share a workspace whose kernels may overlap.
    import threading

    q, k, v = _qkv(1, 8, 2, 128, 16)
    oneshot.decode(q, k, v, stream=streams.PER_THREAD_DEFAULT)
    worker = threading.Thread(target=oneshot.decode, args=(q, k, v), kwargs={"stream": streams.PER_THREAD_DEFAULT})
    worker.start()
    worker.join()
    oneshot.decode(q, k, v, stream=5)
    oneshot.decode(q, k, v, stream=5)
    assert len(oneshot._instances) == 3  # two threads on the per-thread stream, one stream 5


def test_outputs_of_a_cupy_q_keep_its_dtype(fake_gpu):
    # bf16 kept as ml_dtypes' bfloat16 (or as uint16) comes back in the same dtype.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from tests.test_inputs import cupy_view

    for dtype in (ml_dtypes.bfloat16, np.uint16, np.float16):
        out = arrays.new_output(cupy_view((2, 8, 128), dtype))
        assert out.__cuda_array_interface__["typestr"] == np.dtype(dtype).str


def test_plan_and_run_on_different_streams_are_ordered_on_the_gpu(fake_gpu):
    # Host lengths planned on CuPy's stream, torch tensors run on torch's: the run's stream waits
    # for the plan's writes, and the next plan's writes wait for that run.
    attn = runtime.DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16")
    q, k, v = _qkv(2, 8, 2, 128, 16)
    attn.plan([5, 9], stream=5)
    ((event, plan_stream),) = fake_gpu.event_records
    assert plan_stream == 5 and not fake_gpu.event_waits
    attn.run(q, k, v, stream=7)
    attn.run(q, k, v, stream=7)
    assert fake_gpu.event_waits == [(7, event)]  # once: the second run follows the first on its stream
    assert fake_gpu.event_records[-2:] == [(event, 7), (event, 7)]
    attn.plan([6, 9], stream=5)
    assert fake_gpu.event_waits[-1] == (5, event)
    assert len(fake_gpu.launches) == 2


def test_run_waits_for_the_stream_an_interface_names(fake_gpu):
    attn = runtime.DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16")
    attn.plan([5, 9], stream=7)
    q, k, v = _qkv(2, 8, 2, 128, 16)
    k.__cuda_array_interface__["stream"] = 0x4400  # the producer's work on k may still be queued there
    attn.run(q, k, v, stream=7)
    event, producer = fake_gpu.event_records[1]
    assert producer == 0x4400 and fake_gpu.event_waits == [(7, event)]


def test_a_plan_that_grows_the_workspace_first_waits_for_the_last_run(fake_gpu):
    # The old buffer returns to the pool of the stream that allocated it, which may hand it out
    # while a run on another stream still writes it: plan() waits for that run on the host first.
    attn = runtime.DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16")
    attn.plan([4000, 9], stream=5)
    attn.run(*_qkv(2, 8, 2, 128, 4000), stream=7)
    attn.plan([4000, 9], stream=5)  # same sizes: nothing replaced, no host wait
    assert fake_gpu.host_waits == []
    attn.plan([4000] * 8, stream=5)  # a larger batch: a larger lengths buffer
    assert fake_gpu.host_waits and set(fake_gpu.host_waits) == {fake_gpu.event_records[0][0]}


def test_batches_of_many_rows_get_a_warp_per_kv_head(fake_gpu):
    # 64 sequences x 8 K/V heads: 512 one-row CTAs would take four waves on 132 SMs; a warp per
    # K/V head makes it 128 CTAs of four rows each.
    attn = runtime.DecodeAttention(32, 8, 128, q_dtype="fp16", kv_dtype="fp16")  # the fake arrays' type
    q, k, v = _qkv(64, 32, 8, 128, 1024)
    plan = attn.plan([1024] * 64)
    assert plan.variant == "dense" and plan.heads_per_cta == 4 and plan.num_ctas == 128
    attn.run(q, k, v, out=_DeviceArray((64, 32, 128)))
    (launch,) = fake_gpu.launches
    assert launch.spec.warp_heads and launch.spec.name.endswith("-wh")
    assert launch.grid == (1, 2, 64)
    # 16 sequences (128 rows) would leave 32 CTAs: one row per CTA, as before.
    plan = attn.plan([4096] * 16)
    assert plan.variant == "dense" and plan.heads_per_cta == 1
    attn.run(*_qkv(16, 32, 8, 128, 4096), out=_DeviceArray((16, 32, 128)))
    assert not fake_gpu.launches[-1].spec.warp_heads and fake_gpu.launches[-1].grid == (1, 8, 16)
    # The warp-per-head program is kept between plans, and follows the dense program when it changes.
    attn.plan([1024] * 64)
    assert attn._launch.spec is launch.spec
    attn.dense_spec = attn.dense_spec.replace(stages=3)
    attn.plan([1024] * 64)
    assert attn._launch.spec == attn.dense_spec.replace(warp_heads=True) != launch.spec


def test_warp_heads_can_be_forced_either_way_and_is_refused_where_it_cannot_run(fake_gpu):
    attn = runtime.DecodeAttention(32, 8, 128)
    assert attn.plan([1024] * 64, warp_heads=False).heads_per_cta == 1
    assert attn._launch.grid == (1, 8, 64) and not attn._launch.spec.warp_heads
    assert attn.plan([100] * 2, variant="dense", warp_heads=True).heads_per_cta == 4
    assert attn._launch.grid == (1, 2, 2) and attn._launch.spec.warp_heads
    with pytest.raises(ValueError, match="warp_heads: a warp per K/V head"):
        attn.plan([5000], variant="split", num_splits=4, warp_heads=True)
    with pytest.raises(TypeError, match="warp_heads"):
        attn.plan([1024] * 64, warp_heads=1)
    dense_wh = default_spec("sm_90", 128, 4, variant="dense").replace(warp_heads=True)
    with pytest.raises(ValueError, match="warp_heads is chosen per plan"):
        runtime.DecodeAttention(32, 8, 128, dense_spec=dense_wh)
    odd = runtime.DecodeAttention(12, 6, 128)  # 6 K/V heads do not fill CTAs of 4 warps
    with pytest.raises(ValueError, match="num_kv_heads 6 is not a multiple"):
        odd.plan([100] * 2, variant="dense", warp_heads=True)
    kept = odd.plan([1024] * 200)  # the planner just keeps a row per CTA
    assert kept.variant == "dense" and kept.heads_per_cta == 1


def test_decode_reads_device_lengths_on_the_launch_stream(fake_gpu):
    # The lengths, like q, k and v, are ready on the stream the call runs on; read on another
    # stream, the read-back could see lengths not written yet.
    q, k, v = _qkv(2, 8, 2, 128, 1024)
    lens = _DeviceArray((2,), "<i4", [5, 1000])
    read_on = []
    plain_get = lens.get
    lens.get = lambda: (read_on.append(fake_gpu.stream), plain_get())[1]
    oneshot.decode(q, k, v, lens, stream=7)
    assert read_on == [7]
    (launch,) = fake_gpu.launches


def test_decode_of_an_empty_batch_still_checks_its_other_arguments(fake_gpu):
    q, k, v = _qkv(0, 8, 2, 128, 64)
    with pytest.raises(ValueError, match="seq_lens"):
        oneshot.decode(q, k, v, [1, 2, 3])
    with pytest.raises(TypeError, match="sm_scale"):
        oneshot.decode(q, k, v, sm_scale="0.1")
    with pytest.raises(ValueError, match="sm_scale"):
        oneshot.decode(q, k, v, sm_scale=-1.0)
    assert oneshot.decode(q, k, v, []).shape == (0, 8, 128)


@pytest.mark.parametrize("make, error, message", [
    (lambda attn: attn.plan([5, None]), TypeError, "seq_lens: expected integer lengths"),
    (lambda attn: attn.plan([5.0, 7.0]), TypeError, "seq_lens: expected integer lengths"),
    (lambda attn: attn.plan([5, 7], max_len=9.7), TypeError, "max_len"),
    (lambda attn: attn.plan([5, 7], max_len="9"), TypeError, "max_len"),
    (lambda attn: attn.plan([1] * 70000), ValueError, "launch grid"),
    (lambda attn: runtime.DecodeAttention(8, 2, 128, sm_scale=True), TypeError, "sm_scale"),
    (lambda attn: runtime.DecodeAttention(8, 2, 128, sm_scale="0.1"), TypeError, "sm_scale"),
    (lambda attn: runtime.DecodeAttention(8, 2, 128, sm_scale=float("inf")), ValueError, "sm_scale"),
])
def test_plan_and_constructor_name_bad_scalars(fake_gpu, make, error, message):
    attn = runtime.DecodeAttention(8, 2, 128)
    with pytest.raises(error, match=message):
        make(attn)
    assert not fake_gpu.launches


def test_numpy_scalars_are_accepted_where_ints_and_floats_are(fake_gpu):
    attn = runtime.DecodeAttention(8, 2, 128, sm_scale=np.float32(0.125))
    assert attn.sm_scale == 0.125
    assert attn.plan(np.array([5, 7], dtype=np.int64), max_len=np.int32(9)).variant in ("dense", "split")


def test_paged_runs_pass_the_table_and_map_whole_pages(fake_gpu):
    from splitkv import DecodeAttention

    attn = DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16", page_size=16, kv_layout="HND")
    table = np.array([[3, 1, 9, 9], [0, 2, -1, -1]], dtype=np.int32)  # entries past the lengths never read
    attn.plan([40, 20], block_table=table)
    q = _DeviceArray((2, 8, 128))
    k, v = _DeviceArray((10, 2, 16, 128)), _DeviceArray((10, 2, 16, 128))
    attn.run(q, k, v)
    (launch,) = fake_gpu.launches
    assert launch.spec.page_size == 16 and launch.spec.kv_layout == "HND" and launch.spec.kv_copy == "tma"
    table_ptr, stride, num_pages, units = (int(launch.params[f]) for f in ("block_table", "table_stride", "num_pages", "units"))
    assert table_ptr == attn._launch.table.ptr and (stride, num_pages, units) == (4, 10, 0)
    assert int(launch.params["max_len"]) == 4 * 16  # max_len: the tokens a table row holds
    # HND: one K/V head's tokens are the map's rows, head_dim its columns; boxes of a page.
    assert fake_gpu.maps == [(k.__cuda_array_interface__["data"][0], 10 * 2 * 16, 128),
                             (v.__cuda_array_interface__["data"][0], 10 * 2 * 16, 128)]
    with pytest.raises(ValueError, match="sequence 0's page 2 is 9, outside the cache's 9 pages"):
        attn.run(q, _DeviceArray((9, 2, 16, 128)), _DeviceArray((9, 2, 16, 128)))
    with pytest.raises(ValueError, match="block_table: paged caches need one"):
        attn.plan([40, 20])
    with pytest.raises(ValueError, match="page_size"):
        DecodeAttention(8, 2, 128, page_size=12)
    with pytest.raises(ValueError, match="kv_layout"):
        DecodeAttention(8, 2, 128, kv_layout="HND")  # a layout of pages


def test_units_plans_launch_a_cta_per_unit_and_merge_split_rows(fake_gpu):
    from splitkv import DecodeAttention
    from splitkv.work_units import max_units

    attn = DecodeAttention(32, 8, 128, q_dtype="fp16", kv_dtype="fp16")
    plan = attn.plan([6096], variant="units")  # 8 rows on 132 x 2 slots: split
    assert plan.split and attn._launch.spec.variant == "units"
    q, k, v = _qkv(1, 32, 8, 128, 6096)
    attn.run(q, k, v)
    decode, merge = fake_gpu.launches
    assert decode.grid == (len(plan.units), 1, 1) and int(decode.params["units"]) == attn._launch.units.ptr
    assert merge.spec.tables and merge.grid == (attn._launch.units.merge_blocks, 1, 1)
    buffer = attn._launch.units.array.host
    assert np.array_equal(buffer[: buffer.size], plan.to_buffer(len(plan.units), len(plan.merges)))

    # Whole rows only: no merge is launched. Fixed sizes: the same grids whatever the lengths.
    fake_gpu.launches.clear()
    attn.plan([4096] * 64, variant="units")
    attn.run(*_qkv(64, 32, 8, 128, 4096))
    assert len(fake_gpu.launches) == 1
    fake_gpu.launches.clear()
    cap = max_units(4 * 8, plan.slots)
    for lens in ([100, 5, 0, 7000], [7000, 7000, 7000, 7000]):
        attn.plan(lens, variant="units", max_units=cap)
        attn.run(*_qkv(4, 32, 8, 128, 7000))
    grids = {(launch.spec.name, launch.grid) for launch in fake_gpu.launches}
    assert len(grids) == 2  # one decode grid and one merge grid, for both plans
    with pytest.raises(ValueError, match="max_units"):
        attn.plan([7000] * 4, variant="units", max_units=1)
    with pytest.raises(ValueError, match="num_splits nor warp_heads"):
        attn.plan([7000] * 4, variant="units", num_splits=4)


def test_the_default_planner_routes_a_long_row_among_many_short_ones_to_units(fake_gpu):
    from splitkv import DecodeAttention
    from splitkv.work_units import UnitPlan

    attn = DecodeAttention(32, 8, 128, q_dtype="fp16", kv_dtype="fp16")
    # Split planner: dense, the long row on one CTA; also where the rows fill whole waves (33 x 8
    # rows on 132 slots), which the units planner once left unsplit.
    for lens in ([65536] + [512] * 63, [65536] + [512] * 32):
        plan = attn.plan(lens)
        assert isinstance(plan, UnitPlan) and plan.split and attn._launch.spec.variant == "units", attn.plan_info
    for lens in ([65536], [131072], [4096] * 16, [1024] * 64, [3000, 5, 0, 16384]):
        plan = attn.plan(lens)  # whole-row clusters, waves of dense rows, modest skew: the split planner
        assert not isinstance(plan, UnitPlan), (lens, attn.plan_info)


def test_the_short_row_rules_plan_is_judged_by_the_routing_too(fake_gpu):
    """One 8192-token row among five of 100 tokens: 48 rows reach the saturating count, so the
    short-row rule alone would run dense, the long row on one CTA per K/V head; the routing judges
    that plan (not only the wave model's) and takes the units. Balanced short rows keep the rule."""
    from splitkv import DecodeAttention
    from splitkv.work_units import UnitPlan

    attn = DecodeAttention(32, 8, 128, tuned=False)
    assert isinstance(attn.plan([8192] + [100] * 5), UnitPlan), attn.plan_info
    plan = attn.plan([4096] * 3)
    assert not isinstance(plan, UnitPlan) and plan.num_splits == 2, attn.plan_info


def test_pages_of_16_take_64_ctas_for_short_splits_and_128_for_long_ones(fake_gpu):
    """Boxed pages shorter than a tile: the short-row rule's third more bytes in flight plan one
    16k row on 8 splits of 2048 tokens (64 CTAs) where the cache were contiguous it would be the
    same; a 64k row's 8 splits would stream 4 MiB each, past the pages' bound, so the wave model
    cuts it 16 ways (128 CTAs). Pages of 1 keep twice the bytes: 16 splits at 16k."""
    from splitkv import DecodeAttention

    for page, length, splits in ((16, 16384, 8), (16, 65536, 16), (1, 16384, 16)):
        attn = DecodeAttention(32, 8, 128, page_size=page, tuned=False)
        per = length // page
        plan = attn.plan([length], block_table=np.arange(per, dtype=np.int32).reshape(1, per))
        assert plan.variant == "split" and plan.num_splits == splits, (page, length, attn.plan_info)


def test_lengths_that_may_grow_after_plan_are_never_left_to_units(fake_gpu):
    """A units plan covers the lengths it was planned for: with device lengths that may grow up to
    max_len (graph replays), the default planner keeps to the split planner, whose grid covers
    max_len, and variant='units' is refused with how to plan instead."""
    from splitkv import DecodeAttention
    from splitkv.work_units import UnitPlan

    attn = DecodeAttention(32, 8, 128, q_dtype="fp16", kv_dtype="fp16")
    lens = [60000] + [512] * 63
    assert isinstance(attn.plan(_DeviceArray((64,), "<i4", lens)), UnitPlan)  # fixed lengths: units
    plan = attn.plan(_DeviceArray((64,), "<i4", lens), max_len=65536)
    assert not isinstance(plan, UnitPlan) and attn._launch.max_len == 65536
    assert plan.tokens_per_split * plan.num_splits >= 65536
    with pytest.raises(ValueError, match="max_len: a 'units' plan covers the lengths it is planned for"):
        attn.plan(_DeviceArray((64,), "<i4", lens), max_len=65536, variant="units")
    assert isinstance(attn.plan(_DeviceArray((64,), "<i4", lens), max_len=60000, variant="units"), UnitPlan)


def test_a_plan_that_fails_leaves_the_live_plan_as_it_was(fake_gpu):
    """plan() checks everything before it writes a buffer the live plan (or a graph captured over
    it) reads: a bad block table leaves the unit tables, lengths and page table untouched."""
    from splitkv import DecodeAttention

    for variant in ("units", None):
        attn = DecodeAttention(32, 8, 128, q_dtype="fp16", kv_dtype="fp16", page_size=16)
        table = np.arange(2 * 400, dtype=np.int32).reshape(2, 400)
        attn.plan([6096, 6096], block_table=table, variant=variant)
        live = attn._launch
        held = {name: buf.host.copy() for name, buf in attn._workspace._buffers.items()}
        bad = np.zeros((4, 2), dtype=np.int32)
        bad[3, 0] = -1
        with pytest.raises(ValueError, match="sequence 3"):
            attn.plan([20, 20, 20, 20], block_table=bad, variant=variant)
        assert attn._launch is live
        for name, buf in attn._workspace._buffers.items():
            assert np.array_equal(buf.host, held[name]), (variant, name)


def test_an_hnd_quantized_cache_takes_a_scale_per_kv_head(fake_gpu):
    """[pages, Hkv, page_size, ...]: the per-head scale has Hkv values, not page_size."""
    from splitkv import DecodeAttention
    from splitkv.quantize import QuantizedKV

    hkv, page, d = 8, 4, 128
    attn = DecodeAttention(32, hkv, d, q_dtype="fp16", kv_dtype="fp8_e4m3", page_size=page, kv_layout="HND")
    attn.plan([20, 20], block_table=np.arange(10, dtype=np.int32).reshape(2, 5))
    q = _DeviceArray((2, 32, d))

    def cache(scales):
        return QuantizedKV("fp8_e4m3", _DeviceArray((10, hkv, page, d), "|u1"), None, _DeviceArray((scales,), "<f4"))
    k = cache(hkv)
    attn.run(q, k, cache(hkv))
    assert launching.read_arrays(None, k, k, None, None)[2][4] == 1  # one scale per K/V head
    with pytest.raises(ValueError, match="k.scale"):
        attn.run(q, cache(page), cache(page))


def test_nvfp4_tensor_maps_view_the_values_as_bytes(fake_gpu):
    """NVFP4 values pack two per byte: the maps' rows are a token's heads of 64 bytes (head_dim 128),
    in byte elements, read in one 64-byte box per row."""
    from splitkv import DecodeAttention
    from splitkv.quantize import QuantizedKV

    hkv, d, length = 8, 128, 300
    attn = DecodeAttention(32, hkv, d, kv_dtype="nvfp4", tuned=False)
    attn.plan([length, length])
    assert attn._launch.spec.kv_copy == "tma" and attn._launch.spec.tma_box_bytes == 64

    def cache():
        return QuantizedKV("nvfp4", _DeviceArray((2, length, hkv, d // 2), "|u1"),
                           _DeviceArray((2, length, hkv, d // 16), "|u1"), _DeviceArray((1,), "<f4"))
    k, v = cache(), cache()
    attn.run(_DeviceArray((2, 32, d), "<u2"), k, v)
    assert fake_gpu.maps == [(k.values.__cuda_array_interface__["data"][0], 2 * length, hkv * d // 2),
                             (v.values.__cuda_array_interface__["data"][0], 2 * length, hkv * d // 2)]


def test_a_device_table_may_leave_pages_the_lengths_do_not_use_yet(fake_gpu):
    """With device lengths that may grow to max_len, validation checks the pages today's lengths use;
    the table must still be wide enough for max_len."""
    from splitkv import DecodeAttention

    attn = DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16", page_size=16)
    table = _DeviceArray((2, 4), "<i4")
    table.host = np.array([[0, -1, -1, -1], [1, -1, -1, -1]], np.int32)
    attn.plan(_DeviceArray((2,), "<i4", [10, 10]), max_len=64, block_table=table)
    assert attn._launch.max_len == 64
    with pytest.raises(ValueError, match="block_table: holds 4 pages of 16 tokens"):
        attn.plan(_DeviceArray((2,), "<i4", [10, 10]), max_len=65, block_table=table)


def test_a_units_plan_of_an_empty_cache_maps_a_stand_in_tile(fake_gpu):
    from splitkv import DecodeAttention

    attn = DecodeAttention(32, 8, 128, q_dtype="fp16", kv_dtype="fp16")
    attn.plan([0, 0], variant="units")
    attn.run(*_qkv(2, 32, 8, 128, 0))
    stand_in = attn._launch.empty_kv_ptr
    assert attn._launch.spec.kv_copy == "tma" and stand_in and {ptr for ptr, *_ in fake_gpu.maps} == {stand_in}


def test_run_refuses_results_that_overlap_the_inputs_every_call(fake_gpu):
    """out and lse are written while other CTAs read q, k and v: a result overlapping any of them,
    or the two overlapping each other, is refused (also on the fast path of a validated layout,
    where only the pointers are read)."""
    q, k, v = _qkv(2, 8, 2, 128, 1024)
    attn = runtime.DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16", tuned=False)
    attn.plan([5, 700])
    out, lse = _DeviceArray(q.shape), _DeviceArray((2, 8), "<f4")
    attn.run(q, k, v, out=out, lse=lse)  # apart: runs, and the layout is now validated
    launched = len(fake_gpu.launches)
    for bad, name in ((FakeCAI(q.shape, ptr=_ptr(k) + 4096), "out: overlaps k"),
                      (FakeCAI(q.shape, ptr=_ptr(q)), "out: overlaps q"),
                      (FakeCAI(q.shape, ptr=_ptr(v) + _nbytes(v) - 16), "out: overlaps v")):
        with pytest.raises(ValueError, match=name):
            attn.run(q, k, v, out=bad, lse=lse)
    with pytest.raises(ValueError, match="out: overlaps lse"):
        attn.run(q, k, v, out=out, lse=FakeCAI((2, 8), "<f4", ptr=_ptr(out) + 64))
    assert len(fake_gpu.launches) == launched  # nothing launched for them
    neighbour = FakeCAI(q.shape, ptr=_ptr(v) + _nbytes(v))  # right after v: apart
    attn.run(q, k, v, out=neighbour, lse=lse)
    assert len(fake_gpu.launches) == launched + 1


def _ptr(x) -> int:
    return x.__cuda_array_interface__["data"][0]


def _nbytes(x) -> int:
    cai = x.__cuda_array_interface__
    return int(np.prod(cai["shape"])) * np.dtype(cai["typestr"]).itemsize


def test_unaligned_lse_lengths_and_tables_and_big_endian_data_are_refused():
    """Pointers of 4-byte elements off their alignment (a bare interface may point anywhere) and
    big-endian data are refused by name before anything reads them."""
    q = tensors.describe(FakeCAI((2, 8, 128)), "q")
    with pytest.raises(ValueError, match="lse: expected a data pointer aligned to its 4-byte elements"):
        tensors.check_decode_inputs(q, tensors.describe(FakeCAI((2, 1024, 2, 128)), "k"),
                                    tensors.describe(FakeCAI((2, 1024, 2, 128)), "v"),
                                    lse=tensors.describe(FakeCAI((2, 8), "<f4", ptr=0x7000_0002), "lse"))
    with pytest.raises(ValueError, match="seq_lens: expected a data pointer aligned"):
        tensors.check_seq_lens(FakeCAI((2,), "<i4", ptr=0x7000_0002), 2, 1024)
    with pytest.raises(ValueError, match="block_table: expected a data pointer aligned"):
        tensors.check_block_table_info(tensors.describe(FakeCAI((2, 4), "<i4", ptr=0x7000_0006), "block_table"), 2)
    for typestr in (">f2", ">V2", ">i4"):
        with pytest.raises(TypeError, match="big-endian"):
            tensors.describe(FakeCAI((2, 8, 128), typestr), "q")


def test_bad_arguments_are_named_before_the_device_is_touched(fake_gpu, monkeypatch):
    """Unknown dtypes name their argument (no KeyError from deep inside, no device query first); a
    scale the programs would get as inf or 0 in float32 is refused; decode() with the 'HND' page
    layout but no block table is refused rather than read as 'NHD'."""
    import cupy

    def no_device(*args, **kwargs):
        raise AssertionError("the device was queried before the arguments were checked")

    monkeypatch.setattr(cupy.cuda, "Device", no_device)
    for kwargs, message in ((dict(q_dtype="fp32"), "q_dtype: expected one of"),
                            (dict(kv_dtype="int8"), "kv_dtype: expected one of"),
                            (dict(sm_scale=1e39), "sm_scale: 1e\\+39 x log2\\(e\\) is outside"),
                            (dict(sm_scale=1e-50), "sm_scale: 1e-50 x log2\\(e\\) is outside")):
        with pytest.raises(ValueError, match=message):
            runtime.DecodeAttention(32, 8, 128, **kwargs)
    monkeypatch.undo()
    q, k, v = _qkv(2, 8, 2, 128, 1024)
    with pytest.raises(ValueError, match="kv_layout: 'HND' is a page layout and needs a block_table"):
        oneshot.decode(q, k, v, [5, 7], kv_layout="HND")
