"""Tensor maps for the programs whose K/V tiles arrive through the copy engine (``kv_copy="tma"``).

A tensor map (the driver's ``CUtensorMap``) describes a 2-D view of a K or V cache to the copy
engine: here ``[batch x max_len][num_kv_heads x head_dim]`` elements, rows ``num_kv_heads x
head_dim`` elements apart (NVFP4: bytes), fetched as boxes of 128 bytes (NVFP4's rows of 32 or 64
bytes: one box each) x ``tile_tokens`` rows with the swizzle of that span, which the program's
``kv_at`` undoes. The map holds the cache's address, so it is encoded on
the host for each cache a program reads (``cuTensorMapEncodeTiled``, a pure host call: no
synchronisation, no device memory) and passed to the kernel by value; `TensorMapCache` keeps the
last few, so a decode loop over the same cache encodes once.
"""

from __future__ import annotations

import collections
import ctypes
import threading

import numpy as np

from .choices import TMA_BOX_BYTES

#: CUtensorMap is 128 bytes, 64-byte aligned.
MAP_BYTES = 128
MAP_ALIGN = 64
# Enumerators of cuda.h that the encode call takes.
_DTYPE_UINT8, _DTYPE_UINT16 = 0, 1
_INTERLEAVE_NONE = 0
#: The swizzle of a box row of 32, 64 or 128 bytes: its 16-byte pieces XOR-permuted over 8 rows.
_SWIZZLE_OF_BOX_BYTES = {32: 1, 64: 2, 128: 3}
_L2_PROMOTION_NONE, _L2_PROMOTION_128B = 0, 2
_OOB_FILL_ZEROS = 0
#: Encoded maps kept (two per cache: K and V). A model runs one DecodeAttention over every layer's
#: cache, so this covers the K and V of 512 layers; an entry is about 200 host bytes.
CACHE_ENTRIES = 1024

#: The CUDA driver library on Linux, then on Windows (where CUDAAPI is the x64 calling convention).
_DRIVER_LIBRARIES = ("libcuda.so.1", "nvcuda.dll")
_driver = None
_driver_lock = threading.Lock()


def _encode_function():
    global _driver
    with _driver_lock:
        if _driver is None:
            errors = []
            for name in _DRIVER_LIBRARIES:  # CuPy has loaded it already wherever a GPU works
                try:
                    _driver = ctypes.CDLL(name)
                    break
                except OSError as exc:
                    errors.append(f"{name}: {exc}")
            else:
                raise RuntimeError("kv_copy='tma' needs the CUDA driver library to encode tensor maps "
                                   f"(or use kv_copy='cp_async'): {'; '.join(errors)}")
            fn = _driver.cuTensorMapEncodeTiled
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                           ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        return _driver.cuTensorMapEncodeTiled


def _aligned_buffer() -> np.ndarray:
    """128 bytes of host memory on a 64-byte boundary (the encode call checks the alignment)."""
    raw = np.zeros(MAP_BYTES + MAP_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % MAP_ALIGN
    return raw[start:start + MAP_BYTES]


def l2_promotion(box_bytes: int) -> int:
    """The L2 promotion for boxes of ``box_bytes``-wide rows. A row narrower than a 128-byte line
    (NVFP4 at head_dim 128, whose 64-byte rows of neighbouring K/V heads share a line in an NHD
    cache) fills its whole line, which the neighbour's CTA reads at about the same time, so one
    fill serves both CTAs. Rows of 128 bytes take none: each already fills whole lines, 128-byte
    promotion changed nothing for FP8 and 256-byte promotion was slower (docs/experiments.md: "L2
    promotion of the tensor maps, 128-byte rows" and "L2 promotion, narrower rows")."""
    return _L2_PROMOTION_128B if box_bytes < 128 else _L2_PROMOTION_NONE


def box_geometry(rows: int, cols: int, elem_bytes: int, box_rows: int, box_bytes: int = TMA_BOX_BYTES) -> dict:
    """The encode call's arguments for a row-major [rows][cols] matrix read in boxes of
    ``box_bytes`` (32, 64 or 128, swizzled over that span) x ``box_rows`` rows (checked here, so a
    bad shape fails with a clear message)."""
    if elem_bytes not in (1, 2):
        raise ValueError(f"tensor map: elements of {elem_bytes} bytes are not supported (1 or 2)")
    if box_bytes not in _SWIZZLE_OF_BOX_BYTES:
        raise ValueError(f"tensor map: box rows of {box_bytes} bytes; the swizzles span 32, 64 or 128")
    row_bytes = cols * elem_bytes
    if row_bytes % 16:
        raise ValueError(f"tensor map: rows of {row_bytes} bytes; the copy engine needs a multiple of 16")
    if not 1 <= box_rows <= 256:
        raise ValueError(f"tensor map: boxes of {box_rows} rows; the copy engine takes 1 to 256")
    if rows < 1 or rows >= 2**31 or cols >= 2**31:
        raise ValueError(f"tensor map: a [{rows}][{cols}] view is outside the copy engine's coordinates")
    return {"dtype": _DTYPE_UINT8 if elem_bytes == 1 else _DTYPE_UINT16,
            "dims": (cols, rows), "row_stride": row_bytes,
            "box": (box_bytes // elem_bytes, box_rows), "swizzle": _SWIZZLE_OF_BOX_BYTES[box_bytes],
            "l2_promotion": l2_promotion(box_bytes)}


def encode(ptr: int, rows: int, cols: int, elem_bytes: int, box_rows: int, box_bytes: int = TMA_BOX_BYTES) -> np.ndarray:
    """The tensor map of the device matrix at ``ptr`` (see `box_geometry`), as 128 host bytes."""
    geo = box_geometry(rows, cols, elem_bytes, box_rows, box_bytes)
    if ptr % 16:
        raise ValueError(f"tensor map: the cache's address {ptr:#x} is not 16-byte aligned")
    out = _aligned_buffer()
    dims = (ctypes.c_uint64 * 2)(*geo["dims"])
    strides = (ctypes.c_uint64 * 1)(geo["row_stride"])
    box = (ctypes.c_uint32 * 2)(*geo["box"])
    steps = (ctypes.c_uint32 * 2)(1, 1)
    status = _encode_function()(out.ctypes.data, geo["dtype"], 2, ctypes.c_void_p(ptr), dims, strides, box, steps,
                                _INTERLEAVE_NONE, geo["swizzle"], geo["l2_promotion"], _OOB_FILL_ZEROS)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} for a [{rows}][{cols}] "
                           f"view of {elem_bytes}-byte elements at {ptr:#x}, boxes of {geo['box']}")
    return out


class TensorMapCache:
    """The encoded tensor maps of the caches seen last (least recently used evicted first).
    Thread-safe."""

    def __init__(self, entries: int = CACHE_ENTRIES):
        if entries < 2:
            raise ValueError(f"entries: a launch needs K's and V's maps at once; got {entries}")
        self._entries = entries
        self._maps: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def encoded(self, ptr: int, rows: int, cols: int, elem_bytes: int, box_rows: int,
                box_bytes: int = TMA_BOX_BYTES) -> bytes:
        """The 128 bytes of the map of the device matrix at ``ptr`` (see `encode`), encoded on its
        first request and kept; the caller copies them into a kernel's argument struct."""
        key = (ptr, rows, cols, elem_bytes, box_rows, box_bytes)
        with self._lock:
            held = self._maps.get(key)
            if held is not None:
                self._maps.move_to_end(key)
                return held
        held = encode(ptr, rows, cols, elem_bytes, box_rows, box_bytes).tobytes()
        with self._lock:
            self._maps[key] = held
            if len(self._maps) > self._entries:
                self._maps.popitem(last=False)
        return held
