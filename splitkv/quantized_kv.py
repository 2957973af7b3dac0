"""A quantized K or V tensor (`QuantizedKV`): what `splitkv.quantize_kv` makes and `splitkv.decode`
reads, its logical shape and its values decoded for reference."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import arrays, kv_formats


@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """A quantized K or V tensor: ``values`` (uint8, ``[B, L, Hkv, D]`` for FP8 or ``[B, L, Hkv, D/2]``
    for NVFP4), ``block_scales`` (NVFP4: uint8 E4M3 codes ``[B, L, Hkv, D/16]``; FP8: None) and
    ``scale`` (float32, ``(1,)`` per tensor or ``(Hkv,)`` per K/V head), all on the GPU, in the
    array kind of the input that made them (CuPy arrays or torch tensors)."""

    kv_dtype: str
    values: Any
    block_scales: Any
    scale: Any

    @property
    def head_dim(self) -> int:
        width = arrays.describe(self.values, "values").shape[-1]
        return width * 2 if self.kv_dtype == "nvfp4" else width

    @property
    def shape(self) -> tuple:
        """The logical shape ``[B, L, Hkv, D]`` of the tensor the bytes stand for."""
        return (*arrays.describe(self.values, "values").shape[:-1], self.head_dim)

    def dequantize_reference(self, on_device: bool = False):
        """float64 values through the reference decoding: on the host (copies everything back), or
        with ``on_device`` a CuPy array computed on the GPU (the same values, much faster)."""
        scale = None if self.scale is None else _to_host(self.scale)
        if on_device:
            import cupy

            parts = [None if a is None else arrays.to_cupy(a) for a in (self.values, self.block_scales)]
            return kv_formats.dequantize_reference(parts[0], parts[1], self.kv_dtype, scale, xp=cupy)
        host = [None if a is None else _to_host(a) for a in (self.values, self.block_scales)]
        return kv_formats.dequantize_reference(host[0], host[1], self.kv_dtype, scale)


def _to_host(a) -> np.ndarray:
    return arrays.to_cupy(a).get()
