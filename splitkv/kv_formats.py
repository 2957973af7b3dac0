"""Quantized K/V formats: what the bytes mean, and a NumPy reference that the GPU quantizer matches
bit for bit.

Two formats, both stored token-major like the BF16 cache (``[..., num_kv_heads, head_dim]``), with
a float32 ``scale`` per tensor (shape ``(1,)``) or per K/V head (shape ``(num_kv_heads,)``):

``fp8_e4m3``
    One byte per element: OCP FP8 E4M3 ("fn": no infinities, max 448, NaN = ``0x7f`` / ``0xff``).
    ``x ~= float(code) * scale``. Quantizing multiplies by ``1 / scale`` (both IEEE float32 operations),
    rounds to nearest-even and saturates to +-448.

``nvfp4``
    NVIDIA's NVFP4: FP4 E2M1 values (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), two per byte along head_dim,
    element ``2i`` in the low nibble and ``2i + 1`` in the high one (``[..., head_dim / 2]`` bytes);
    one E4M3 block scale per 16 consecutive elements (``[..., head_dim / 16]`` bytes, in order); and
    the float32 ``scale`` on top: ``x ~= e2m1 * float(block_scale) * scale``. A block's scale
    is its largest magnitude over 6, in units of ``scale``, rounded to nearest-even E4M3 and
    saturated to 448; the elements are multiplied by ``1 / (block_scale * scale)`` (float32),
    rounded to nearest-even E2M1 and saturated to +-6. A block whose scale rounds to zero (all zeros, or
    tiny next to ``scale``) is all zeros.

Default scales map the tensor's (or the head's) largest magnitude onto the format's largest value:
``amax / 448`` for FP8 and ``amax / (448 * 6)`` for NVFP4 (so the largest block scale is 448), over
the finite elements; an all-zero tensor (or head) gets scale 1.

Non-finite inputs (NaN, +-Inf) are never turned into finite values: an FP8 element becomes NaN
(``0x7f``); an NVFP4 block with any non-finite element gets the NaN block scale ``0x7f`` (and zero
values), so the whole block decodes to NaN. The GPU quantizer also reports them (see
`splitkv.quantize.quantize_kv`).
"""

from __future__ import annotations

import functools

import numpy as np

from .choices import NVFP4_BLOCK, QUANTIZE_FORMATS  # NVFP4_BLOCK: elements per NVFP4 block scale

#: Largest finite magnitudes.
E4M3_MAX = 448.0
E2M1_MAX = 6.0
#: The NaN codes the quantizers write for non-finite inputs (E4M3 element or NVFP4 block scale).
E4M3_NAN = 0x7F
#: Representable E2M1 magnitudes, by code (bits 0..2; bit 3 is the sign).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def check_format(kv_format: str) -> str:
    if kv_format not in QUANTIZE_FORMATS:
        raise ValueError(f"kv_dtype: expected one of {list(QUANTIZE_FORMATS)}, got {kv_format!r}")
    return kv_format


def stored_shapes(shape: tuple, kv_format: str) -> tuple[tuple, tuple | None]:
    """Shapes of the stored values and of the block scales (None for FP8) for a K or V tensor of
    ``shape`` ``[..., num_kv_heads, head_dim]``."""
    check_format(kv_format)
    *lead, head_dim = shape
    if kv_format == "fp8_e4m3":
        return tuple(shape), None
    if head_dim % NVFP4_BLOCK:
        raise ValueError(f"head_dim: NVFP4 needs a multiple of {NVFP4_BLOCK}, got {head_dim}")
    return (*lead, head_dim // 2), (*lead, head_dim // NVFP4_BLOCK)


def format_bytes_per_element(kv_format: str) -> float:
    """Bytes one element costs in memory, block scales included."""
    check_format(kv_format)
    return 1.0 if kv_format == "fp8_e4m3" else 0.5 + 1.0 / NVFP4_BLOCK


#: Smallest scale taken: the quantizer multiplies by 1 / scale (NVFP4: 1 / (block scale x scale),
#: the block scale down to 2^-9), which must stay finite in float32. The default scale of a tensor
#: whose largest magnitude is tinier still is this (its elements then round to 0 or tiny codes).
MIN_SCALE = 2.0 ** -100


def format_max(kv_format: str) -> float:
    """The value a default scale maps the largest magnitude onto (448, or 448 x 6 for NVFP4)."""
    return E4M3_MAX if kv_format == "fp8_e4m3" else E4M3_MAX * E2M1_MAX


def default_scale_reference(x: np.ndarray, kv_format: str, *, per_head: bool) -> np.ndarray:
    """The default float32 scale of ``x`` ``[..., num_kv_heads, head_dim]``: shape (1,) or
    (num_kv_heads,). Computed in float32 exactly as the GPU path does."""
    amax = _amax(np.asarray(x, np.float32), per_head)
    scale = np.maximum(amax / np.float32(format_max(check_format(kv_format))), np.float32(MIN_SCALE))
    return np.where(amax > 0, scale, np.float32(1.0)).astype(np.float32)


def _amax(x: np.ndarray, per_head: bool) -> np.ndarray:
    """Largest finite magnitude (non-finite elements count as 0: they are flagged, not scaled)."""
    x = x.reshape(-1, x.shape[-2], x.shape[-1])
    magnitude = np.where(np.isfinite(x), np.abs(x), np.float32(0))
    amax = magnitude.max(axis=(0, 2)) if per_head else magnitude.max().reshape(1)
    return amax.astype(np.float32)


def head_scales(scale, num_kv_heads: int) -> np.ndarray:
    """``scale`` (1 or num_kv_heads finite values of at least `MIN_SCALE`) as float32 over the head
    axis: shape (num_kv_heads, 1). ValueError otherwise."""
    scale = np.asarray(scale, np.float32).reshape(-1)
    if scale.size not in (1, num_kv_heads):
        raise ValueError(f"scale: expected 1 or num_kv_heads={num_kv_heads} values, got {scale.size}")
    if not np.all(np.isfinite(scale) & (scale >= np.float32(MIN_SCALE))):
        raise ValueError(f"scale: every scale must be finite and at least 2^-100 (the quantizer divides by it), "
                         f"got {scale}")
    return np.broadcast_to(scale, (num_kv_heads,)).reshape(num_kv_heads, 1)


def round_e4m3(y: np.ndarray) -> np.ndarray:
    """E4M3 codes (uint8) of finite float32 ``y``: round to nearest-even, saturate to +-448."""
    import ml_dtypes

    y = np.clip(np.asarray(y, np.float32), -E4M3_MAX, E4M3_MAX)
    return y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def round_e2m1(y: np.ndarray) -> np.ndarray:
    """E2M1 codes (uint8, low nibble) of finite float32 ``y``: round to nearest-even, saturate to +-6."""
    import ml_dtypes

    y = np.clip(np.asarray(y, np.float32), -E2M1_MAX, E2M1_MAX)
    return y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def decode_e2m1(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes, np.uint8)
    magnitude = E2M1_VALUES[codes & 0x7]
    return np.where(codes & 0x8, -magnitude, magnitude)


def quantize_reference(x: np.ndarray, kv_format: str, scale) -> tuple[np.ndarray, np.ndarray | None]:
    """(values, block_scales) of ``x`` ``[..., num_kv_heads, head_dim]`` (any float dtype, read as
    float32) in ``kv_format`` with ``scale`` (1 or num_kv_heads float32 values); block_scales is
    None for FP8. The bytes the GPU quantizer writes."""
    check_format(kv_format)
    x = np.asarray(x, np.float32)
    if x.ndim < 2:
        raise ValueError(f"x: expected [..., num_kv_heads, head_dim], got shape {x.shape}")
    heads = head_scales(scale, x.shape[-2])
    finite = np.isfinite(x)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if kv_format == "fp8_e4m3":
            codes = round_e4m3(np.where(finite, x * (np.float32(1) / heads), 0))
            return np.where(finite, codes, np.uint8(E4M3_NAN)).astype(np.uint8), None
        blocks = x.reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
        block_finite = finite.reshape(blocks.shape).all(axis=-1)
        unit = heads[..., None]  # the scale, broadcast over (head, block, element)
        amax = np.abs(np.where(block_finite[..., None], blocks, 0)).max(axis=-1)
        block_codes = round_e4m3(amax / (np.float32(E2M1_MAX) * unit[..., 0]))
        divisor = decode_e4m3(block_codes).astype(np.float32)[..., None] * unit
        inv = np.where((divisor > 0) & block_finite[..., None], np.float32(1) / divisor, np.float32(0))
        y = np.where(block_finite[..., None], blocks, 0) * inv
        nibbles = round_e2m1(y).reshape(x.shape)
    values = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)
    block_codes = np.where(block_finite, block_codes, np.uint8(E4M3_NAN)).astype(np.uint8)
    return values, block_codes


def dequantize_reference(values, block_scales, kv_format: str, scale, xp=np):
    """float64 ``[..., num_kv_heads, head_dim]`` from stored values (and NVFP4 block scales).
    ``xp`` is the array module of ``values`` and ``block_scales`` (NumPy, or CuPy to stay on the
    GPU); ``scale`` is on the host. Codes are decoded through tables of `decode_e4m3` and
    `decode_e2m1` over every code, so both modules give the same values."""
    check_format(kv_format)
    values = xp.asarray(values, dtype=xp.uint8)
    heads = xp.asarray(head_scales(scale, values.shape[-2]).astype(np.float64))
    e4m3 = xp.asarray(_decoded_codes("e4m3"))
    if kv_format == "fp8_e4m3":
        return e4m3[values] * heads
    e2m1 = xp.asarray(_decoded_codes("e2m1"))
    elements = xp.stack([e2m1[values & 0xF], e2m1[values >> 4]], axis=-1)
    elements = elements.reshape(*values.shape[:-1], -1, NVFP4_BLOCK)
    block = e4m3[xp.asarray(block_scales, dtype=xp.uint8)][..., None]
    return (elements * block).reshape(*values.shape[:-1], -1) * heads


@functools.lru_cache(maxsize=None)
def _decoded_codes(code: str) -> np.ndarray:
    """float64 value of every code of 'e4m3' (256, NaN for the NaN codes) or 'e2m1' (16)."""
    if code == "e4m3":
        return decode_e4m3(np.arange(256, dtype=np.uint8))
    return decode_e2m1(np.arange(16, dtype=np.uint8))
