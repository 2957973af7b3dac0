"""The decode inputs checked together: q, k and v (plain or quantized caches, contiguous or paged),
out and lse, sequence lengths and block tables, with the problem size they imply (`DecodeShapes`).

Metadata only (see `splitkv.arrays`): the checks run on the CPU and in tests without a GPU. Every
error names the argument: TypeError for a wrong element type or kind of argument, ValueError for a
wrong rank, shape, stride, alignment, head_dim, group size or device.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrays, choices
from .arrays import (TensorInfo, check_aligned, check_contiguous_aligned, contiguous_strides, describe,
                     is_device_array)
from .quantized_kv import QuantizedKV


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
    query_tokens: int = 1  # q [B, T, Hq, D]: T query tokens per sequence (q [B, Hq, D]: 1)
    kv_stride: int = 0  # contiguous caches: tokens per sequence (NHD) or per K/V head (HND) in memory


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
    shape = (batch, length, heads, width * 8 // choices.KV_DTYPE_BITS[kv_dtype])
    return TensorInfo(parts.values.ptr, shape, contiguous_strides(shape), kv_dtype, parts.values.device,
                      parts.values.kind, parts.values.stream, parts.values.readonly)


def describe_quantized(x: Any, name: str, kv_layout: str = "NHD") -> QuantizedParts:
    """The parts of a `splitkv.QuantizedKV`, checked: uint8 values [B, L, Hkv, D x bits / 8] (paged
    HND caches: [pages, Hkv, page_size, ...]), (NVFP4) uint8 block scales of the same leading shape
    and D / 16 last, float32 scale of 1 or Hkv values, contiguous, 16-byte aligned and on one
    device. TypeError / ValueError name the part."""
    if x.kv_dtype not in choices.QUANTIZED_KV_DTYPES:
        raise ValueError(f"{name}: unknown quantized format {x.kv_dtype!r}; expected one of "
                         f"{list(choices.QUANTIZED_KV_DTYPES)}")
    values = describe(x.values, f"{name}.values")
    _check_rank(values, f"{name}.values", 4, "[batch, max_len, num_kv_heads, packed head_dim]")
    if values.dtype != "uint8":
        raise TypeError(f"{name}.values: expected dtype uint8, got {values.dtype}")
    check_contiguous_aligned(values, f"{name}.values")
    heads = values.shape[1 if kv_layout == "HND" else 2]
    block_scales = None
    if x.kv_dtype == "nvfp4":
        if x.block_scales is None:
            raise ValueError(f"{name}.block_scales: NVFP4 needs its block scales, got None")
        block_scales = describe(x.block_scales, f"{name}.block_scales")
        expected = (*values.shape[:3], values.shape[3] * 2 // choices.NVFP4_BLOCK)
        if block_scales.shape != expected or block_scales.dtype != "uint8":
            raise ValueError(f"{name}.block_scales: expected uint8 {expected}, got {block_scales.dtype} "
                             f"{block_scales.shape}")
        check_contiguous_aligned(block_scales, f"{name}.block_scales")
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
    check_aligned(scale, name, 4, "4 bytes (float32)")
    return scale


def check_decode_inputs(q: TensorInfo, k: TensorInfo, v: TensorInfo, *,
                        out: TensorInfo | None = None, lse: TensorInfo | None = None,
                        kv_layout: str | None = None, contiguous_layout: str = "NHD") -> DecodeShapes:
    """Validate contiguous q [B, Hq, D] or [B, T, Hq, D] (T query tokens per sequence, up to
    `choices.MAX_QUERY_TOKENS`), k and v [B, L_max, Hkv, D], out of q's shape, lse of q's shape
    without its last axis.
    With ``kv_layout`` ('NHD' or 'HND'), k and v are paged caches of that layout (see
    `splitkv.paged`), of any number of pages. Without it, ``contiguous_layout`` 'HND' reads k and v
    as [B, Hkv, L_max, D]; a contiguous cache of either layout may be a view of a longer one
    (``cache[:, :L]``, ``cache[:, :, :L]``: rows of D contiguous, `cache_token_stride`).

    Raises TypeError for a wrong element type or argument kind and ValueError for a wrong rank,
    shape, stride, alignment, head_dim, group size or device; every message names the argument.
    """
    for name, info in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        if info is not None and not isinstance(info, TensorInfo):
            raise TypeError(f"{name}: expected a TensorInfo (from describe), got {type(info).__name__}")

    if q.ndim != 4:
        _check_rank(q, "q", 3, "[batch, num_qo_heads, head_dim] (or [batch, query_tokens, num_qo_heads, head_dim])")
    _check_rank(k, "k", 4, PAGED_SHAPES[kv_layout] if kv_layout else CONTIGUOUS_SHAPES[contiguous_layout])
    _check_dtype(q, "q", choices.Q_DTYPES)
    _check_dtype(k, "k", choices.KV_DTYPES)
    if q.ndim == 4:
        batch, query_tokens, num_qo_heads, head_dim = q.shape
        if not 1 <= query_tokens <= choices.MAX_QUERY_TOKENS:
            raise ValueError(f"q: expected 1 to {choices.MAX_QUERY_TOKENS} query tokens per sequence (q.shape[1]), "
                             f"got shape {q.shape}")
    else:
        (batch, num_qo_heads, head_dim), query_tokens = q.shape, 1
    num_pages = page_size = 0
    if kv_layout:
        from .paged import cache_geometry

        num_pages, page_size, num_kv_heads, _ = cache_geometry(k.shape, kv_layout)
        max_len = 0
    elif contiguous_layout == "HND":
        _, num_kv_heads, max_len, _ = k.shape
    else:
        _, max_len, num_kv_heads, _ = k.shape

    _check_head_dim(head_dim)
    if not kv_layout:
        _check_dim(k, "k", 0, batch, "batch", "q.shape[0]")
    _check_dim(k, "k", 3, head_dim, "head_dim", f"q.shape[{q.ndim - 1}]")
    group_size = _group_size(num_qo_heads, num_kv_heads)
    _check_v(v, k)

    kv_stride = 0
    for name, info in (("q", q), ("k", k), ("v", v)):
        if name == "q" or kv_layout:
            check_contiguous_aligned(info, name)
        else:
            kv_stride = cache_token_stride(info, name, contiguous_layout)
        _check_same_device(info, name, q)
    if not kv_layout and v.strides != k.strides:
        raise ValueError(f"v: expected the strides of k {k.strides} (in elements), got {v.strides}")
    if out is not None:
        _check_out(out, q)
    if lse is not None:
        _check_lse(lse, q)
    return DecodeShapes(batch=batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, max_len=max_len, group_size=group_size,
                        q_dtype=q.dtype, kv_dtype=k.dtype, num_pages=num_pages, page_size=page_size,
                        query_tokens=query_tokens, kv_stride=kv_stride)


#: The dimensions of a contiguous cache per layout, for messages.
CONTIGUOUS_SHAPES = {"NHD": "[batch, max_len, num_kv_heads, head_dim]",
                     "HND": "[batch, num_kv_heads, max_len, head_dim]"}


def cache_token_stride(info: TensorInfo, name: str, layout: str) -> int:
    """A contiguous cache's tokens per sequence (NHD ``[B, S, Hkv, D][:, :L]``) or per K/V head (HND
    ``[B, Hkv, S, D][:, :, :L]``) in memory, S >= L: a whole cache (S = L) or a view of a
    preallocated longer one, read in place. Its rows of D elements are contiguous, a token's K/V
    heads (NHD) or a head's tokens (HND) a row apart, and it starts 16-byte aligned. ValueError
    naming ``name`` otherwise. (Strides of extent-1 dimensions say nothing, and are not checked.)"""
    batch, outer, inner, head_dim = info.shape
    s_batch, s_outer, s_inner, s_elem = info.strides
    length, heads = (inner, outer) if layout == "HND" else (outer, inner)
    if 0 in info.shape:  # an empty cache: no row is read, whatever its strides say
        check_aligned(info, name, 16, "16 bytes (the kernels use 16-byte loads)")
        return int(length)
    expected = ("[B, Hkv, S, D][:, :, :L] with S >= L" if layout == "HND" else "[B, S, Hkv, D][:, :L] with S >= L")
    ok = head_dim <= 1 or s_elem == 1
    if layout == "HND":
        ok = ok and (length <= 1 or s_inner == head_dim)
        per_head = s_outer if heads > 1 else (s_batch if batch > 1 else max(length, 1) * head_dim)
        ok = ok and per_head % head_dim == 0 and per_head // head_dim >= length
        ok = ok and (batch <= 1 or heads <= 1 or s_batch == heads * s_outer)
        stride = per_head // head_dim if head_dim else length
    else:
        row = heads * head_dim
        ok = ok and (heads <= 1 or s_inner == head_dim) and (length <= 1 or s_outer == row)
        per_seq = s_batch if batch > 1 else max(length, 1) * row
        ok = ok and row > 0 and per_seq % row == 0 and per_seq // row >= length
        stride = per_seq // row if row else length
    if not ok:
        raise ValueError(f"{name}: expected a contiguous cache or a view {expected} (rows of head_dim contiguous), "
                         f"got shape {info.shape} and strides {info.strides} (in elements)")
    check_aligned(info, name, 16, "16 bytes (the kernels use 16-byte loads)")
    return int(stride)


def cache_span_bytes(info: TensorInfo) -> int:
    """Bytes from a cache view's first element to one past its last (its extent, with the gaps of a
    view of a longer cache): what out and lse must not overlap."""
    if any(n == 0 for n in info.shape):
        return 0
    last = sum((n - 1) * s for n, s in zip(info.shape, info.strides))
    return (last + 1) * info.itemsize


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
    if head_dim not in choices.HEAD_DIMS:
        raise ValueError(f"q: head_dim {head_dim} (q.shape[-1]) is not supported; expected one of "
                         f"{list(choices.HEAD_DIMS)}")


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
    if group_size > choices.MAX_GROUP:
        raise ValueError(f"k: group size num_qo_heads / num_kv_heads = {num_qo_heads} / {num_kv_heads} "
                         f"= {group_size} is more than the supported {choices.MAX_GROUP}")
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
    check_contiguous_aligned(out, "out")
    _check_same_device(out, "out", q)


def _check_lse(lse: TensorInfo, q: TensorInfo) -> None:
    _check_writable(lse, "lse")
    expected = q.shape[:-1]
    if lse.shape != expected:
        layout = "[batch, query_tokens, num_qo_heads]" if q.ndim == 4 else "[batch, num_qo_heads]"
        raise ValueError(f"lse: expected shape {expected} {layout}, got {lse.shape}")
    if lse.dtype != "fp32":
        raise TypeError(f"lse: expected dtype fp32, got {lse.dtype}")
    if not lse.is_contiguous:
        raise ValueError(f"lse: expected contiguous strides {contiguous_strides(lse.shape)} (in "
                         f"elements), got {lse.strides}")
    check_aligned(lse, "lse", 4, "its 4-byte elements")
    _check_same_device(lse, "lse", q)


def _check_same_device(info: TensorInfo, name: str, q: TensorInfo) -> None:
    # A bare __cuda_array_interface__ does not say its device; such arrays cannot be compared.
    if info.device is None or q.device is None:
        return
    if info.device != q.device:
        raise ValueError(f"{name}: expected CUDA device {q.device} (the device of q), "
                         f"got device {info.device}")


def check_sinks(info: TensorInfo, num_qo_heads: int, device: int | None) -> None:
    """Attention sinks: a contiguous, aligned float32 ``[num_qo_heads]`` device array on ``device``."""
    if info.dtype != "fp32" or info.shape != (num_qo_heads,) or not info.is_contiguous:
        raise ValueError(f"sinks: expected a contiguous float32 [{num_qo_heads}] array (a logit per query head), "
                         f"got {info.dtype} {info.shape}")
    check_aligned(info, "sinks", 4, "its 4-byte elements")
    check_device("sinks", info, device, "this DecodeAttention runs on")


# ---- sequence lengths -------------------------------------------------------------------------

def check_block_table_info(info: TensorInfo, batch: int) -> None:
    """A device block table's layout: contiguous int32 ``[batch, max_pages_per_seq]``."""
    if info.dtype != "int32" or info.ndim != 2 or info.shape[0] != batch or not info.is_contiguous:
        raise ValueError(f"block_table: expected a contiguous int32 [{batch}, max_pages_per_seq] array, "
                         f"got {info.dtype} {info.shape}")
    check_aligned(info, "block_table", 4, "its 4-byte elements")


def check_seq_lens(seq_lens: Any, batch: int, max_len: int | None) -> np.ndarray | None:
    """Validate the per-sequence K/V lengths.

    None means every sequence holds max_len tokens and returns that as a host array. A host
    sequence or NumPy array is checked (length ``batch``, every value in 0..max_len; max_len None:
    no bound but the programs' int32) and returned as a contiguous int32 NumPy array. A device array (int32, shape [batch], contiguous) is accepted
    as is and returns None: its values stay on the device, and whoever must plan reads them back.
    """
    if seq_lens is None:
        if max_len > _INT32_MAX:  # np.full would raise NumPy's OverflowError
            raise ValueError(f"seq_lens: None reads every sequence as k.shape[1] = {max_len} tokens, above the "
                             f"{_INT32_MAX} the programs index with int32; give the lengths")
        return np.full(batch, max_len, dtype=np.int32)
    if isinstance(seq_lens, TensorInfo) or is_device_array(seq_lens):
        _check_device_seq_lens(describe(seq_lens, "seq_lens"), batch)
        return None
    return _check_host_seq_lens(seq_lens, batch, max_len)


def _check_device_seq_lens(info: TensorInfo, batch: int) -> None:
    if info.dtype != "int32":
        raise TypeError(f"seq_lens: expected dtype int32 on the device, got {info.dtype}")
    if info.shape != (batch,):
        raise ValueError(f"seq_lens: expected shape ({batch},) [batch], got {info.shape}")
    if not info.is_contiguous:
        raise ValueError(f"seq_lens: expected contiguous strides (1,), got {info.strides}")
    check_aligned(info, "seq_lens", 4, "its 4-byte elements")


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


def plan_lengths(seq_lens: Any, max_len: Any, on_device: bool, device: int) -> np.ndarray:
    """`DecodeAttention.plan`'s lengths, checked, as int32 on the host (``on_device``: a device
    array, read back from ``device``: the one synchronisation of plan())."""
    if seq_lens is None:
        raise ValueError("seq_lens: plan() needs the lengths (host ints or a device int32 array)")
    if on_device:
        seq_lens = read_back_lengths(seq_lens, None, device, "this DecodeAttention runs on")
    host = np.asarray(seq_lens)
    if host.ndim != 1 or host.size == 0:
        raise ValueError(f"seq_lens: expected a non-empty 1-D sequence of lengths, got shape {host.shape}")
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral)):
        raise TypeError(f"max_len: expected None or an int, got {max_len!r}")
    if max_len is not None and max_len < 0:
        raise ValueError(f"max_len: expected None or a bound of 0 or more tokens, got {max_len!r}")
    return check_seq_lens(host, host.size, None if max_len is None else int(max_len))


def read_back_lengths(seq_lens: Any, batch: int | None, device: int | None, owner: str) -> np.ndarray:
    """Device lengths (int32, contiguous, ``batch`` of them; None: any 1-D count) on ``device``,
    read back to the host; their values are checked by the caller."""
    info = describe(seq_lens, "seq_lens")
    count = batch if batch is not None else (info.shape[0] if info.ndim == 1 else -1)
    check_seq_lens(info, count, 0)  # type, shape and strides only: the values are still on the device
    check_device("seq_lens", info, device, owner)
    return arrays.to_cupy(seq_lens).get()


def check_device(name: str, info: TensorInfo, device: int | None, owner: str) -> None:
    """ValueError naming ``name`` when it is on another device than ``device`` (None: unknown)."""
    if info.device is not None and device is not None and info.device != device:
        raise ValueError(f"{name}: on CUDA device {info.device}, but {owner} device {device}")


_LOG2E = 1.4426950408889634


def check_flag(value: Any, name: str) -> bool:
    """``value`` as a bool: True, False or a NumPy bool; TypeError naming it otherwise (a truthy string
    or number would silently change what a call returns)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name}: expected True or False, got {value!r}")


def check_sm_scale(sm_scale: Any) -> float | None:
    """None, or ``sm_scale`` as a positive finite float; TypeError / ValueError naming it otherwise."""
    if sm_scale is None:
        return None
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale: expected None or a positive finite float, got {sm_scale!r}")
    value = float(sm_scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"sm_scale: expected a positive finite float, got {sm_scale!r}")
    float32 = np.finfo(np.float32)  # the programs get value x log2(e) as a float32
    if not float(float32.tiny) <= value * _LOG2E <= float(float32.max):
        raise ValueError(f"sm_scale: {sm_scale!r} x log2(e) is outside the normal float32 range the programs take")
    return value


def check_run_inputs(arrays: tuple, device: int, kv_layout: str | None,
                     contiguous_layout: str = "NHD") -> tuple[list, DecodeShapes, tuple]:
    """Checks `DecodeAttention.run`'s (q, k, v, out, lse) against each other and the instance's
    ``device`` (``kv_layout``: a paged cache's layout, None for a contiguous one of
    ``contiguous_layout``); returns the
    streams their producers named (interface 'stream'), their shapes, and the bytes each array
    spans (a quantized cache: its values; None: 0)."""
    q, k, v, out, lse = arrays
    scale_infos = []  # a quantized cache's scales are read on this device too, once their producers are done
    extents = []

    def describe_one(x, name):
        if name not in ("k", "v") or not isinstance(x, QuantizedKV):
            info = describe(x, name, bf16_from_uint16=True)
            extents.append(cache_span_bytes(info) if name in ("k", "v") and info.ndim == 4 else info.nbytes)
            return info
        parts = describe_quantized(x, name, kv_layout or "NHD")
        scale_infos.extend([(f"{name}.block_scales", parts.block_scales), (f"{name}.scale", parts.scale)])
        extents.append(parts.values.nbytes)
        return quantized_kv_info(x.kv_dtype, parts)

    infos = [describe_one(x, name) for x, name in zip(arrays[:4], "q k v out".split())]
    lse_info = describe(lse, "lse") if lse is not None else None
    extents.append(lse_info.nbytes if lse_info is not None else 0)
    named = list(zip("q k v out lse".split(), (*infos, lse_info))) + scale_infos
    for name, info in named:
        if info is not None:
            check_device(name, info, device, "this DecodeAttention runs on")
    shapes = check_decode_inputs(*infos[:3], out=infos[3], lse=lse_info, kv_layout=kv_layout,
                                 contiguous_layout=contiguous_layout)
    producers = [info.stream for _, info in named if info is not None and info.stream is not None]
    return producers, shapes, tuple(extents)
