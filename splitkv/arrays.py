"""One device array as the runtime sees it: its metadata (`TensorInfo`, `describe`), zero-copy
conversions between CuPy and torch, the stream of the framework it comes from, and the layout checks
of a single array. The decode inputs as a whole are checked in `splitkv.tensors`.

Everything here reads metadata only (pointers, shapes, strides, dtypes, devices), so arrays can be
checked, and errors raised, without touching device memory; the checks run on the CPU and in tests
without a GPU.

Accepted arrays: CuPy arrays, torch CUDA tensors, any object exposing ``__cuda_array_interface__``
and any object exposing ``__dlpack__`` on a CUDA device. Element types are named with the
vocabulary of `splitkv.choices` ('bf16', 'fp16') plus 'fp32' and 'int32'; anything else keeps its NumPy
name ('int64', 'uint16', ...).

bf16 from CuPy: CuPy has no bfloat16 type of its own. A CuPy array created with
``dtype=ml_dtypes.bfloat16`` (and a ``__cuda_array_interface__`` typestr of ``'<V2'``) is read as
bf16. Plain CuPy code usually carries bf16 bits in a ``uint16`` array instead; that array is read as
bf16 only when the caller passes ``bf16_from_uint16=True`` to `describe`, because a uint16 array is
otherwise a legitimate array of integers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
                        f"expected {_ACCEPTED}{_no_gpu_note()}")
    if _is_cupy(x):
        return _describe_cupy(x, name, bf16_from_uint16)
    if hasattr(x, "__cuda_array_interface__"):
        return _describe_cai(x.__cuda_array_interface__, name, bf16_from_uint16)
    if hasattr(x, "__dlpack__"):
        device = _dlpack_cuda_device(x, name)
        info = _describe_cupy(_cupy_from_dlpack(x), name, bf16_from_uint16)
        return TensorInfo(info.ptr, info.shape, info.strides, info.dtype, device, "dlpack", itemsize=info.itemsize)
    raise TypeError(f"{name}: expected {_ACCEPTED}; got {type(x).__name__}{_no_gpu_note()}")


def _no_gpu_note() -> str:
    """For the error of an array that is not on a GPU: what is wrong when this machine has none."""
    from .gpu import unavailable_reason

    reason = unavailable_reason()
    return "" if reason is None else f" (and there is no usable CUDA GPU here: {reason})"


def _is_torch(x: Any) -> bool:
    # Checking the module name keeps torch unimported for callers that never use it.
    return type(x).__module__.startswith("torch")


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.startswith("cupy") and hasattr(x, "data") and hasattr(x, "device")


def _describe_torch(x: Any, name: str) -> TensorInfo:
    if x.device.type != "cuda":
        raise TypeError(f"{name}: must be on a CUDA device; got a torch tensor on '{x.device}'{_no_gpu_note()}")
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
    if int(data[0]) == 0 and math.prod(shape) > 0:  # the interface allows 0 for empty arrays only
        raise ValueError(f"{name}: __cuda_array_interface__ data pointer is 0 (a null pointer) for a shape "
                         f"{shape} array holding {math.prod(shape)} elements")
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
        return contiguous_strides(shape)
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
    if not is_torch_kind(like):
        return cupy_array
    import cupy
    import torch

    if dtype_name == "bf16":
        return torch.from_dlpack(cupy_array.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(cupy_array)


def is_torch_kind(like: Any) -> bool:
    """Whether ``like`` (an input array or its TensorInfo) is a torch tensor: results go back as such."""
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
    if is_torch_kind(like):
        return _torch_current_stream(like.device if isinstance(like, TensorInfo) else like.get_device())
    import cupy
    return int(cupy.cuda.get_current_stream().ptr)


def launch_stream(like: Any, stream: Any, device: int) -> int:
    """`stream_ptr` on run()'s path, where ``like`` is known to be on ``device``, the current one:
    read with the fewest calls (a torch tensor's device is not asked for)."""
    if stream is not None:
        return stream if type(stream) is int else _explicit_stream_ptr(stream)
    cls = type(like)
    torch_kind = _torch_types.get(cls)
    if torch_kind is None:
        torch_kind = _torch_types[cls] = cls.__module__.startswith("torch")
    return _torch_current_stream(device) if torch_kind else _cupy_current_stream().ptr


_torch_types: dict = {}  # an array's type -> whether torch's (its streams are torch's)


def _cupy_current_stream():
    """CuPy's current stream of the current device: `cupy.cuda.get_current_stream`, which replaces
    this function on its first call (an import statement per launch costs more than the call)."""
    global _cupy_current_stream
    from cupy.cuda import get_current_stream

    _cupy_current_stream = get_current_stream
    return get_current_stream()


_torch_raw_stream = None


def _torch_current_stream(device: int) -> int:
    """torch's current stream on ``device``: through its raw getter where torch has one (what its
    own compiled code calls; `torch.cuda.current_stream` builds a Stream object on every call)."""
    global _torch_raw_stream
    if _torch_raw_stream is None:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _torch_raw_stream = raw if raw is not None else (
            lambda index: int(torch.cuda.current_stream(index).cuda_stream))
    return _torch_raw_stream(device)


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


# ---- one array's layout ------------------------------------------------------------------------

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



def check_aligned(info: TensorInfo, name: str, size: int, what: str) -> None:
    """ValueError unless the data pointer is a multiple of ``size`` bytes (``what``: for the message)."""
    # CuPy and torch allocations always are; a bare __cuda_array_interface__ may point anywhere.
    if info.ptr % size:
        raise ValueError(f"{name}: expected a data pointer aligned to {what}, got {info.ptr:#x}")



def check_contiguous_aligned(info: TensorInfo, name: str) -> None:
    """ValueError unless the array is contiguous and starts on a 16-byte boundary (the programs' loads)."""
    if not info.is_contiguous:
        raise ValueError(f"{name}: expected contiguous strides {contiguous_strides(info.shape)} (in "
                         f"elements), got {info.strides}")
    check_aligned(info, name, _VECTOR_BYTES, f"{_VECTOR_BYTES} bytes (the kernels use {_VECTOR_BYTES}-byte loads)")



def contiguous_strides(shape: tuple) -> tuple:
    """The element strides of a C-contiguous array of ``shape``."""
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


# ---- new outputs -------------------------------------------------------------------------------

def new_output(q: Any, *, lse: bool = False, stream: int | None = None):
    """An uninitialised out of q's shape and dtype (or lse of q's shape without its last axis, float32)
    on q's device:
    from torch's allocator for torch tensors (on ``stream`` when it is not torch's current one),
    else from CuPy's, on CuPy's current stream (a CuPy q's own dtype; for other arrays bf16 as
    uint16, CuPy's carrier)."""
    if _is_torch(q):
        import torch

        shape, dtype = (q.shape[:-1], torch.float32) if lse else (q.shape, q.dtype)
        if stream is None or stream == _torch_current_stream(q.get_device()):
            return torch.empty(shape, dtype=dtype, device=q.device)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=q.device)):
            return torch.empty(shape, dtype=dtype, device=q.device)
    import cupy

    info = describe(q, "q", bf16_from_uint16=True)
    if lse:
        dtype = cupy.float32
    elif _is_cupy(q):
        dtype = q.dtype  # uint16, float16, or ml_dtypes' bfloat16: whatever the caller keeps bf16 in
    else:
        dtype = _CUPY_CARRIERS.get(info.dtype, cupy.float16)  # a bad q fails validation
    with cupy.cuda.Device(info.device):  # None: the current one
        return cupy.empty(info.shape[:-1] if lse else info.shape, dtype=dtype)


_CUPY_CARRIERS = {"bf16": np.uint16, "fp16": np.float16}
