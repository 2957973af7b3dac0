"""decode(), the one-shot call, on the fake GPU of tests/fake_gpu.py: the instances it keeps (by
layout, device, thread and stream), its copy of device lengths, empty caches and batches, the
outputs it allocates, and the arguments it refuses before compiling or launching."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from splitkv import arrays, oneshot, streams
from tests.fake_gpu import _DeviceArray, _qkv, fake_gpu  # noqa: F401 - fake_gpu: a fixture, used by name


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


def test_decode_of_an_empty_batch_still_checks_its_other_arguments(fake_gpu):
    q, k, v = _qkv(0, 8, 2, 128, 64)
    with pytest.raises(ValueError, match="seq_lens"):
        oneshot.decode(q, k, v, [1, 2, 3])
    with pytest.raises(TypeError, match="sm_scale"):
        oneshot.decode(q, k, v, sm_scale="0.1")
    with pytest.raises(ValueError, match="sm_scale"):
        oneshot.decode(q, k, v, sm_scale=-1.0)
    assert oneshot.decode(q, k, v, []).shape == (0, 8, 128)
