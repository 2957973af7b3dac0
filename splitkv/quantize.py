"""Quantize BF16/FP16 K/V on the GPU into FP8 E4M3 or NVFP4 (formats: `splitkv.kv_formats`).

>>> cache = splitkv.quantize_kv(k, "nvfp4")                   # a whole cache [B, L, Hkv, D]
>>> splitkv.quantize_kv(k_new, "nvfp4", out=cache, positions=lens)   # append [B, T, Hkv, D] at lens
>>> splitkv.quantize_kv(k_new, "nvfp4", out=pages, positions=lens, block_table=table)  # into pages

One program per (head_dim, input dtype, format), generated from ``quantize.cu.j2``; it writes
exactly the bytes of `splitkv.kv_formats.quantize_reference`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import arrays, gpu, kv_formats, streams, tensors
from .choices import QUANTIZE_IN_DTYPES
from .paged import check_layout
from .quantized_kv import QuantizedKV
from .spec import QuantizeSpec

#: Status bits the quantizer ORs into its status word (see quantize.cu.j2).
NONFINITE_INPUT = 1
POSITION_OUT_OF_RANGE = 2
PAGE_OUT_OF_RANGE = 4


class NonFiniteInputError(ValueError):
    """The input held NaN or Inf; the affected FP8 elements or NVFP4 blocks were written as NaN."""


def quantize_kv(x, kv_dtype: str, *, scale=None, per_head: bool = False, out: QuantizedKV | None = None,
                positions=None, block_table=None, kv_layout: str = "NHD", check: bool | None = None, status=None,
                stream=None) -> QuantizedKV:
    """Quantize ``x`` (bf16 or fp16, contiguous, ``[B, T, Hkv, D]``; ``[B, Hkv, D]`` is one token per
    sequence) into ``kv_dtype`` ('fp8_e4m3' or 'nvfp4').

    ``scale``: None computes the default (the largest finite magnitude onto the format's largest
    value; per K/V head when ``per_head``); or a positive float, a host sequence of 1 or Hkv floats,
    or a device float32 array of 1 or Hkv values (used as is, so it may change between graph replays).

    ``out``: a QuantizedKV cache ``[B, L, Hkv, ...]`` to write into, with its own scale (``scale``
    must then be None): token t of sequence b goes to cache row ``positions[b] + t`` (``positions``:
    a host sequence or a device int32 array of B values; None: 0). Without ``out`` a new tensor of
    x's shape is returned.

    ``block_table`` (with ``out``): ``out`` is a paged cache (values ``[num_pages, page_size, Hkv,
    ...]``, or ``[num_pages, Hkv, page_size, ...]`` for ``kv_layout='HND'``, block scales alike) and
    cache row p of sequence b is row ``p % page_size`` of page ``block_table[b, p // page_size]``
    (int32 ``[B, max_pages_per_seq]``, host or device), as `splitkv.paged` lays caches out.

    ``check``: read the status back and raise for non-finite inputs (NonFiniteInputError; the
    affected elements or blocks are written as NaN, never as finite values) or positions past the
    cache or onto pages the cache does not have (ValueError; those tokens are not written). This
    waits for the stream. Default: on, except while the stream is captured into a CUDA graph,
    where it cannot wait; there pass ``status`` (a zeroed device int32 array of one element) and
    read it later: bit 1 non-finite input, bit 2 position out of range, bit 4 page out of range.
    While capturing, ``status``, ``positions`` and ``block_table`` must be device arrays that
    outlive the graph (a host one would be copied into a temporary the graph would outlive).
    """
    kv_formats.check_format(kv_dtype)
    check_layout(kv_layout, "kv_layout")
    info = arrays.describe(x, "x", bf16_from_uint16=True)
    if info.ndim == 3:
        info = dataclasses.replace(info, shape=(info.shape[0], 1, *info.shape[1:]),
                                   strides=(info.strides[0], 0, *info.strides[1:]))
    if info.ndim != 4:
        raise ValueError(f"x: expected [batch, tokens, num_kv_heads, head_dim] (or [batch, num_kv_heads, "
                         f"head_dim]), got shape {info.shape}")
    if info.dtype not in QUANTIZE_IN_DTYPES:
        raise TypeError(f"x: expected dtype {' or '.join(QUANTIZE_IN_DTYPES)}, got {info.dtype}")
    arrays.check_contiguous_aligned(info, "x")
    batch, tokens, num_kv_heads, head_dim = info.shape
    qspec = QuantizeSpec(head_dim=head_dim, in_dtype=info.dtype, kv_format=kv_dtype)  # validates head_dim
    import cupy

    device = info.device if info.device is not None else gpu.current_device()
    # Compiled for the GPU it runs on (an sm_90 cubin loads on no other arch).
    qspec = dataclasses.replace(qspec, arch="sm_" + cupy.cuda.Device(device).compute_capability)
    with streams.on_device(device):
        ptr = arrays.stream_ptr(info, stream)
        with streams.use_stream(ptr):
            capturing = streams.is_capturing(ptr)
            if check is None:
                check = not capturing
            elif check and capturing:
                raise ValueError("check: the status cannot be read back while the stream is captured into a "
                                 "CUDA graph; pass check=False and a status array")
            if capturing:
                _check_capturable(status, positions, block_table)
            x_cp = arrays.to_cupy(x).reshape(batch, tokens, num_kv_heads, head_dim)
            paging = None
            if out is None:
                if positions is not None or block_table is not None:
                    raise ValueError(f"{'positions' if positions is not None else 'block_table'}: only for "
                                     f"writing into a cache (out=...)")
                cache = _new_cache(x_cp, kv_dtype, _scale_array(scale, x_cp, info, kv_dtype, per_head))
                cache_len, positions_arr = tokens, None
            else:
                if scale is not None:
                    raise ValueError("scale: a cache keeps its own scale (out.scale); pass scale=None with out=")
                if block_table is None:
                    cache = _check_cache(out, kv_dtype, batch, num_kv_heads, head_dim)
                    cache_len = arrays.describe(cache.values, "out.values").shape[1]
                else:
                    cache, paging = _check_paged_cache(out, kv_dtype, num_kv_heads, head_dim, kv_layout)
                    paging = _paging_args(block_table, batch, paging, kv_layout)
                    cache_len = int(paging[1]) * int(paging[2])  # the table's pages per sequence x page size
                positions_arr = _positions_array(positions, batch, tokens, cache_len)
            status_arr = _status_array(status)
            _launch(qspec, x_cp, cache, status_arr, positions_arr, tokens, num_kv_heads, cache_len, paging)
            if check:
                _raise_for_status(int(status_arr.get()[0]), kv_dtype)
    if out is not None:
        return out
    return _as_torch(cache) if arrays.is_torch_kind(info) else cache


def _launch(qspec, x_cp, cache, status_arr, positions, tokens, num_kv_heads, cache_len, paging) -> None:
    from cupy.cuda.function import CPointer

    from .codegen import load_kernel
    from .params import QUANTIZE

    function, _ = load_kernel(qspec)
    num_groups = x_cp.size // 16
    threads = qspec.threads
    grid = max(1, -(-num_groups // threads))
    values, block_scales, scale = (_cupy(a) for a in (cache.values, cache.block_scales, cache.scale))
    params = QUANTIZE.new()
    params["x"], params["values"], params["scale"] = x_cp.data.ptr, values.data.ptr, scale.data.ptr
    params["block_scales"] = 0 if block_scales is None else block_scales.data.ptr
    params["positions"] = 0 if positions is None else positions.data.ptr
    params["status"], params["num_groups"], params["tokens"] = status_arr.data.ptr, num_groups, tokens
    params["num_kv_heads"], params["cache_len"], params["per_head"] = num_kv_heads, cache_len, int(scale.size > 1)
    if paging:
        (params["block_table"], params["table_stride"], params["page_size"], params["hnd"],
         params["num_pages"]) = paging[:-1]
    # CuPy copies the struct's bytes when the kernel is launched.
    function((grid,), (threads,), (CPointer(params.ctypes.data),))


def _cupy(a):
    return None if a is None else arrays.to_cupy(a)


def _new_cache(x_cp, kv_dtype: str, scale) -> QuantizedKV:
    import cupy

    value_shape, block_shape = kv_formats.stored_shapes(x_cp.shape, kv_dtype)
    values = cupy.empty(value_shape, cupy.uint8)
    block_scales = None if block_shape is None else cupy.empty(block_shape, cupy.uint8)
    return QuantizedKV(kv_dtype, values, block_scales, scale)


def _scale_array(scale, x_cp, info, kv_dtype: str, per_head: bool):
    """The scale as a device float32 array of 1 or Hkv values."""
    import cupy

    num_kv_heads = info.shape[2]
    if scale is None:
        return _default_scale(x_cp, info.dtype, kv_dtype, per_head)
    if arrays.is_device_array(scale):
        tensors.describe_scale(scale, "scale", num_kv_heads)
        return arrays.to_cupy(scale)
    host = np.asarray(scale, np.float64).reshape(-1)
    kv_formats.head_scales(host, num_kv_heads)  # validates count and sign
    return cupy.asarray(host.astype(np.float32))


def _default_scale(x_cp, in_dtype: str, kv_dtype: str, per_head: bool):
    """amax / format max over the finite elements, in float32 as kv_formats.default_scale_reference."""
    import cupy

    if in_dtype == "bf16":
        values = (x_cp.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    else:
        values = x_cp.astype(cupy.float32)
    magnitude = cupy.where(cupy.isfinite(values), cupy.abs(values), cupy.float32(0))
    amax = magnitude.max(axis=(0, 1, 3)) if per_head else magnitude.max().reshape(1)
    scale = amax / cupy.float32(kv_formats.format_max(kv_dtype))
    scale = cupy.maximum(scale, cupy.float32(kv_formats.MIN_SCALE))
    return cupy.where(amax > 0, scale, cupy.float32(1)).astype(cupy.float32)


def _check_cache(out, kv_dtype: str, batch: int, num_kv_heads: int, head_dim: int) -> QuantizedKV:
    if not isinstance(out, QuantizedKV):
        raise TypeError(f"out: expected a QuantizedKV (from quantize_kv), got {type(out).__name__}")
    if out.kv_dtype != kv_dtype:
        raise ValueError(f"out: the cache holds {out.kv_dtype}, not {kv_dtype}")
    values = arrays.describe(out.values, "out.values")
    value_shape, block_shape = kv_formats.stored_shapes((batch, values.shape[1] if values.ndim == 4 else 0,
                                                         num_kv_heads, head_dim), kv_dtype)
    if values.ndim != 4 or values.shape != value_shape or values.dtype != "uint8":
        raise ValueError(f"out.values: expected uint8 {value_shape} for x's batch, heads and head_dim, got "
                         f"{values.dtype} {values.shape}")
    _check_cache_parts(out, values, block_shape, num_kv_heads)
    return out


def _check_cache_parts(out, values, block_shape, num_kv_heads: int) -> None:
    """The checks a cache's values (of the right shape), block scales and scale share, contiguous
    and paged."""
    arrays.check_contiguous_aligned(values, "out.values")
    if block_shape is not None:
        blocks = arrays.describe(out.block_scales, "out.block_scales")
        if blocks.shape != block_shape or blocks.dtype != "uint8" or not blocks.is_contiguous:
            raise ValueError(f"out.block_scales: expected contiguous uint8 {block_shape}, got "
                             f"{blocks.dtype} {blocks.shape}")
    tensors.describe_scale(out.scale, "out.scale", num_kv_heads)


def _check_paged_cache(out, kv_dtype: str, num_kv_heads: int, head_dim: int, kv_layout: str):
    """A paged QuantizedKV checked against x's heads and head_dim: (out, (num_pages, page_size))."""
    from .paged import cache_geometry

    if not isinstance(out, QuantizedKV) or out.kv_dtype != kv_dtype:
        raise TypeError(f"out: expected a {kv_dtype} QuantizedKV cache, got {getattr(out, 'kv_dtype', type(out).__name__)}")
    values = arrays.describe(out.values, "out.values")
    if values.ndim != 4:
        raise ValueError(f"out.values: expected a paged cache of 4 dimensions, got shape {values.shape}")
    logical = (*values.shape[:3], head_dim)
    num_pages, page_size, heads, _ = cache_geometry(logical, kv_layout, "out.values")
    value_shape, block_shape = kv_formats.stored_shapes(logical, kv_dtype)
    if heads != num_kv_heads or values.shape != value_shape or values.dtype != "uint8":
        raise ValueError(f"out.values: expected uint8 pages of {num_kv_heads} K/V heads and head_dim {head_dim} "
                         f"({kv_layout}), got {values.dtype} {values.shape}")
    _check_cache_parts(out, values, block_shape, num_kv_heads)
    return out, (num_pages, page_size)


def _paging_args(block_table, batch: int, geometry, kv_layout: str) -> tuple:
    """The kernel's paging arguments (table pointer, row length, page size, HND, page count), and
    the device table they point into (kept alive by the caller until the launch)."""
    import cupy

    num_pages, page_size = geometry
    if arrays.is_device_array(block_table):
        info = arrays.describe(block_table, "block_table")
        table = arrays.to_cupy(block_table)
    else:
        table = cupy.asarray(_host_int32(block_table, "block_table"))
        info = arrays.describe(table, "block_table")
    tensors.check_block_table_info(info, batch)
    return table.data.ptr, info.shape[1], page_size, int(kv_layout == "HND"), num_pages, table


def _positions_array(positions, batch: int, tokens: int, cache_len: int):
    """The int32 positions on the device, or None. Host positions are checked here."""
    import cupy

    if positions is None:
        if tokens > cache_len:
            raise ValueError(f"x: {tokens} tokens do not fit a cache of {cache_len} rows")
        return None
    if arrays.is_device_array(positions):
        info = arrays.describe(positions, "positions")
        if info.dtype != "int32" or info.shape != (batch,) or not info.is_contiguous:
            raise ValueError(f"positions: expected a contiguous int32 device array of shape ({batch},), got "
                             f"{info.dtype} {info.shape}")
        return arrays.to_cupy(positions)
    host = np.asarray(positions)
    if host.shape != (batch,) or (host.size and host.dtype.kind not in "iu"):
        raise ValueError(f"positions: expected {batch} integers (one per sequence), got {host.dtype} {host.shape}")
    host = _host_int32(host, "positions")
    end = host.astype(np.int64) + tokens
    bad = np.flatnonzero((host < 0) | (end > cache_len))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"positions: positions[{i}] = {int(host[i])} with {tokens} tokens falls outside the "
                         f"cache's {cache_len} rows")
    return cupy.asarray(host)


def _host_int32(values, name: str) -> np.ndarray:
    """Host integers as contiguous int32; a non-integer dtype or a value outside int32 is a
    ValueError (a silent cast would write to another row or page)."""
    host = np.asarray(values)
    if host.size and host.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected integers, got {host.dtype}")
    if host.size and (int(host.min()) < np.iinfo(np.int32).min or int(host.max()) > np.iinfo(np.int32).max):
        raise ValueError(f"{name}: values must fit int32, got {int(host.min())}..{int(host.max())}")
    return np.ascontiguousarray(host, dtype=np.int32)


def _check_capturable(status, positions, block_table) -> None:
    """Inside CUDA-graph capture every array the kernel reads or writes must outlive the graph: a
    host argument would be copied into a temporary that is freed (and its copy captured). (A new
    cache's scale lives in the cache.)"""
    for name, value in (("status", status), ("positions", positions), ("block_table", block_table)):
        if (value is not None or name == "status") and not arrays.is_device_array(value):
            raise ValueError(f"{name}: while the stream is captured into a CUDA graph, pass it as a device array "
                             f"that outlives the graph" + (" (status: int32, one element)" if name == "status" else ""))


def _status_array(status):
    import cupy

    if status is None:
        return cupy.zeros(1, cupy.int32)
    info = arrays.describe(status, "status")
    if info.dtype != "int32" or info.shape != (1,):
        raise ValueError(f"status: expected a device int32 array of one element, got {info.dtype} {info.shape}")
    return arrays.to_cupy(status)


def _raise_for_status(bits: int, kv_dtype: str) -> None:
    if bits & PAGE_OUT_OF_RANGE:
        raise ValueError("block_table: some tokens fall on pages outside the cache (a page index < 0 or >= the "
                         "cache's page count); they were not written")
    if bits & POSITION_OUT_OF_RANGE:
        raise ValueError("positions: some tokens fall outside the cache (position < 0 or >= its length); "
                         "they were not written")
    if bits & NONFINITE_INPUT:
        what = "elements" if kv_dtype == "fp8_e4m3" else "blocks (block scale 0x7f)"
        raise NonFiniteInputError(f"x: holds NaN or Inf; the affected {what} were written as NaN")


def _as_torch(cache: QuantizedKV) -> QuantizedKV:
    import torch

    def convert(a):
        return None if a is None else torch.from_dlpack(a)

    return QuantizedKV(cache.kv_dtype, convert(cache.values), convert(cache.block_scales), convert(cache.scale))
