"""Array interop and input validation for the decode runtime.

Everything here reads metadata only (pointers, shapes, strides, dtypes, devices), so inputs can be
checked, and errors raised, without touching device memory; the checks run on the CPU and in tests
without a GPU.

Accepted arrays: CuPy arrays, torch CUDA tensors, any object exposing ``__cuda_array_interface__``
and any object exposing ``__dlpack__`` on a CUDA device. Element types are named with the
vocabulary of `splitkv.spec` ('bf16', 'fp16') plus 'fp32' and 'int32'; anything else keeps its NumPy
name ('int64', 'uint16', ...).

bf16 from CuPy: CuPy has no bfloat16 type of its own. A CuPy array created with
``dtype=ml_dtypes.bfloat16`` (and a ``__cuda_array_interface__`` typestr of ``'<V2'``) is read as
bf16. Plain CuPy code usually carries bf16 bits in a ``uint16`` array instead; that array is read as
bf16 only when the caller passes ``bf16_from_uint16=True`` to `describe`, because a uint16 array is
otherwise a legitimate array of integers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import spec

#: DLPack device type of plain CUDA device memory (kDLCUDA).
_DLPACK_CUDA = 2
#: The kernels load and store 16 bytes at a time, so every row must start on a 16-byte boundary;
#: rows are whole multiples of 16 bytes for every supported head_dim, so only the base pointer counts.
_VECTOR_BYTES = 16

_TORCH_DTYPES = {
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.float32": "fp32",
    "torch.int32": "int32",
}
_NUMPY_DTYPES = {"float16": "fp16", "float32": "fp32", "int32": "int32", "bfloat16": "bf16"}

_ACCEPTED = ("a CuPy array, a torch CUDA tensor, or an object exposing __cuda_array_interface__ "
             "or __dlpack__ on a CUDA device")


@dataclass(frozen=True)
class TensorInfo:
    """What the runtime needs to know about one array; ``strides`` count elements, not bytes.

    ``device`` is the CUDA device ordinal, or None where the array does not say (a bare
    ``__cuda_array_interface__`` carries no device). ``kind`` is 'cupy', 'torch', 'cai' (any other
    ``__cuda_array_interface__`` object) or 'dlpack'. From the interface (version 3) come
    ``stream``, the stream the producer's work on the array was queued on (None: nothing to wait
    for; 1 and 2 are the legacy and per-thread default streams), and ``readonly``.
    """

    ptr: int
    shape: tuple
    strides: tuple
    dtype: str
    device: int | None
    kind: str
    stream: int | None = None
    readonly: bool = False
    itemsize: int = field(default=0, compare=False)  # bytes per element (0: not known)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes a contiguous array of this shape spans."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        return _is_contiguous(self.shape, self.strides)


# ---- reading arrays ---------------------------------------------------------------------------

def describe(x: Any, name: str, *, bf16_from_uint16: bool = False) -> TensorInfo:
    """Read the metadata of a device array named ``name`` in error messages.

    ``bf16_from_uint16=True`` reads a uint16 array (CuPy's usual carrier of bf16 bits) as bf16.
    Raises TypeError for host arrays and for objects that are not arrays.
    """
    if isinstance(x, TensorInfo):
        return x
    if _is_torch(x):
        return _describe_torch(x, name)
    if isinstance(x, np.ndarray) or (hasattr(x, "__array_interface__")
                                     and not hasattr(x, "__cuda_array_interface__")):
        raise TypeError(f"{name}: must be on a CUDA device; got a host array ({type(x).__name__}); "
                        f"expected {_ACCEPTED}")
    if _is_cupy(x):
        return _describe_cupy(x, name, bf16_from_uint16)
    if hasattr(x, "__cuda_array_interface__"):
        return _describe_cai(x.__cuda_array_interface__, name, bf16_from_uint16)
    if hasattr(x, "__dlpack__"):
        device = _dlpack_cuda_device(x, name)
        info = _describe_cupy(_cupy_from_dlpack(x), name, bf16_from_uint16)
        return TensorInfo(info.ptr, info.shape, info.strides, info.dtype, device, "dlpack", itemsize=info.itemsize)
    raise TypeError(f"{name}: expected {_ACCEPTED}; got {type(x).__name__}")


def _is_torch(x: Any) -> bool:
    # Checking the module name keeps torch unimported for callers that never use it.
    return type(x).__module__.startswith("torch")


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.startswith("cupy") and hasattr(x, "data") and hasattr(x, "device")


def _describe_torch(x: Any, name: str) -> TensorInfo:
    if x.device.type != "cuda":
        raise TypeError(f"{name}: must be on a CUDA device; got a torch tensor on '{x.device}'")
    dtype = str(x.dtype)
    return TensorInfo(ptr=int(x.data_ptr()), shape=tuple(x.shape), strides=tuple(x.stride()),
                      dtype=_TORCH_DTYPES.get(dtype, dtype.removeprefix("torch.")),
                      device=x.device.index, kind="torch", itemsize=int(x.element_size()))


def _describe_cupy(x: Any, name: str, bf16_from_uint16: bool) -> TensorInfo:
    # Read the attributes directly: CuPy's __cuda_array_interface__ asks the driver for the current
    # stream, and metadata alone must not need a working device.
    return TensorInfo(ptr=int(x.data.ptr), shape=tuple(x.shape),
                      strides=_cai_element_strides(x.strides, tuple(x.shape), x.dtype.itemsize, name),
                      dtype=_numpy_dtype_name(x.dtype, bf16_from_uint16),
                      device=int(x.device.id), kind="cupy", itemsize=int(x.dtype.itemsize))


def _describe_cai(cai: dict, name: str, bf16_from_uint16: bool) -> TensorInfo:
    if cai.get("mask") is not None:
        raise TypeError(f"{name}: masked arrays are not supported (__cuda_array_interface__ has a mask)")
    shape = tuple(int(n) for n in cai["shape"])
    dtype = _typestr_dtype(cai["typestr"], name)
    data = cai["data"]
    stream = cai.get("stream")
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int) or stream == 0):
        # Version 3 forbids 0, which could mean either default stream: 1 is the legacy one.
        raise ValueError(f"{name}: __cuda_array_interface__ 'stream' must be None or a stream handle other "
                         f"than 0 (1: legacy default, 2: per-thread default); got {stream!r}")
    return TensorInfo(ptr=int(data[0]), shape=shape,
                      strides=_cai_element_strides(cai.get("strides"), shape, dtype.itemsize, name),
                      dtype=_numpy_dtype_name(dtype, bf16_from_uint16), device=None, kind="cai",
                      stream=stream, readonly=len(data) > 1 and bool(data[1]), itemsize=dtype.itemsize)


def _typestr_dtype(typestr: str, name: str) -> np.dtype:
    # '<V2' is the only way a __cuda_array_interface__ can say bfloat16 (it has no bf16 code).
    if typestr[:1] == ">" and typestr[1:] not in ("b1", "i1", "u1"):  # one-byte types have no order
        raise TypeError(f"{name}: big-endian data (typestr {typestr!r}); the programs read little-endian values")
    if typestr[1:] == "V2":
        return _bfloat16_dtype()
    try:
        return np.dtype(typestr)
    except TypeError as exc:
        raise TypeError(f"{name}: unknown __cuda_array_interface__ typestr {typestr!r}") from exc


def _bfloat16_dtype() -> np.dtype:
    try:
        import ml_dtypes
    except ImportError:
        return np.dtype("V2")  # named 'void16', then mapped to 'bf16' below
    return np.dtype(ml_dtypes.bfloat16)


def _numpy_dtype_name(dtype: np.dtype, bf16_from_uint16: bool) -> str:
    dtype = np.dtype(dtype)
    if dtype.kind == "V" and dtype.itemsize == 2:
        return "bf16"
    if dtype == np.uint16 and bf16_from_uint16:
        return "bf16"
    return _NUMPY_DTYPES.get(dtype.name, dtype.name)


def _cai_element_strides(strides, shape: tuple, itemsize: int, name: str) -> tuple:
    if strides is None:  # the interface's way of saying C-contiguous
        return _contiguous_strides(shape)
    if any(s % itemsize for s in strides):
        raise ValueError(f"{name}: byte strides {tuple(strides)} are not whole multiples of the "
                         f"element size {itemsize}")
    return tuple(int(s) // itemsize for s in strides)


def _dlpack_cuda_device(x: Any, name: str) -> int:
    device_type, device_id = x.__dlpack_device__()
    if int(device_type) != _DLPACK_CUDA:
        raise TypeError(f"{name}: must be on a CUDA device; got a DLPack array with device type "
                        f"{int(device_type)} (CUDA is {_DLPACK_CUDA})")
    return int(device_id)


def _cupy_from_dlpack(x: Any):
    import cupy
    return cupy.from_dlpack(x)


# ---- converting arrays ------------------------------------------------------------------------

def to_cupy(x: Any):
    """A zero-copy CuPy view of ``x``; torch bf16 tensors (and '<V2' arrays) come back as uint16."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if _is_torch(x):
        return _torch_to_cupy(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(_as_uint16_if_bf16(x))
    return cupy.from_dlpack(x)


def _torch_to_cupy(x: Any):
    import cupy
    import torch

    if x.dtype == torch.bfloat16:
        # DLPack consumers disagree on bf16; int16 has the same width and every consumer takes it.
        return cupy.from_dlpack(x.view(torch.int16)).view(cupy.uint16)
    return cupy.from_dlpack(x)


class _CAIView:
    """The same memory under another typestr; holds the original so the memory outlives the view."""

    def __init__(self, owner: Any, cai: dict):
        self._owner = owner
        self.__cuda_array_interface__ = cai


def _as_uint16_if_bf16(x: Any) -> Any:
    cai = x.__cuda_array_interface__
    if cai["typestr"][1:] != "V2":
        return x
    return _CAIView(x, {**cai, "typestr": "<u2", "descr": [("", "<u2")]})


def wrap_like(cupy_array: Any, like: Any, dtype_name: str):
    """Hand ``cupy_array`` back in the kind of ``like``: a torch tensor (zero-copy) or the CuPy array.

    ``like`` is the caller's input array or its TensorInfo; ``dtype_name`` is the element type the
    array holds ('bf16' data held in a uint16/int16 CuPy array becomes a torch.bfloat16 tensor).
    """
    if not _like_is_torch(like):
        return cupy_array
    import cupy
    import torch

    if dtype_name == "bf16":
        return torch.from_dlpack(cupy_array.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(cupy_array)


def _like_is_torch(like: Any) -> bool:
    if isinstance(like, TensorInfo):
        return like.kind == "torch"
    return _is_torch(like)


def stream_ptr(like: Any, stream: Any = None) -> int:
    """The CUDA stream handle to launch on.

    An explicit ``stream`` wins: a CuPy stream, a torch stream or a raw handle (int). Otherwise the
    current stream of the framework ``like`` comes from: torch's for torch inputs, else CuPy's.
    ``like`` is the caller's input array or its TensorInfo.
    """
    if stream is not None:
        return _explicit_stream_ptr(stream)
    if _like_is_torch(like):
        import torch
        device = like.device if isinstance(like, TensorInfo) else like.device.index
        return int(torch.cuda.current_stream(device).cuda_stream)
    import cupy
    return int(cupy.cuda.get_current_stream().ptr)


def _explicit_stream_ptr(stream: Any) -> int:
    if isinstance(stream, bool):
        raise TypeError(f"stream: expected a CuPy stream, a torch stream or an int handle; got {stream!r}")
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return int(stream.cuda_stream)
    if hasattr(stream, "ptr"):  # cupy.cuda.Stream, cupy.cuda.ExternalStream
        return int(stream.ptr)
    raise TypeError(f"stream: expected a CuPy stream, a torch stream or an int handle; "
                    f"got {type(stream).__name__}")


# ---- validating decode inputs -----------------------------------------------------------------

@dataclass(frozen=True)
class DecodeShapes:
    """The problem size a decode call implies, read off validated inputs."""

    batch: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    max_len: int
    group_size: int
    q_dtype: str
    kv_dtype: str
    num_pages: int = 0  # paged caches: pages of page_size tokens (max_len is then 0: the table says)
    page_size: int = 0


#: The dimensions of a paged cache per layout, for messages.
PAGED_SHAPES = {"NHD": "[num_pages, page_size, num_kv_heads, head_dim]",
                "HND": "[num_pages, num_kv_heads, page_size, head_dim]"}


@dataclass(frozen=True)
class QuantizedParts:
    """The device arrays of a validated quantized K or V (`splitkv.QuantizedKV`), as described."""

    values: TensorInfo
    block_scales: TensorInfo | None
    scale: TensorInfo


def is_quantized_kv(x: Any) -> bool:
    """Whether ``x`` is a quantized K or V tensor (`splitkv.QuantizedKV`)."""
    from .quantize import QuantizedKV

    return isinstance(x, QuantizedKV)


def describe_kv(x: Any, name: str, kv_layout: str = "NHD") -> TensorInfo:
    """`describe` for K or V: a plain array (bf16 from uint16 allowed), or a `splitkv.QuantizedKV`,
    whose parts are checked here and which is described by its logical shape [B, L, Hkv, D] (paged
    HND: [pages, Hkv, page_size, D]) and its format as the dtype (the pointer is its values')."""
    if not is_quantized_kv(x):
        return describe(x, name, bf16_from_uint16=True)
    return quantized_kv_info(x.kv_dtype, describe_quantized(x, name, kv_layout))


def quantized_kv_info(kv_dtype: str, parts: QuantizedParts) -> TensorInfo:
    """A checked quantized K or V described as `describe_kv` does (logical shape, format as dtype)."""
    batch, length, heads, width = parts.values.shape
    shape = (batch, length, heads, width * 8 // spec.KV_DTYPE_BITS[kv_dtype])
    return TensorInfo(parts.values.ptr, shape, _contiguous_strides(shape), kv_dtype, parts.values.device,
                      parts.values.kind, parts.values.stream, parts.values.readonly)


def describe_quantized(x: Any, name: str, kv_layout: str = "NHD") -> QuantizedParts:
    """The parts of a `splitkv.QuantizedKV`, checked: uint8 values [B, L, Hkv, D x bits / 8] (paged
    HND caches: [pages, Hkv, page_size, ...]), (NVFP4) uint8 block scales of the same leading shape
    and D / 16 last, float32 scale of 1 or Hkv values, contiguous, 16-byte aligned and on one
    device. TypeError / ValueError name the part."""
    if x.kv_dtype not in spec.QUANTIZED_KV_DTYPES:
        raise ValueError(f"{name}: unknown quantized format {x.kv_dtype!r}; expected one of "
                         f"{list(spec.QUANTIZED_KV_DTYPES)}")
    values = describe(x.values, f"{name}.values")
    _check_rank(values, f"{name}.values", 4, "[batch, max_len, num_kv_heads, packed head_dim]")
    if values.dtype != "uint8":
        raise TypeError(f"{name}.values: expected dtype uint8, got {values.dtype}")
    _check_layout(values, f"{name}.values")
    heads = values.shape[1 if kv_layout == "HND" else 2]
    block_scales = None
    if x.kv_dtype == "nvfp4":
        if x.block_scales is None:
            raise ValueError(f"{name}.block_scales: NVFP4 needs its block scales, got None")
        block_scales = describe(x.block_scales, f"{name}.block_scales")
        expected = (*values.shape[:3], values.shape[3] * 2 // spec.NVFP4_BLOCK)
        if block_scales.shape != expected or block_scales.dtype != "uint8":
            raise ValueError(f"{name}.block_scales: expected uint8 {expected}, got {block_scales.dtype} "
                             f"{block_scales.shape}")
        _check_layout(block_scales, f"{name}.block_scales")
        _check_same_device(block_scales, f"{name}.block_scales", values)
    elif x.block_scales is not None:
        raise ValueError(f"{name}.block_scales: {x.kv_dtype} has no block scales; expected None")
    scale = describe_scale(x.scale, f"{name}.scale", heads)
    _check_same_device(scale, f"{name}.scale", values)
    return QuantizedParts(values, block_scales, scale)


def describe_scale(x: Any, name: str, num_kv_heads: int) -> TensorInfo:
    """A quantized tensor's scale, checked: a contiguous, aligned float32 device array of 1 (per
    tensor) or ``num_kv_heads`` (per K/V head) values."""
    scale = describe(x, name)
    if scale.dtype != "fp32" or scale.ndim != 1 or scale.shape[0] not in (1, num_kv_heads) or not scale.is_contiguous:
        raise ValueError(f"{name}: expected a contiguous float32 array of 1 or num_kv_heads={num_kv_heads} "
                         f"values, got {scale.dtype} {scale.shape}")
    _check_aligned(scale, name, 4, "4 bytes (float32)")
    return scale


def check_decode_inputs(q: TensorInfo, k: TensorInfo, v: TensorInfo, *,
                        out: TensorInfo | None = None, lse: TensorInfo | None = None,
                        kv_layout: str | None = None) -> DecodeShapes:
    """Validate contiguous q [B, Hq, D], k and v [B, L_max, Hkv, D], out [B, Hq, D], lse [B, Hq].
    With ``kv_layout`` ('NHD' or 'HND'), k and v are paged caches of that layout (see
    `splitkv.paged`), of any number of pages.

    Raises TypeError for a wrong element type or argument kind and ValueError for a wrong rank,
    shape, stride, alignment, head_dim, group size or device; every message names the argument.
    """
    for name, info in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        if info is not None and not isinstance(info, TensorInfo):
            raise TypeError(f"{name}: expected a TensorInfo (from describe), got {type(info).__name__}")

    _check_rank(q, "q", 3, "[batch, num_qo_heads, head_dim]")
    _check_rank(k, "k", 4, PAGED_SHAPES[kv_layout] if kv_layout else "[batch, max_len, num_kv_heads, head_dim]")
    _check_dtype(q, "q", spec.Q_DTYPES)
    _check_dtype(k, "k", spec.KV_DTYPES)
    batch, num_qo_heads, head_dim = q.shape
    num_pages = page_size = 0
    if kv_layout:
        from .paged import cache_geometry

        num_pages, page_size, num_kv_heads, _ = cache_geometry(k.shape, kv_layout)
        max_len = 0
    else:
        _, max_len, num_kv_heads, _ = k.shape

    _check_head_dim(head_dim)
    if not kv_layout:
        _check_dim(k, "k", 0, batch, "batch", "q.shape[0]")
    _check_dim(k, "k", 3, head_dim, "head_dim", "q.shape[2]")
    group_size = _group_size(num_qo_heads, num_kv_heads)
    _check_v(v, k)

    for name, info in (("q", q), ("k", k), ("v", v)):
        _check_layout(info, name)
        _check_same_device(info, name, q)
    if out is not None:
        _check_out(out, q)
    if lse is not None:
        _check_lse(lse, q)
    return DecodeShapes(batch=batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, max_len=max_len, group_size=group_size,
                        q_dtype=q.dtype, kv_dtype=k.dtype, num_pages=num_pages, page_size=page_size)


def _check_rank(info: TensorInfo, name: str, rank: int, layout: str) -> None:
    if info.ndim != rank:
        raise ValueError(f"{name}: expected {rank} dimensions {layout}, got shape {info.shape}")


def _check_dtype(info: TensorInfo, name: str, allowed) -> None:
    if info.dtype not in allowed:
        hint = ""
        if info.dtype == "uint16":
            hint = " (a CuPy uint16 array is read as bf16 only when described with bf16_from_uint16=True)"
        raise TypeError(f"{name}: expected dtype one of {list(allowed)}, got {info.dtype}{hint}")


def _check_head_dim(head_dim: int) -> None:
    if head_dim not in spec.HEAD_DIMS:
        raise ValueError(f"q: head_dim {head_dim} (q.shape[2]) is not supported; expected one of "
                         f"{list(spec.HEAD_DIMS)}")


def _check_dim(info: TensorInfo, name: str, axis: int, expected: int, what: str, source: str) -> None:
    if info.shape[axis] != expected:
        raise ValueError(f"{name}: expected {what} {expected} (from {source}) in dimension {axis}, "
                         f"got shape {info.shape}")


def _group_size(num_qo_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads < 1 or num_qo_heads < 1:
        raise ValueError(f"k: expected at least one head, got num_qo_heads {num_qo_heads} (q.shape[1]) "
                         f"and num_kv_heads {num_kv_heads} (k.shape[2])")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"k: num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads} (q.shape[1] must be a whole number of k.shape[2])")
    group_size = num_qo_heads // num_kv_heads
    if group_size > spec.MAX_GROUP:
        raise ValueError(f"k: group size num_qo_heads / num_kv_heads = {num_qo_heads} / {num_kv_heads} "
                         f"= {group_size} is more than the supported {spec.MAX_GROUP}")
    return group_size


def _check_v(v: TensorInfo, k: TensorInfo) -> None:
    if v.shape != k.shape:
        raise ValueError(f"v: expected the shape of k {k.shape}, got {v.shape}")
    if v.dtype != k.dtype:
        raise TypeError(f"v: expected the dtype of k ({k.dtype}), got {v.dtype}")


def _check_writable(info: TensorInfo, name: str) -> None:
    if info.readonly:
        raise ValueError(f"{name}: the array is read-only (its __cuda_array_interface__ says so), and the "
                         f"result is written into it")


def _check_out(out: TensorInfo, q: TensorInfo) -> None:
    _check_writable(out, "out")
    if out.shape != q.shape:
        raise ValueError(f"out: expected the shape of q {q.shape}, got {out.shape}")
    if out.dtype != q.dtype:
        raise TypeError(f"out: expected the dtype of q ({q.dtype}), got {out.dtype}")
    _check_layout(out, "out")
    _check_same_device(out, "out", q)


def _check_lse(lse: TensorInfo, q: TensorInfo) -> None:
    _check_writable(lse, "lse")
    expected = q.shape[:2]
    if lse.shape != expected:
        raise ValueError(f"lse: expected shape {expected} [batch, num_qo_heads], got {lse.shape}")
    if lse.dtype != "fp32":
        raise TypeError(f"lse: expected dtype fp32, got {lse.dtype}")
    if not lse.is_contiguous:
        raise ValueError(f"lse: expected contiguous strides {_contiguous_strides(lse.shape)} (in "
                         f"elements), got {lse.strides}")
    _check_aligned(lse, "lse", 4, "its 4-byte elements")
    _check_same_device(lse, "lse", q)


def _check_aligned(info: TensorInfo, name: str, size: int, what: str) -> None:
    # CuPy and torch allocations always are; a bare __cuda_array_interface__ may point anywhere.
    if info.ptr % size:
        raise ValueError(f"{name}: expected a data pointer aligned to {what}, got {info.ptr:#x}")


def _check_layout(info: TensorInfo, name: str) -> None:
    if not info.is_contiguous:
        raise ValueError(f"{name}: expected contiguous strides {_contiguous_strides(info.shape)} (in "
                         f"elements), got {info.strides}")
    _check_aligned(info, name, _VECTOR_BYTES, f"{_VECTOR_BYTES} bytes (the kernels use {_VECTOR_BYTES}-byte loads)")


def _check_same_device(info: TensorInfo, name: str, q: TensorInfo) -> None:
    # A bare __cuda_array_interface__ does not say its device; such arrays cannot be compared.
    if info.device is None or q.device is None:
        return
    if info.device != q.device:
        raise ValueError(f"{name}: expected CUDA device {q.device} (the device of q), "
                         f"got device {info.device}")


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def _is_contiguous(shape: tuple, strides: tuple) -> bool:
    if any(n == 0 for n in shape):
        return True
    step = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        # A dimension of extent 1 is never stepped over, so its stride carries no meaning.
        if n != 1 and s != step:
            return False
        step *= n
    return True


# ---- sequence lengths -------------------------------------------------------------------------

def check_block_table_info(info: TensorInfo, batch: int) -> None:
    """A device block table's layout: contiguous int32 ``[batch, max_pages_per_seq]``."""
    if info.dtype != "int32" or info.ndim != 2 or info.shape[0] != batch or not info.is_contiguous:
        raise ValueError(f"block_table: expected a contiguous int32 [{batch}, max_pages_per_seq] array, "
                         f"got {info.dtype} {info.shape}")
    _check_aligned(info, "block_table", 4, "its 4-byte elements")


def check_seq_lens(seq_lens: Any, batch: int, max_len: int | None) -> np.ndarray | None:
    """Validate the per-sequence K/V lengths.

    None means every sequence holds max_len tokens and returns that as a host array. A host
    sequence or NumPy array is checked (length ``batch``, every value in 0..max_len; max_len None:
    no bound but the programs' int32) and returned as a contiguous int32 NumPy array. A device array (int32, shape [batch], contiguous) is accepted
    as is and returns None: its values stay on the device, and whoever must plan reads them back.
    """
    if seq_lens is None:
        return np.full(batch, max_len, dtype=np.int32)
    if isinstance(seq_lens, TensorInfo) or is_device_array(seq_lens):
        _check_device_seq_lens(describe(seq_lens, "seq_lens"), batch)
        return None
    return _check_host_seq_lens(seq_lens, batch, max_len)


def is_device_array(x: Any) -> bool:
    """True for arrays in device memory (CuPy, torch CUDA, CUDA array interface, CUDA DLPack)."""
    if _is_torch(x):
        return getattr(x, "device", None) is not None and x.device.type == "cuda"
    if isinstance(x, np.ndarray):
        return False
    if hasattr(x, "__cuda_array_interface__") or _is_cupy(x):
        return True
    if hasattr(x, "__dlpack_device__"):
        return int(x.__dlpack_device__()[0]) == _DLPACK_CUDA
    return False


def _check_device_seq_lens(info: TensorInfo, batch: int) -> None:
    if info.dtype != "int32":
        raise TypeError(f"seq_lens: expected dtype int32 on the device, got {info.dtype}")
    if info.shape != (batch,):
        raise ValueError(f"seq_lens: expected shape ({batch},) [batch], got {info.shape}")
    if not info.is_contiguous:
        raise ValueError(f"seq_lens: expected contiguous strides (1,), got {info.strides}")
    _check_aligned(info, "seq_lens", 4, "its 4-byte elements")


_INT32_MAX = 2**31 - 1


def _check_host_seq_lens(seq_lens: Any, batch: int, max_len: int) -> np.ndarray:
    lens = np.asarray(seq_lens)
    if lens.ndim != 1:
        raise ValueError(f"seq_lens: expected a 1-D sequence of {batch} lengths, got shape {lens.shape}")
    if lens.size == 0:
        lens = lens.astype(np.int64)  # np.asarray([]) is float64, yet it is a valid empty batch
    if lens.dtype.kind not in "iu":
        raise TypeError(f"seq_lens: expected integer lengths, got dtype {lens.dtype}")
    if lens.shape[0] != batch:
        raise ValueError(f"seq_lens: expected {batch} lengths (the batch of q), got {lens.shape[0]}")
    longest = int(lens.max(initial=0))
    if max_len is None:
        max_len = longest
    if max_len > _INT32_MAX:  # the programs index tokens with int32
        raise ValueError(f"seq_lens: lengths above {_INT32_MAX} tokens are not supported, got {max_len}")
    # Two reductions say whether any length is out of range; only then is the first one looked for.
    if lens.size and (longest > max_len or int(lens.min()) < 0):
        i = int(np.flatnonzero((lens < 0) | (lens > max_len))[0])
        raise ValueError(f"seq_lens: expected every length in 0..{max_len} (max_len, k.shape[1]), "
                         f"got seq_lens[{i}] = {int(lens[i])}")
    return np.ascontiguousarray(lens, dtype=np.int32)
