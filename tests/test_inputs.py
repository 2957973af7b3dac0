"""Input reading and validation, on the CPU: device arrays are faked through their metadata."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from splitkv import choices
from splitkv.arrays import TensorInfo, describe, stream_ptr, to_cupy, wrap_like
from splitkv.tensors import DecodeShapes, check_decode_inputs, check_seq_lens

BASE = 0x7F00_0000_0000  # a plausible, 16-byte aligned device address; never dereferenced


class FakeCAI:
    """Exposes only a version-3 __cuda_array_interface__, like an array from an unknown library."""

    def __init__(self, shape, typestr="<f2", strides=None, ptr=BASE, mask=None):
        self.__cuda_array_interface__ = {
            "version": 3, "shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
            "strides": strides, "mask": mask, "descr": [("", typestr)],
        }


class FakeDLPack:
    """Exposes only __dlpack__ / __dlpack_device__."""

    def __init__(self, device_type, device_id=0):
        self._device = (device_type, device_id)

    def __dlpack__(self, stream=None):
        raise AssertionError("the data must not be read while validating")

    def __dlpack_device__(self):
        return self._device


class FakeCupyArray:
    """The attributes describe() reads from a CuPy array (and nothing that would need a device)."""

    def __init__(self, shape, dtype, ptr, device_id=0):
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self.strides = byte_strides(shape, self.dtype.itemsize)
        self.data = type("MemoryPointer", (), {"ptr": ptr})()
        self.device = type("Device", (), {"id": device_id})()


def byte_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def info(shape, dtype="bf16", *, strides=None, ptr=BASE, device=0, kind="cai"):
    if strides is None:
        strides = byte_strides(shape, 1)  # one-byte "elements": C-contiguous element strides
    return TensorInfo(ptr=ptr, shape=tuple(shape), strides=tuple(strides), dtype=dtype, device=device,
                      kind=kind)


B, HQ, HKV, D, L = 3, 8, 2, 128, 100


def qkv(**q_changes):
    q = info((B, HQ, D))
    k = info((B, L, HKV, D), ptr=BASE + 0x100000)
    v = info((B, L, HKV, D), ptr=BASE + 0x200000)
    return dataclasses.replace(q, **q_changes), k, v


def raises_naming(exc, name, match=""):
    """The error type, a message that opens with the argument's name, and an optional fragment."""
    return pytest.raises(exc, match=rf"^{re.escape(name)}: (?s:.*){match}")


# ---- describe ---------------------------------------------------------------------------------

def test_describe_cai_converts_byte_strides_to_elements():
    shape = (2, 3, 4)
    x = FakeCAI(shape, "<f2", strides=byte_strides(shape, 2), ptr=BASE + 32)
    got = describe(x, "q")
    assert got == TensorInfo(ptr=BASE + 32, shape=shape, strides=(12, 4, 1), dtype="fp16",
                             device=None, kind="cai")


def test_describe_cai_reads_the_producer_stream_and_read_only_flag():
    x = FakeCAI((2, 3), "<f2")
    assert (describe(x, "q").stream, describe(x, "q").readonly) == (None, False)
    x.__cuda_array_interface__.update(stream=0x1234, data=(BASE, True))
    assert (describe(x, "q").stream, describe(x, "q").readonly) == (0x1234, True)


@pytest.mark.parametrize("stream", [0, True, 1.0, "1"])
def test_describe_cai_rejects_a_stream_the_interface_forbids(stream):
    x = FakeCAI((2, 3), "<f2")
    x.__cuda_array_interface__["stream"] = stream
    with raises_naming(ValueError, "q", "'stream' must be None or a stream handle"):
        describe(x, "q")


def test_read_only_inputs_are_fine():
    q, k, v = (dataclasses.replace(x, readonly=True) for x in qkv())
    assert check_decode_inputs(q, k, v).batch == B


def test_describe_cai_without_strides_is_c_contiguous():
    got = describe(FakeCAI((5, 6, 7), "<f4"), "lse")
    assert got.strides == (42, 7, 1)
    assert got.dtype == "fp32"
    assert got.is_contiguous


def test_describe_cai_keeps_transposed_strides():
    got = describe(FakeCAI((4, 6), "<f2", strides=(2, 8)), "q")
    assert got.strides == (1, 4)
    assert not got.is_contiguous


@pytest.mark.parametrize("typestr", ["<V2", "|V2"])
def test_describe_reads_void16_as_bf16(typestr):
    assert describe(FakeCAI((2, 64), typestr), "q").dtype == "bf16"


def test_describe_reads_uint16_as_bf16_only_when_asked():
    x = FakeCAI((2, 64), "<u2")
    assert describe(x, "q").dtype == "uint16"
    assert describe(x, "q", bf16_from_uint16=True).dtype == "bf16"


def test_describe_names_other_dtypes_like_numpy():
    assert describe(FakeCAI((4,), "<i4"), "seq_lens").dtype == "int32"
    assert describe(FakeCAI((4,), "<i8"), "seq_lens").dtype == "int64"
    assert describe(FakeCAI((4,), "<f8"), "q").dtype == "float64"


def test_describe_rejects_byte_strides_that_split_an_element():
    with raises_naming(ValueError, "k", "element size 2"):
        describe(FakeCAI((4, 4), "<f2", strides=(9, 2)), "k")


def test_describe_rejects_masked_arrays():
    with raises_naming(TypeError, "v", "mask"):
        describe(FakeCAI((4, 4), mask=object()), "v")


def test_describe_rejects_unknown_typestr():
    with raises_naming(TypeError, "q", "typestr"):
        describe(FakeCAI((4,), "<zz"), "q")


def test_describe_rejects_numpy_arrays():
    with raises_naming(TypeError, "q", "CUDA device"):
        describe(np.zeros((2, 8, 128), np.float16), "q")


def test_describe_rejects_host_dlpack():
    with raises_naming(TypeError, "k", "CUDA device"):
        describe(FakeDLPack(device_type=1), "k")


def test_describe_rejects_non_arrays():
    with raises_naming(TypeError, "out", "CuPy array"):
        describe([1.0, 2.0], "out")


def test_describe_wraps_cuda_dlpack_through_cupy(monkeypatch):
    import splitkv.arrays as arrays

    wrapped = []

    def fake_from_dlpack(x):
        wrapped.append(x)
        return FakeCupyArray((2, 8, 64), np.float16, BASE)

    monkeypatch.setattr(arrays, "_cupy_from_dlpack", fake_from_dlpack)
    x = FakeDLPack(device_type=2, device_id=3)
    got = describe(x, "q")
    assert wrapped == [x]
    assert got == TensorInfo(ptr=BASE, shape=(2, 8, 64), strides=(512, 64, 1), dtype="fp16",
                             device=3, kind="dlpack")


def test_describe_passes_tensor_info_through():
    x = info((2, 8, 128))
    assert describe(x, "q") is x


# ---- CuPy arrays (metadata only: the memory is never allocated nor read) ----------------------

def cupy_view(shape, dtype, ptr=BASE, device_id=0):
    cupy = pytest.importorskip("cupy")
    try:
        memory = cupy.cuda.UnownedMemory(ptr, int(np.prod(shape)) * np.dtype(dtype).itemsize, None,
                                         device_id=device_id)
        return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))
    except Exception as exc:  # a CuPy build that wants a driver even for metadata
        pytest.skip(f"cannot build a CuPy view here: {exc}")


def test_describe_cupy_array():
    x = cupy_view((2, 8, 64), np.float16, device_id=1)
    assert describe(x, "q") == TensorInfo(ptr=BASE, shape=(2, 8, 64), strides=(512, 64, 1),
                                          dtype="fp16", device=1, kind="cupy")


def test_describe_cupy_uint16_is_bf16_when_asked():
    x = cupy_view((2, 8, 64), np.uint16)
    assert describe(x, "q").dtype == "uint16"
    assert describe(x, "q", bf16_from_uint16=True).dtype == "bf16"


def test_describe_cupy_ml_dtypes_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert describe(cupy_view((2, 64), ml_dtypes.bfloat16), "k").dtype == "bf16"


def test_describe_cupy_transposed_view_is_not_contiguous():
    x = cupy_view((8, 64), np.float16).T
    got = describe(x, "q")
    assert got.strides == (1, 64)
    assert not got.is_contiguous


def test_describe_cupy_refuses_strides_that_split_an_element():
    # Byte strides (2049, 257, 2) floor-divided would read as a contiguous (1024, 128, 1).
    cupy = pytest.importorskip("cupy")
    x = cupy.lib.stride_tricks.as_strided(cupy_view((2, 8, 128), np.float16), shape=(2, 8, 128),
                                          strides=(2049, 257, 2))
    with pytest.raises(ValueError, match="q: byte strides"):
        describe(x, "q")


def test_to_cupy_passes_cupy_arrays_through():
    x = cupy_view((2, 64), np.float16)
    assert to_cupy(x) is x


def test_wrap_like_returns_cupy_output_for_non_torch_inputs():
    out = cupy_view((2, 64), np.uint16)
    assert wrap_like(out, FakeCAI((2, 64)), "bf16") is out
    assert wrap_like(out, info((2, 64)), "bf16") is out


# ---- stream_ptr -------------------------------------------------------------------------------

class TorchLikeStream:
    cuda_stream = 0x1234


class CupyLikeStream:
    ptr = 0x5678


@pytest.mark.parametrize("stream, expected", [(0, 0), (0xABC, 0xABC), (TorchLikeStream(), 0x1234),
                                              (CupyLikeStream(), 0x5678)])
def test_stream_ptr_prefers_the_explicit_stream(stream, expected):
    assert stream_ptr(FakeCAI((2, 64)), stream) == expected


@pytest.mark.parametrize("stream", [True, "default", 1.5])
def test_stream_ptr_rejects_other_streams(stream):
    with raises_naming(TypeError, "stream"):
        stream_ptr(FakeCAI((2, 64)), stream)


def test_stream_ptr_defaults_to_cupys_current_stream(monkeypatch):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: CupyLikeStream())
    assert stream_ptr(FakeCAI((2, 64))) == 0x5678


# ---- check_decode_inputs: accepted inputs -----------------------------------------------------

def test_happy_path_gives_the_problem_shape():
    q, k, v = qkv()
    out = info((B, HQ, D), ptr=BASE + 0x300000)
    lse = info((B, HQ), "fp32", ptr=BASE + 0x400000)
    shapes = check_decode_inputs(q, k, v, out=out, lse=lse)
    assert shapes == DecodeShapes(batch=B, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, max_len=L,
                                  group_size=HQ // HKV, q_dtype="bf16", kv_dtype="bf16", kv_stride=L)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_views_of_a_longer_cache_are_read_in_place(layout):
    """k[:, :L] of a [B, S, Hkv, D] cache (NHD), k[:, :, :L] of a [B, Hkv, S, D] one (HND): the
    programs read S tokens per sequence (or head) in memory, L of them the cache's."""
    longer = 3 * L
    if layout == "NHD":
        shape, strides = (B, L, HKV, D), (longer * HKV * D, HKV * D, D, 1)
    else:
        shape, strides = (B, HKV, L, D), (HKV * longer * D, longer * D, D, 1)
    k = info(shape, strides=strides, ptr=BASE + 0x100000)
    v = info(shape, strides=strides, ptr=BASE + 0x8000000)
    q = info((B, HQ, D), ptr=BASE)
    shapes = check_decode_inputs(q, k, v, contiguous_layout=layout)
    assert (shapes.max_len, shapes.num_kv_heads, shapes.kv_stride) == (L, HKV, longer)
    whole = info(shape, ptr=BASE + 0x100000)  # contiguous: S = L
    assert check_decode_inputs(q, whole, info(shape, ptr=BASE + 0x8000000), contiguous_layout=layout).kv_stride == L
    with pytest.raises(ValueError, match="v: expected the strides of k"):
        check_decode_inputs(q, k, info(shape, ptr=BASE + 0x8000000), contiguous_layout=layout)
    half = L // 2  # S < L: the sequences' (or heads') rows would overlap
    short = (HKV * half * D, half * D, D, 1) if layout == "HND" else (half * HKV * D, HKV * D, D, 1)
    with pytest.raises(ValueError, match="contiguous cache or a view"):
        check_decode_inputs(q, info(shape, strides=short), v, contiguous_layout=layout)


def test_happy_path_from_described_arrays():
    q = describe(FakeCAI((2, 16, 64), "<u2"), "q", bf16_from_uint16=True)
    k = describe(FakeCAI((2, 33, 1, 64), "<V2"), "k")
    v = describe(FakeCAI((2, 33, 1, 64), "<V2"), "v")
    shapes = check_decode_inputs(q, k, v)
    assert (shapes.group_size, shapes.max_len, shapes.q_dtype, shapes.kv_dtype) == (16, 33, "bf16", "bf16")


@pytest.mark.parametrize("head_dim", choices.HEAD_DIMS)
@pytest.mark.parametrize("q_dtype, kv_dtype", [(a, b) for a in choices.Q_DTYPES for b in choices.KV_DTYPES])
def test_every_supported_head_dim_and_dtype(head_dim, q_dtype, kv_dtype):
    q = info((1, 4, head_dim), q_dtype)
    k = info((1, 5, 4, head_dim), kv_dtype)
    shapes = check_decode_inputs(q, k, k)
    assert (shapes.head_dim, shapes.group_size, shapes.q_dtype, shapes.kv_dtype) == (
        head_dim, 1, q_dtype, kv_dtype)


def test_unit_dimensions_may_have_any_stride():
    q = info((1, 1, D), strides=(999, 7, 1))
    k = info((1, L, 1, D), strides=(5, D, 3, 1))
    assert check_decode_inputs(q, k, k).group_size == 1


def test_empty_batch_is_accepted():
    q, k = info((0, HQ, D)), info((0, L, HKV, D))
    assert check_decode_inputs(q, k, k).batch == 0


def test_devices_are_compared_only_when_known():
    q, k, v = qkv(device=None)
    assert check_decode_inputs(q, k, dataclasses.replace(v, device=5)).batch == B


# ---- check_decode_inputs: every rejection names its argument ----------------------------------

def swap(index, **changes):
    """q, k, v with argument ``index`` changed."""
    args = list(qkv())
    args[index] = dataclasses.replace(args[index], **changes)
    return args


BAD_QKV = [
    # (q, k, v), exception, argument, fragment of the message
    (swap(0, shape=(B, HQ), strides=(HQ, 1)), ValueError, "q", "3 dimensions"),
    (swap(0, shape=(B, 1, 1, HQ, D), strides=(HQ * D, HQ * D, HQ * D, D, 1)), ValueError, "q", "3 dimensions"),
    (swap(0, shape=(B, 17, HQ, D), strides=(17 * HQ * D, HQ * D, D, 1)), ValueError, "q", "1 to 16 query tokens"),
    (swap(1, shape=(B, L, D), strides=(L * D, D, 1)), ValueError, "k", "4 dimensions"),
    (swap(0, dtype="fp32"), TypeError, "q", "got fp32"),
    (swap(0, dtype="uint16"), TypeError, "q", "bf16_from_uint16"),
    (swap(1, dtype="fp32"), TypeError, "k", "got fp32"),
    (swap(2, dtype="fp16"), TypeError, "v", r"dtype of k \(bf16\), got fp16"),
    (swap(2, shape=(B, L + 1, HKV, D)), ValueError, "v", "shape of k"),
    (swap(1, shape=(B + 1, L, HKV, D)), ValueError, "k", "batch 3"),
    (swap(1, shape=(B, L, HKV, 64)), ValueError, "k", "head_dim 128"),
    (swap(0, shape=(B, HQ, 80), strides=(HQ * 80, 80, 1)), ValueError, "q", "head_dim 80"),
    (swap(0, strides=(HQ * D, D, 2)), ValueError, "q", "contiguous"),
    (swap(1, strides=(L * HKV * D, HKV * D, D, 2)), ValueError, "k", "contiguous cache or a view"),
    (swap(1, strides=(L * HKV * D, HKV * D * 2, D, 1)), ValueError, "k", "contiguous cache or a view"),
    (swap(2, strides=(L * HKV * D, 1, L * D, L)), ValueError, "v", "contiguous"),
    (swap(0, ptr=BASE + 2), ValueError, "q", "aligned"),
    (swap(2, ptr=BASE + 8), ValueError, "v", "aligned"),
    (swap(1, device=1), ValueError, "k", "device 0"),
    (swap(2, device=1), ValueError, "v", "got device 1"),
]


@pytest.mark.parametrize("args, exc, name, fragment", BAD_QKV)
def test_bad_q_k_v(args, exc, name, fragment):
    with raises_naming(exc, name, fragment):
        check_decode_inputs(*args)


def test_group_size_must_be_whole():
    q, k, v = qkv(shape=(B, 30, D), strides=(30 * D, D, 1))
    k, v = (dataclasses.replace(x, shape=(B, L, 8, D), strides=(L * 8 * D, 8 * D, D, 1)) for x in (k, v))
    with raises_naming(ValueError, "k", "num_qo_heads 30 is not a multiple of num_kv_heads 8"):
        check_decode_inputs(q, k, v)


def test_group_size_is_bounded():
    hq = 2 * (choices.MAX_GROUP + 1)
    q = info((B, hq, D))
    k = info((B, L, 2, D))
    with raises_naming(ValueError, "k", f"{choices.MAX_GROUP + 1} is more than the supported {choices.MAX_GROUP}"):
        check_decode_inputs(q, k, k)


def test_zero_kv_heads_is_rejected():
    q, k = info((B, HQ, D)), info((B, L, 0, D))
    with raises_naming(ValueError, "k", "at least one head"):
        check_decode_inputs(q, k, k)


@pytest.mark.parametrize("index, name", [(0, "q"), (1, "k"), (2, "v")])
def test_raw_arrays_must_be_described_first(index, name):
    args = list(qkv())
    args[index] = FakeCAI(args[index].shape)
    with raises_naming(TypeError, name, "TensorInfo"):
        check_decode_inputs(*args)


BAD_OUT = [
    (info((B, HQ + 1, D)), ValueError, "shape of q"),
    (info((B, HQ, D), "fp16"), TypeError, r"dtype of q \(bf16\), got fp16"),
    (info((B, HQ, D), strides=(HQ * D * 2, D, 1)), ValueError, "contiguous"),
    (info((B, HQ, D), ptr=BASE + 4), ValueError, "aligned"),
    (info((B, HQ, D), device=2), ValueError, "got device 2"),
    (FakeCAI((B, HQ, D)), TypeError, "TensorInfo"),
    (dataclasses.replace(info((B, HQ, D)), readonly=True), ValueError, "read-only"),
]


@pytest.mark.parametrize("out, exc, fragment", BAD_OUT)
def test_bad_out(out, exc, fragment):
    with raises_naming(exc, "out", fragment):
        check_decode_inputs(*qkv(), out=out)


BAD_LSE = [
    (info((B, HQ, 1), "fp32"), ValueError, "shape"),
    (info((B, HQ + 1), "fp32"), ValueError, "shape"),
    (info((B, HQ), "bf16"), TypeError, "fp32, got bf16"),
    (info((B, HQ), "fp32", strides=(1, B)), ValueError, "contiguous"),
    (info((B, HQ), "fp32", device=1), ValueError, "got device 1"),
    (FakeCAI((B, HQ), "<f4"), TypeError, "TensorInfo"),
    (dataclasses.replace(info((B, HQ), "fp32"), readonly=True), ValueError, "read-only"),
]


@pytest.mark.parametrize("lse, exc, fragment", BAD_LSE)
def test_bad_lse(lse, exc, fragment):
    with raises_naming(exc, "lse", fragment):
        check_decode_inputs(*qkv(), lse=lse)


# ---- check_seq_lens ---------------------------------------------------------------------------

def test_seq_lens_none_means_full_length():
    got = check_seq_lens(None, 3, 17)
    assert got.dtype == np.int32
    assert got.tolist() == [17, 17, 17]


@pytest.mark.parametrize("lens", [[0, 5, 17], (1, 2, 3), np.array([4, 0, 17], np.int64),
                                  np.array([4, 0, 17], np.uint8), np.array([0, 1, 2, 3, 4, 5])[::2]])
def test_host_seq_lens_become_contiguous_int32(lens):
    got = check_seq_lens(lens, 3, 17)
    assert got.dtype == np.int32 and got.flags.c_contiguous
    assert got.tolist() == [int(n) for n in lens]


def test_empty_seq_lens_for_an_empty_batch():
    assert check_seq_lens([], 0, 10).tolist() == []


BAD_HOST_LENS = [
    ([1, 2], ValueError, "expected 3 lengths"),
    ([1, 2, 3, 4], ValueError, "expected 3 lengths"),
    ([[1, 2, 3]], ValueError, "1-D"),
    (5, ValueError, "1-D"),
    ([1, -1, 3], ValueError, r"seq_lens\[1\] = -1"),
    ([1, 2, 11], ValueError, r"0\.\.10 .*seq_lens\[2\] = 11"),
    ([11, 12, 13], ValueError, r"seq_lens\[0\] = 11"),
    ([1.0, 2.0, 3.0], TypeError, "integer"),
    ([True, False, True], TypeError, "integer"),
]


@pytest.mark.parametrize("lens, exc, fragment", BAD_HOST_LENS)
def test_bad_host_seq_lens(lens, exc, fragment):
    with raises_naming(exc, "seq_lens", fragment):
        check_seq_lens(lens, 3, 10)


def test_device_seq_lens_stay_on_the_device():
    assert check_seq_lens(info((3,), "int32"), 3, 10) is None
    assert check_seq_lens(FakeCAI((3,), "<i4"), 3, 10) is None


BAD_DEVICE_LENS = [
    (FakeCAI((3,), "<i8"), TypeError, "int32 on the device, got int64"),
    (FakeCAI((4,), "<i4"), ValueError, r"shape \(3,\)"),
    (FakeCAI((3, 1), "<i4"), ValueError, r"shape \(3,\)"),
    (FakeCAI((3,), "<i4", strides=(8,)), ValueError, "contiguous"),
]


@pytest.mark.parametrize("lens, exc, fragment", BAD_DEVICE_LENS)
def test_bad_device_seq_lens(lens, exc, fragment):
    with raises_naming(exc, "seq_lens", fragment):
        check_seq_lens(lens, 3, 10)


def test_host_dlpack_seq_lens_are_read_on_the_host():
    # A NumPy array is a DLPack producer on the CPU: it must take the host path, not the device one.
    assert check_seq_lens(np.array([1, 2, 3], np.int32), 3, 10).tolist() == [1, 2, 3]


# ---- torch (skipped where torch is not installed) ---------------------------------------------

def test_cpu_torch_tensors_are_rejected():
    torch = pytest.importorskip("torch")
    with raises_naming(TypeError, "q", "CUDA device"):
        describe(torch.zeros(2, 8, 128, dtype=torch.bfloat16), "q")


def test_cpu_torch_seq_lens_are_read_on_the_host():
    torch = pytest.importorskip("torch")
    got = check_seq_lens(torch.tensor([3, 0, 7], dtype=torch.int32), 3, 10)
    assert got.tolist() == [3, 0, 7]


# ---- quantized K/V caches (splitkv.QuantizedKV) -------------------------------------------------

def quantized(kv_dtype="fp8_e4m3", *, batch=2, length=64, heads=2, head_dim=128, scale_shape=(1,),
              scale_ptr=BASE + 0x400000, block_shape=None, values_typestr="|u1"):
    from splitkv import QuantizedKV

    width = head_dim if kv_dtype == "fp8_e4m3" else head_dim // 2
    values = FakeCAI((batch, length, heads, width), values_typestr, ptr=BASE + 0x100000)
    blocks = None
    if kv_dtype == "nvfp4":
        blocks = FakeCAI(block_shape or (batch, length, heads, head_dim // 16), "|u1", ptr=BASE + 0x200000)
    return QuantizedKV(kv_dtype, values, blocks, FakeCAI(scale_shape, "<f4", ptr=scale_ptr))


@pytest.mark.parametrize("kv_dtype, head_dim", [("fp8_e4m3", 128), ("nvfp4", 128), ("nvfp4", 64)])
def test_a_quantized_cache_is_described_by_its_logical_shape(kv_dtype, head_dim):
    from splitkv.tensors import describe_kv

    got = describe_kv(quantized(kv_dtype, head_dim=head_dim), "k")
    assert got.shape == (2, 64, 2, head_dim) and got.dtype == kv_dtype and got.ptr == BASE + 0x100000
    q = info((2, 8, head_dim))
    shapes = check_decode_inputs(q, got, describe_kv(quantized(kv_dtype, head_dim=head_dim), "v"))
    assert (shapes.kv_dtype, shapes.group_size, shapes.max_len) == (kv_dtype, 4, 64)


@pytest.mark.parametrize("changes, exc, match", [
    (dict(values_typestr="<f2"), TypeError, "k.values: expected dtype uint8"),
    (dict(scale_shape=(3,)), ValueError, "k.scale: expected a contiguous float32 array of 1 or num_kv_heads=2"),
    (dict(scale_ptr=BASE + 2), ValueError, "k.scale: expected a data pointer aligned to 4 bytes"),
    (dict(kv_dtype="nvfp4", block_shape=(2, 64, 2, 4)), ValueError, r"k.block_scales: expected uint8 \(2, 64, 2, 8\)"),
])
def test_quantized_cache_faults_are_named(changes, exc, match):
    from splitkv.tensors import describe_kv

    with pytest.raises(exc, match=match):
        describe_kv(quantized(**changes), "k")


def test_quantized_parts_must_match_the_format():
    from splitkv import QuantizedKV
    from splitkv.tensors import describe_kv

    fp8 = quantized("fp8_e4m3")
    with pytest.raises(ValueError, match="k.block_scales: fp8_e4m3 has no block scales"):
        describe_kv(QuantizedKV("fp8_e4m3", fp8.values, fp8.values, fp8.scale), "k")
    with pytest.raises(ValueError, match="k.block_scales: NVFP4 needs its block scales"):
        describe_kv(QuantizedKV("nvfp4", fp8.values, None, fp8.scale), "k")
    with pytest.raises(ValueError, match="unknown quantized format"):
        describe_kv(QuantizedKV("int4", fp8.values, None, fp8.scale), "k")


def test_paged_caches_take_any_page_count_and_their_layout():
    q = info((B, HQ, D))
    nhd, hnd = info((7, 16, HKV, D)), info((7, HKV, 16, D))
    shapes = check_decode_inputs(q, nhd, nhd, kv_layout="NHD")
    assert (shapes.num_pages, shapes.page_size, shapes.num_kv_heads, shapes.max_len) == (7, 16, HKV, 0)
    shapes = check_decode_inputs(q, hnd, hnd, kv_layout="HND")
    assert (shapes.num_pages, shapes.page_size, shapes.num_kv_heads) == (7, 16, HKV)
    with pytest.raises(ValueError, match="page size 12"):
        check_decode_inputs(q, info((7, 12, HKV, D)), info((7, 12, HKV, D)), kv_layout="NHD")
    with pytest.raises(ValueError, match=r"\[num_pages, num_kv_heads, page_size, head_dim\]"):
        check_decode_inputs(q, info((7, 16, D)), info((7, 16, D)), kv_layout="HND")
    with pytest.raises(ValueError, match="v: expected the shape of k"):
        check_decode_inputs(q, nhd, info((8, 16, HKV, D)), kv_layout="NHD")


def test_empty_and_huge_caches_keep_their_checks():
    # An empty cache's strides may be anything (CuPy reports zeros): nothing of it is read.
    q = info((B, HQ, D))
    empty = info((B, 0, HKV, D), strides=(0, 0, 0, 0), ptr=BASE + 0x100000)
    assert check_decode_inputs(q, empty, dataclasses.replace(empty, ptr=BASE + 0x200000)).max_len == 0
    # A cache of 2**31 tokens per sequence is described; the lengths' own check refuses None for it.
    huge = info((1, 2**31, 1, D), ptr=BASE + 0x100000)
    shapes = check_decode_inputs(info((1, 8, D)), huge, dataclasses.replace(huge, ptr=BASE + (1 << 40)))
    assert shapes.kv_stride == 2**31
