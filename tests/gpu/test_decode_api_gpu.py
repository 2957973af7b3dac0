"""GPU tests of the calling surface (marker: gpu): decode()'s defaults, empty caches and batches,
CUDA-graph capture and replay, torch tensors and streams, arrays seen only through
__cuda_array_interface__ or DLPack, the inputs refused, lengths grown up to max_len, plan() and
run() on different streams, and a second GPU. Outputs are checked against the float64 reference
of decode_checks.py, poisoned with NaN before each call.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import splitkv  # noqa: E402
from splitkv import DecodeAttention, KernelSpec  # noqa: E402
from splitkv.heuristics import default_spec  # noqa: E402

from decode_checks import check_close, fresh_seed, poisoned, random_values, reference  # noqa: E402

pytestmark = pytest.mark.gpu


def test_return_lse_and_default_path():
    q, q64 = random_values((3, 8, 128), "bf16", fresh_seed(11))
    k, k64 = random_values((3, 2000, 2, 128), "bf16", fresh_seed(12))
    v, v64 = random_values((3, 2000, 2, 128), "bf16", fresh_seed(13))
    lens = [2000, 1, 999]
    out, lse = splitkv.decode(q, k, v, lens, return_lse=True)
    ref_out, ref_lse = reference(q64, k64, v64, lens, 1 / math.sqrt(128))
    check_close(out, lse, ref_out, ref_lse, lens, "bf16", "decode() default")
    # seq_lens=None means every sequence is full; a device int32 array is read back to plan.
    out_full = splitkv.decode(q, k, v)
    ref_full, _ = reference(q64, k64, v64, [2000] * 3, 1 / math.sqrt(128))
    check_close(out_full, None, ref_full, None, [2000] * 3, "bf16", "decode() seq_lens=None")
    out_dev = splitkv.decode(q, k, v, cupy.asarray(lens, dtype=cupy.int32), sm_scale=0.05)
    ref_dev, _ = reference(q64, k64, v64, lens, 0.05)
    check_close(out_dev, None, ref_dev, None, lens, "bf16", "decode() device seq_lens, sm_scale")


def test_empty_cache_and_empty_batch():
    # k.shape[1] == 0 (every length 0): zeros and lse = -inf, through the tensor maps' stand-in tile
    # on sm_90+; B = 0: empty results and no launch.
    q, _ = random_values((2, 8, 128), "bf16", fresh_seed(21))
    k = cupy.zeros((2, 0, 2, 128), dtype=cupy.uint16)
    out = poisoned((2, 8, 128), "bf16")
    splitkv.decode(q, k, k, out=out)
    assert int(cupy.count_nonzero(out)) == 0  # every element written, as +0.0 (bf16 bits 0)
    attn = DecodeAttention(8, 2, 128)
    attn.plan([0, 0])
    out, lse = poisoned((2, 8, 128), "bf16"), cupy.full((2, 8), cupy.nan, dtype=cupy.float32)
    attn.run(q, k, k, out=out, lse=lse)
    assert int(cupy.count_nonzero(out)) == 0
    assert bool(cupy.all(cupy.isneginf(lse)))
    empty_q = cupy.zeros((0, 8, 128), dtype=cupy.uint16)
    out, lse = splitkv.decode(empty_q, k[:0], k[:0], return_lse=True)
    assert out.shape == (0, 8, 128) and lse.shape == (0, 8)


@pytest.mark.parametrize("changes, num_kv, lens, variant", [
    ({}, 4, [3000, 17, 8000, 0], "split"),
    ({"kv_copy": "cp_async"}, 4, [3000, 17, 8000, 0], "split"),
    ({"kv_copy": "cp_async"}, 1, [8000, 17, 3000, 0], "split"),
    ({"kv_copy": "tma"}, 4, [3000, 17, 8000, 0], "split"),
    ({}, 4, [3000, 17, 8000, 0], "dense, a warp per K/V head")])
def test_cuda_graph_capture_and_replay(changes, num_kv, lens, variant):
    # The merge counters must be back at zero after every launch; with one K/V head the 8000-token
    # row spans several clusters, so the merge counter is reset by the last CTA of a two-level merge.
    group, dim = 4, 128
    q, q64 = random_values((4, num_kv * group, dim), "bf16", fresh_seed(21))
    k, k64 = random_values((4, 8192, num_kv, dim), "bf16", fresh_seed(22))
    v, v64 = random_values((4, 8192, num_kv, dim), "bf16", fresh_seed(23))
    device_lens = cupy.asarray(lens, dtype=cupy.int32)
    spec = default_spec("sm_90", dim, group).replace(**changes)
    attn = DecodeAttention(num_kv * group, num_kv, dim, spec=spec)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # the inputs were written on the default stream, which `stream` does not wait for
    # Reads the lengths and zeroes the counters on `stream`. One K/V head: 32 splits of 256 tokens,
    # more than the resident clusters of 16, 8 or 4 hold for 4 rows, so pairs of splits.
    if variant == "split":
        plan = attn.plan(device_lens, variant="split", num_splits=32 if num_kv == 1 else None, stream=stream)
    else:
        plan = attn.plan(device_lens, variant="dense", warp_heads=True, stream=stream)
        assert attn._launch.spec.warp_heads and plan.heads_per_cta == 4, attn.plan_info
    assert plan.variant == variant.split(",")[0]
    if num_kv == 1:
        assert 1 < attn._launch.spec.cluster < plan.num_splits, attn.plan_info
    out = cupy.empty((4, num_kv * group, dim), cupy.uint16)
    lse = cupy.empty((4, num_kv * group), cupy.float32)
    with stream:
        attn.run(q, k, v, out=out, lse=lse)  # warm: nothing left to load lazily
        stream.begin_capture()
        attn.run(q, k, v, out=out, lse=lse)
        graph = stream.end_capture()
    for replay, new_lens in enumerate([lens, [2999, 8000, 1, 4000]]):
        # New data and (within the plan) new lengths, written in place; poisoned outputs.
        device_lens.set(np.asarray(new_lens, np.int32))
        q[...], q64[...] = random_values(q.shape, "bf16", 30 + replay)
        k[...], k64[...] = random_values(k.shape, "bf16", 40 + replay)
        out[...] = poisoned(out.shape, "bf16")
        lse.fill(cupy.nan)
        cupy.cuda.Device().synchronize()  # the writes above ran on the default stream
        graph.launch(stream)
        stream.synchronize()
        ref_out, ref_lse = reference(q64, k64, v64, new_lens, 1 / math.sqrt(dim))
        check_close(out, lse, ref_out, ref_lse, new_lens, "bf16", f"graph replay {replay}")


def test_torch_tensors_and_stream():
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 5000, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 5000, 8, 128, device="cuda", dtype=torch.bfloat16)
    lens = [5000, 1234]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out, lse = splitkv.decode(q, k, v, lens, return_lse=True)
    side.synchronize()
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == q.shape
    ref_out, ref_lse = reference(cupy.asarray(q.double()), cupy.asarray(k.double()), cupy.asarray(v.double()),
                                 lens, 1 / math.sqrt(128))
    out_bits = cupy.asarray(out.view(torch.int16)).view(cupy.uint16)
    check_close(out_bits, cupy.asarray(lse), ref_out, ref_lse, lens, "bf16", "torch on a side stream")


class InterfaceOnly:
    """Exposes an array only through __cuda_array_interface__, as an unknown library would."""

    def __init__(self, array):
        self.__cuda_array_interface__ = array.__cuda_array_interface__
        self._keep = array


class DLPackOnly:
    """Exposes an array only through the DLPack protocol."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


@pytest.mark.parametrize("wrap", [InterfaceOnly, DLPackOnly])
def test_foreign_arrays_without_copies(wrap):
    q, q64 = random_values((2, 8, 128), "fp16", fresh_seed(51))
    k, k64 = random_values((2, 3000, 2, 128), "fp16", fresh_seed(52))
    v, v64 = random_values((2, 3000, 2, 128), "fp16", fresh_seed(53))
    lens = [3000, 1234]
    out, lse = splitkv.decode(wrap(q), wrap(k), wrap(v), lens, return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.shape == q.shape and out.dtype == cupy.float16
    ref_out, ref_lse = reference(q64, k64, v64, lens, 1 / math.sqrt(128))
    check_close(out, lse, ref_out, ref_lse, lens, "fp16", f"{wrap.__name__} inputs")
    given = poisoned(q.shape, "fp16")
    attn = DecodeAttention(8, 2, 128, q_dtype="fp16", kv_dtype="fp16")
    attn.plan(lens)
    assert attn.run(wrap(q), wrap(k), wrap(v), out=wrap(given)) is not None
    check_close(given, None, ref_out, None, lens, "fp16", f"{wrap.__name__} out=")


def test_bad_inputs_raise():
    q, _ = random_values((2, 8, 128), "bf16", fresh_seed(1))
    k, _ = random_values((2, 100, 2, 128), "bf16", fresh_seed(2))
    with pytest.raises(ValueError, match="seq_lens"):
        splitkv.decode(q, k, k, [101, 3])
    with pytest.raises(ValueError, match="k"):
        splitkv.decode(q, k[:, :, :, :64], k[:, :, :, :64], [1, 2])
    with pytest.raises(ValueError, match="v"):
        splitkv.decode(q, k, k[:, ::2], [1, 2])
    with pytest.raises(TypeError, match="return_lse: expected True or False, got 1"):
        splitkv.decode(q, k, k, [1, 2], return_lse=1)
    attn = DecodeAttention(8, 2, 128)
    attn.plan([1, 2])
    out = cupy.empty_like(q)
    with pytest.raises(TypeError, match="return_lse: expected True or False, got 'no'"):
        attn.run(q, k, k, out=out, return_lse="no")
    with pytest.raises(ValueError, match="max_len: expected None or a bound of 0 or more tokens, got -1"):
        attn.plan([1, 2], max_len=-1)


def test_a_cache_past_int32_without_lengths_is_refused():
    """A K/V cache claiming 2**31 tokens per sequence (only its interface: nothing that size is
    allocated) with seq_lens=None: the lengths would not fit int32, and the error says so."""
    q, _ = random_values((1, 8, 128), "bf16", fresh_seed(3))
    real = cupy.zeros(16, dtype=cupy.uint16)

    class Huge:
        __cuda_array_interface__ = {"shape": (1, 2**31, 1, 128), "typestr": "<V2", "version": 3,
                                    "data": (real.data.ptr, False), "strides": None}
    with pytest.raises(ValueError, match=r"seq_lens: None reads every sequence as k.shape\[1\] = 2147483648"):
        splitkv.decode(q, Huge(), Huge())


def test_layout_cache_still_checks_alignment_and_foreign_lse():
    # After one validated call, a misaligned out, or an lse seen only through
    # __cuda_array_interface__ with the wrong size, must still be refused.
    q, _ = random_values((2, 8, 128), "bf16", fresh_seed(3))
    k, _ = random_values((2, 300, 2, 128), "bf16", fresh_seed(4))
    attn = DecodeAttention(8, 2, 128)
    attn.plan([300, 20])
    lse = cupy.empty((2, 8), cupy.float32)
    attn.run(q, k, k, out=cupy.empty((2, 8, 128), cupy.uint16), lse=lse)
    shifted = cupy.empty(2 * 8 * 128 + 1, cupy.uint16)[1:].reshape(2, 8, 128)  # 2 bytes off
    with pytest.raises(ValueError, match="out"):
        attn.run(q, k, k, out=shifted, lse=lse)  # the same layout as the first call but for alignment
    attn.run(q, k, k, out=cupy.empty((2, 8, 128), cupy.uint16), lse=InterfaceOnly(lse))
    with pytest.raises(ValueError, match="lse"):
        attn.run(q, k, k, out=cupy.empty((2, 8, 128), cupy.uint16), lse=InterfaceOnly(cupy.empty(3, cupy.float32)))


def test_spelled_out_reads_of_cupy_and_torch_arrays_match_the_generic_loop():
    # run() reads arrays of one kind in a spelled-out pass and mixed ones entry by entry; a layout
    # validated once must compare equal whichever way it is read, and differ on a changed stride.
    from splitkv.launch import read_arrays

    def per_array(arrays):
        return tuple(read_arrays(x, None, None, None, None)[0][0] if x is not None else () for x in arrays)

    q, _ = random_values((2, 8, 128), "bf16", fresh_seed(5))
    k, _ = random_values((2, 300, 2, 128), "bf16", fresh_seed(6))
    sets = [(q, k, k, cupy.empty_like(q), cupy.empty((2, 8), cupy.float32)), (q, k, k, cupy.empty_like(q), None)]
    torch = pytest.importorskip("torch")
    tq, tk = torch.as_tensor(q.view(cupy.int16)).view(torch.bfloat16), torch.as_tensor(k.view(cupy.int16)).view(torch.bfloat16)
    sets += [(tq, tk, tk, torch.empty_like(tq), torch.empty(2, 8, device=tq.device)), (tq, tk, tk, torch.empty_like(tq), None)]
    for arrays in sets:
        layout, pointers, quantized, k_shape = read_arrays(*arrays)
        assert layout == per_array(arrays)
        assert pointers[:2] == tuple(read_arrays(x, None, None, None, None)[1][0] for x in arrays[:2])
        assert quantized == (0,) * 6 and tuple(k_shape) == (2, 300, 2, 128)
    assert read_arrays(q, k, k[:, ::2], cupy.empty_like(q), None)[0] != read_arrays(*sets[1])[0]
    # Quantized caches of CuPy arrays (FP8 with one scale per K/V head, NVFP4 with block scales).
    fp8 = splitkv.QuantizedKV("fp8_e4m3", cupy.zeros((2, 300, 2, 128), cupy.uint8), None, cupy.ones(2, cupy.float32))
    nvfp4 = splitkv.QuantizedKV("nvfp4", cupy.zeros((2, 300, 2, 64), cupy.uint8), cupy.zeros((2, 300, 2, 8), cupy.uint8),
                                cupy.ones(1, cupy.float32))
    for cache in (fp8, nvfp4):
        arrays = (q, cache, cache, cupy.empty_like(q), None)
        layout, pointers, quantized, k_shape = read_arrays(*arrays)
        assert layout == per_array(arrays) and pointers[1] == cache.values.data.ptr
        assert quantized == read_arrays(None, cache, cache, None, None)[2] and k_shape == cache.values.shape


def test_lengths_may_grow_up_to_max_len():
    # A plan made with max_len covers lengths rewritten in place up to it (CUDA-graph replays).
    q, q64 = random_values((1, 8, 128), "bf16", fresh_seed(5))
    k, k64 = random_values((1, 8192, 2, 128), "bf16", fresh_seed(6))
    v, v64 = random_values((1, 8192, 2, 128), "bf16", fresh_seed(7))
    device_lens = cupy.asarray([1000], dtype=cupy.int32)
    attn = DecodeAttention(8, 2, 128)
    attn.plan(device_lens, max_len=8192)
    for n in (1000, 5000, 8192):
        device_lens.fill(n)
        out = poisoned((1, 8, 128), "bf16")
        attn.run(q, k, v, out=out)
        ref_out, ref_lse = reference(q64, k64, v64, [n], 1 / math.sqrt(128))
        check_close(out, None, ref_out, ref_lse, [n], "bf16", f"grown to {n}: {attn.plan_info}")


def test_spec_mismatch_is_refused():
    with pytest.raises(ValueError, match="spec"):
        DecodeAttention(8, 2, 128, spec=KernelSpec(head_dim=64, group_size=4))


# ---- streams and devices ----------------------------------------------------------------------------
_SPIN = cupy.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}''', "spin")


def _busy(stream, ms: float = 100.0):
    """Keeps ``stream`` busy for about ``ms``: work queued after it there waits that long."""
    rate_khz = cupy.cuda.Device().attributes["ClockRate"]
    with stream:
        _SPIN((1,), (1,), (np.int64(ms * rate_khz),))


@pytest.mark.gpu_exclusive  # races the host against a busy kernel: the GPU to itself in a parallel run
def test_plan_and_run_on_different_streams_are_ordered():
    # plan() writes the lengths on one stream, run() launches on another: each must see the
    # other's work in call order, although a busy kernel holds back the stream that goes first.
    q, q64 = random_values((2, 8, 128), "bf16", fresh_seed(61))
    k, k64 = random_values((2, 4000, 2, 128), "bf16", fresh_seed(62))
    v, v64 = random_values((2, 4000, 2, 128), "bf16", fresh_seed(63))
    planner, runner = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # the inputs were written on the default stream
    attn = DecodeAttention(8, 2, 128)
    lens_a, lens_b, lens_c = [4000, 4000], [1500, 3999], [2500, 10]
    # Warm: every kernel the guarded calls below launch has been launched once (the plans'
    # programs, the poisoning fill, the busy kernel), and the layout validated. A kernel's first
    # launch loads its module (CUDA's lazy loading), which can wait for the busy kernel and leave
    # nothing to test: run alone, this test failed that way, and passed after other tests.
    for lens in (lens_b, lens_c, lens_a):
        attn.plan(lens, stream=planner)
        attn.run(q, k, v, out=poisoned((2, 8, 128), "bf16"), stream=runner)
    _busy(runner, 0.0)
    cupy.cuda.Device().synchronize()

    # The run is held back: the next plan must not overwrite its lengths before it reads them.
    attn.plan(lens_a, stream=planner)
    _busy(runner)
    out_a = poisoned((2, 8, 128), "bf16")
    attn.run(q, k, v, out=out_a, stream=runner)
    attn.plan(lens_b, stream=planner)
    assert not runner.done, "the busy kernel ended before the next plan was queued: nothing was tested"
    runner.synchronize()
    planner.synchronize()

    # The plan's writes are held back: the run on the other stream must wait for them.
    _busy(planner)
    attn.plan(lens_c, stream=planner)
    out_c = poisoned((2, 8, 128), "bf16")
    attn.run(q, k, v, out=out_c, stream=runner)
    assert not planner.done, "the busy kernel ended before the run was queued: nothing was tested"
    runner.synchronize()

    # Captured on another stream than the plan's, the wait becomes a node of the graph: one for
    # the graph's three runs (layers), which follow it on the capturing stream. The plan is held
    # back, so a replay that did not wait for it would read the previous lengths.
    _busy(planner)
    attn.plan(lens_b, stream=planner)
    outs_g = [poisoned((2, 8, 128), "bf16") for _ in range(3)]
    runner.begin_capture()
    for out_g in outs_g:
        attn.run(q, k, v, out=out_g, stream=runner)
    graph = runner.end_capture()
    nodes = graph.debug_dot_str().upper()
    assert len(re.findall(r"EVENT_WAIT|WAIT_EVENT", nodes)) == 1, nodes
    assert len(re.findall(r"SPLITKV_DECODE", nodes)) >= 3, nodes
    graph.launch(runner)
    assert not planner.done, "the busy kernel ended before the replay was queued: nothing was tested"
    runner.synchronize()
    graph_outs = [(out_g, lens_b, f"graph captured on the run's stream, layer {i}") for i, out_g in enumerate(outs_g)]
    for out, lens, label in ((out_a, lens_a, "run before the next plan"), (out_c, lens_c, "run after a held-back plan"),
                             *graph_outs):
        ref_out, _ = reference(q64, k64, v64, lens, 1 / math.sqrt(128))
        check_close(out, None, ref_out, None, lens, "bf16", f"{label}: {attn.plan_info}")


@pytest.mark.gpu_exclusive  # races the host against a busy kernel: the GPU to itself in a parallel run
def test_run_waits_for_the_stream_an_interface_names():
    # An array seen only through __cuda_array_interface__ whose producer still writes it on its
    # own stream ('stream' in the interface): the kernel must read the finished values.
    q_old, _ = random_values((2, 8, 128), "bf16", fresh_seed(71))
    q_new, q64 = random_values((2, 8, 128), "bf16", fresh_seed(72))
    k, k64 = random_values((2, 3000, 2, 128), "bf16", fresh_seed(73))
    v, v64 = random_values((2, 3000, 2, 128), "bf16", fresh_seed(74))
    producer, runner = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    # Planned (and its programs compiled) before the busy kernel starts: a compile under a loaded
    # host may outlast the kernel, and then nothing is tested.
    attn = DecodeAttention(8, 2, 128)
    lens = [3000, 777]
    attn.plan(lens, stream=runner)
    cupy.cuda.Device().synchronize()
    _busy(producer)
    with producer:
        q_old[...] = q_new  # lands after the busy kernel
    shared = InterfaceOnly(q_old)
    shared.__cuda_array_interface__ = {**q_old.__cuda_array_interface__, "stream": producer.ptr}
    out = poisoned((2, 8, 128), "bf16")
    attn.run(shared, k, v, out=out, stream=runner)
    assert not producer.done, "the busy kernel ended before the run was queued: nothing was tested"
    runner.synchronize()
    ref_out, _ = reference(q64, k64, v64, lens, 1 / math.sqrt(128))
    check_close(out, None, ref_out, None, lens, "bf16", "q written on the producer's stream")


def test_torch_tensors_on_a_second_gpu():
    # CuPy's current device stays 0 while the tensors live on GPU 1: decode() and an instance
    # built for device 1 must compile, plan and launch there.
    torch = pytest.importorskip("torch")
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    gen = torch.Generator(device="cuda:1").manual_seed(81)
    q, k, v = (torch.randn(shape, device="cuda:1", generator=gen).to(torch.bfloat16)
               for shape in ((2, 32, 128), (2, 3000, 8, 128), (2, 3000, 8, 128)))
    lens = [3000, 1111]
    assert cupy.cuda.Device().id == 0
    out = splitkv.decode(q, k, v, lens)
    attn = DecodeAttention(32, 8, 128, device=1)
    attn.plan(lens, stream=torch.cuda.current_stream(1))
    out2 = attn.run(q, k, v)
    torch.cuda.synchronize(1)
    assert out.device == q.device and out2.device == q.device and cupy.cuda.Device().id == 0
    with cupy.cuda.Device(1):
        ref_out, _ = reference(cupy.asarray(q.double()), cupy.asarray(k.double()), cupy.asarray(v.double()),
                               lens, 1 / math.sqrt(128))
        for result, label in ((out, "decode() on GPU 1"), (out2, "DecodeAttention(device=1)")):
            bits = cupy.asarray(result.view(torch.int16)).view(cupy.uint16)
            check_close(bits, None, ref_out, None, lens, "bf16", label)
