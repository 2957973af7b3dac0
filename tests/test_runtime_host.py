"""Host-side parts of the runtime that need no GPU: length checks of plan()."""

import numpy as np
import pytest

from splitkv import tensors
from splitkv.runtime import DecodeAttention
from tests.test_inputs import FakeCAI


def host_lengths(_, seq_lens, max_len):
    """plan()'s length checks (device lengths are read back from device 0)."""
    return tensors.plan_lengths(seq_lens, max_len, tensors.is_device_array(seq_lens), 0)


def test_host_lengths_become_int32():
    lens = host_lengths(None, [5, 0, 17], None)
    assert lens.dtype == np.int32 and lens.tolist() == [5, 0, 17]


@pytest.mark.parametrize("lens, max_len, message", [
    (None, None, "needs the lengths"),
    ([], None, "non-empty"),
    ([[1, 2]], None, "1-D"),
    ([4, -1], None, r"seq_lens\[1\]"),
    ([4, 9], 8, r"seq_lens\[1\]"),
])
def test_bad_host_lengths(lens, max_len, message):
    with pytest.raises(ValueError, match=message):
        host_lengths(None, lens, max_len)


def test_device_lengths_must_be_int32_vectors():
    with pytest.raises(TypeError, match="seq_lens"):
        host_lengths(None, FakeCAI((4,), "<i8"), None)
    with pytest.raises(ValueError, match="seq_lens"):
        host_lengths(None, FakeCAI((2, 2), "<i4"), None)


class _Recorder:
    """Stands in for cupy.empty and cupy.cuda.Device: records what would be allocated where."""

    def __init__(self):
        self.calls = []
        self.device = None

    def empty(self, shape, dtype):
        self.calls.append((tuple(shape), np.dtype(dtype), self.device))
        return self.calls[-1]


@pytest.mark.parametrize("typestr, lse, expected", [
    ("<V2", False, ((2, 8, 64), np.dtype(np.uint16))),    # bf16 travels as uint16 in CuPy
    ("<f2", False, ((2, 8, 64), np.dtype(np.float16))),
    ("<f2", True, ((2, 8), np.dtype(np.float32))),
])
def test_outputs_for_foreign_arrays(monkeypatch, typestr, lse, expected):
    import contextlib

    import cupy

    from splitkv import arrays

    recorder = _Recorder()

    class Device(contextlib.AbstractContextManager):
        def __init__(self, ordinal=None):
            self.id = 0 if ordinal is None else ordinal

        def __enter__(self):
            recorder.device = self.id
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(cupy, "empty", recorder.empty)
    monkeypatch.setattr(cupy.cuda, "Device", Device)
    q = FakeCAI((2, 8, 64), typestr)
    shape, dtype, device = arrays.new_output(q, lse=lse)
    assert (shape, dtype) == expected
    assert device == 0  # a bare interface names no device: the current one


def _fake_device(monkeypatch, tmp_path):
    """CuPy's device as a 132-SM sm_90 GPU named 'NVIDIA Fake GPU' with no tuned tables (none
    shipped, none in a user folder), so that a DecodeAttention can be built on the host; returns
    the device class."""
    import cupy

    from splitkv import runtime
    from splitkv.tuned import lookup

    class Device:
        id = 0
        compute_capability = "90"
        attributes = {"MultiProcessorCount": 132}

    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: Device())
    monkeypatch.setattr(runtime, "gpu_name", lambda device: "NVIDIA Fake GPU")
    monkeypatch.setattr(lookup, "shipped_dir", lambda: tmp_path / "shipped")
    monkeypatch.setenv(lookup.ENV_DIR, str(tmp_path / "tuned"))
    lookup.forget()
    return Device


@pytest.mark.parametrize("changes", [{}, {"cluster": 1, "kv_copy": "cp_async"}, {"cluster": 8}])
def test_a_given_split_spec_yields_a_valid_dense_spec(monkeypatch, tmp_path, changes):
    # The dense program derived from a caller's spec drops the split-only choice (clusters) and
    # keeps the CTA shape.
    from splitkv import DecodeAttention, KernelSpec

    _fake_device(monkeypatch, tmp_path)
    spec = KernelSpec(arch="sm_90", head_dim=128, group_size=4).replace(**changes)
    attn = DecodeAttention(32, 8, 128, spec=spec)
    assert attn.split_spec == spec
    assert attn.dense_spec.variant == "dense" and attn.dense_spec.cluster == 1
    assert attn.dense_spec.kv_copy == spec.kv_copy and attn.dense_spec.mma_m == spec.mma_m
    assert (attn.dense_spec.warps, attn.dense_spec.tile_tokens) == (spec.warps, spec.tile_tokens)


def test_run_passes_each_caches_tensor_maps_by_value(monkeypatch, tmp_path):
    # run() with K/V through tensor maps, on the host only: the launch's struct holds K's and V's
    # maps by value, copied in before the launch is made; a second call over the same caches
    # encodes nothing, another cache gets its own maps.
    import contextlib
    import ctypes
    import types

    import cupy

    import splitkv.launch as launching
    import splitkv.streams as streams
    import splitkv.tensor_map as tensor_map
    from splitkv import DecodeAttention, KernelSpec
    from splitkv.params import DECODE
    from splitkv.plan import SplitPlan

    Device = _fake_device(monkeypatch, tmp_path)

    class FakeCAI:
        def __init__(self, shape, typestr, ptr):
            self.__cuda_array_interface__ = {"version": 3, "shape": tuple(shape), "typestr": typestr,
                                             "data": (ptr, False), "strides": None}

    encoded = []

    def fake_encode(ptr, rows, cols, elem_bytes, box_rows, box_bytes):
        encoded.append((ptr, rows, cols, elem_bytes, box_rows, box_bytes))
        buffer = tensor_map._aligned_buffer()
        buffer[:8] = np.frombuffer(np.uint64(ptr).tobytes(), dtype=np.uint8)  # which cache it maps
        return buffer

    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: Device.id)  # already on its device
    monkeypatch.setattr(cupy.cuda.runtime, "setDevice", lambda ordinal: None)
    monkeypatch.setattr(tensor_map, "encode", fake_encode)
    monkeypatch.setattr(streams, "use_stream", lambda ptr: contextlib.nullcontext())
    monkeypatch.setattr(streams, "is_capturing", lambda ptr: False)  # one stream: no event is waited for
    monkeypatch.setattr(streams, "_new_event", lambda: None)
    monkeypatch.setattr(streams, "_record", lambda event, ptr: None)
    launched = []

    def launch_kernel(call, stream, argument):  # reads which cache each map holds, as a launch copies them
        # One argument, the Params struct: its maps, and zeros for a quantized cache's scales, a
        # paged one's table and the units' tables.
        params = DECODE.read(ctypes.c_uint64.from_address(argument).value)
        assert all(int(params[f]) == 0 for f in ("k_scale", "k_per_head", "v_scale", "v_per_head", "k_block_scales",
                                                 "v_block_scales", "block_table", "table_stride", "num_pages", "units"))
        launched.append(tuple(int.from_bytes(params[m][:8].tobytes(), "little") for m in ("k_map", "v_map")))

    monkeypatch.setattr(launching, "launch_kernel", launch_kernel)
    spec = KernelSpec(arch="sm_90", head_dim=128, group_size=4, q_dtype="fp16", kv_dtype="fp16", kv_copy="tma")
    attn = DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16", spec=spec)
    plan = SplitPlan("split", 256, 4, np.array([4, 4], np.int32), 16)
    function = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=1))
    attn._launch = launching.Launch(plan, spec, attn._heads, function, None, 2, 1000, (4, 2, 2), None, (None,) * 3)
    calls = []
    monkeypatch.setattr(tensor_map.TensorMapCache, "encoded",
                        lambda self, *view, original=tensor_map.TensorMapCache.encoded: calls.append(view[0])
                        or original(self, *view))
    base = 0x7F00_0000_0000
    q, out = FakeCAI((2, 8, 128), "<f2", base), FakeCAI((2, 8, 128), "<f2", base + 0x10000)
    caches = [(FakeCAI((2, 1024, 2, 128), "<f2", base + (1 + 2 * i) * 2**24),
               FakeCAI((2, 1024, 2, 128), "<f2", base + (2 + 2 * i) * 2**24)) for i in range(2)]
    for k, v in (caches[0], caches[0], caches[1]):
        attn.run(q, k, v, out=out, stream=0)
    k_ptrs = [c[0].__cuda_array_interface__["data"][0] for c in caches]
    v_ptrs = [c[1].__cuda_array_interface__["data"][0] for c in caches]
    assert launched == [(k_ptrs[0], v_ptrs[0]), (k_ptrs[0], v_ptrs[0]), (k_ptrs[1], v_ptrs[1])]
    assert calls == [k_ptrs[0], v_ptrs[0], k_ptrs[1], v_ptrs[1]]  # the same caches again: the struct holds their maps
    # [batch x cache_len][num_kv_heads x head_dim] of 2-byte elements, boxes of 128 bytes x tile_tokens rows
    views = [(p, 2 * 1024, 2 * 128, 2, spec.tile_tokens, 128) for p in (k_ptrs[0], v_ptrs[0], k_ptrs[1], v_ptrs[1])]
    assert encoded == views


def test_dense_spec_overrides_the_dense_program_alone(monkeypatch, tmp_path):
    from splitkv import DecodeAttention, KernelSpec
    from splitkv.heuristics import default_spec

    _fake_device(monkeypatch, tmp_path)
    dense = KernelSpec(arch="sm_80", head_dim=128, group_size=4, variant="split", warps=2, tile_tokens=16,
                       chunk_size=32, stages=4, cluster=1)
    attn = DecodeAttention(32, 8, 128, dense_spec=dense)
    assert attn.split_spec == default_spec("sm_90", 128, 4)  # untouched
    assert attn.dense_spec == dense.replace(arch="sm_90", variant="dense")  # this GPU's arch, dense
    split = default_spec("sm_90", 128, 4).replace(stages=3)
    both = DecodeAttention(32, 8, 128, spec=split, dense_spec=dense)
    assert both.split_spec == split and both.dense_spec.stages == 4
    with pytest.raises(ValueError, match="dense_spec"):
        DecodeAttention(32, 8, 128, dense_spec=dense.replace(group_size=8))
    with pytest.raises(ValueError, match="^spec"):
        DecodeAttention(32, 8, 128, spec=split.replace(head_dim=64))


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((32, 0, 128), {}, ValueError, "num_kv_heads"),
    ((32, 8, 0), {}, ValueError, "head_dim"),
    ((32, 8, 128.0), {}, TypeError, "head_dim"),
    ((True, 1, 128), {}, TypeError, "num_qo_heads"),
    ((32, 8, 128), {"sm_scale": float("nan")}, ValueError, "sm_scale"),
    ((32, 8, 128), {"sm_scale": -0.1}, ValueError, "sm_scale"),
])
def test_constructor_arguments_are_checked_first(args, kwargs, error, message):
    # Before any device is touched (this machine may have none), and naming the argument.
    with pytest.raises(error, match=message):
        DecodeAttention(*args, **kwargs)


def test_lengths_past_int32_are_refused_not_wrapped():
    # The programs index tokens with int32: 2**32 + 5 must not become 5.
    with pytest.raises(ValueError, match="2147483647"):
        host_lengths(None, [2**32 + 5, 7], None)
