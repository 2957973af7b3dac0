"""The quantized K/V formats on the CPU: the NumPy reference against brute-force rounding over the
formats' value tables, the rules for scales, blocks and non-finite inputs, and the quantizer
programs compiling for sm_90 and sm_100a."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from splitkv import kv_formats
from splitkv.kv_formats import (E2M1_VALUES, E4M3_NAN, NVFP4_BLOCK, decode_e2m1, decode_e4m3, default_scale_reference,
                                dequantize_reference, quantize_reference, round_e2m1, round_e4m3)
from splitkv.spec import QuantizeSpec

_E4M3_CODES = np.arange(256, dtype=np.uint8)
_E4M3_FINITE = _E4M3_CODES[(_E4M3_CODES & 0x7F) != 0x7F]


def _nearest_even(y: np.ndarray, codes: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Brute force: the code of the value nearest to each y, ties to the code with an even
    mantissa (lowest bit 0); +-0 by the sign of y; saturating at the largest value."""
    y = np.asarray(y, np.float64)
    distance = np.abs(y[:, None] - values[None, :])
    best = distance.min(axis=1, keepdims=True)
    ties = distance == best
    # among tied candidates prefer an even code, then the sign of y (for +-0)
    sign_matches = (np.signbit(values)[None, :] == np.signbit(y)[:, None])
    score = ties * (4 + 2 * ((codes[None, :] & 1) == 0) + sign_matches)
    return codes[np.argmax(score, axis=1)]


def _tie_points(values: np.ndarray) -> np.ndarray:
    v = np.unique(values[np.isfinite(values)])
    return (v[1:] + v[:-1]) / 2


def test_e4m3_rounding_is_nearest_even_and_saturating():
    values = decode_e4m3(_E4M3_FINITE)
    rng = np.random.default_rng(1)
    ties = _tie_points(values)
    y = np.concatenate([ties, -ties, np.nextafter(ties, 0), np.nextafter(ties, np.inf), values,
                        rng.standard_normal(20000) * 30, rng.uniform(-1e-2, 1e-2, 5000), [449.0, 464.0, 1e9, -1e9]])
    y = y.astype(np.float32)
    expected = _nearest_even(np.clip(y, -448, 448), _E4M3_FINITE, values)
    assert np.array_equal(round_e4m3(y), expected)


def test_e2m1_rounding_is_nearest_even_and_saturating():
    codes = np.arange(16, dtype=np.uint8)
    values = decode_e2m1(codes)
    ties = _tie_points(values)
    rng = np.random.default_rng(2)
    y = np.concatenate([ties, -ties, np.nextafter(ties, 0), np.nextafter(ties, 10), values,
                        rng.uniform(-8, 8, 20000), [7.0, -100.0, 1e30]]).astype(np.float32)
    expected = _nearest_even(np.clip(y, -6, 6), codes, values)
    got = round_e2m1(y)
    assert np.array_equal(got, expected)
    # The comparison chain the GPU encoder uses (kv_formats.cuh, encode_e2m1) gives the same codes.
    a = np.abs(y)
    chain = ((a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    assert np.array_equal(chain | np.where(np.signbit(y), 8, 0).astype(np.uint8), got)


def test_e2m1_value_table_matches_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    assert np.array_equal(decode_e2m1(codes), codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64))
    assert E2M1_VALUES.max() == kv_formats.E2M1_MAX


def _random_kv(shape, seed, outliers=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if outliers:
        x[..., 3] *= 40  # a channel with outliers, as real K caches have
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("per_head", [False, True])
def test_round_trip_error_is_bounded_by_the_format(kv_format, per_head):
    x = _random_kv((2, 33, 4, 64), seed=3)
    scale = default_scale_reference(x, kv_format, per_head=per_head)
    assert scale.shape == ((4,) if per_head else (1,)) and scale.dtype == np.float32
    values, blocks = quantize_reference(x, kv_format, scale)
    back = dequantize_reference(values, blocks, kv_format, scale)
    assert back.shape == x.shape
    err = np.abs(back - x)
    if kv_format == "fp8_e4m3":
        # 3 mantissa bits: half an ulp is 2^-4 of the value, down to the subnormal step 2^-9 x scale
        s = np.broadcast_to(scale.reshape(-1, 1), (4, 64))
        assert np.all(err <= np.maximum(np.abs(x) * 2.0**-4, 2.0**-10 * s) * (1 + 1e-6))
        assert values.shape == x.shape and blocks is None
    else:
        assert values.shape == (2, 33, 4, 32) and blocks.shape == (2, 33, 4, 64 // NVFP4_BLOCK)
        block_scale = decode_e4m3(blocks) * np.broadcast_to(scale.reshape(-1, 1), (4, 4))
        step = np.repeat(block_scale, NVFP4_BLOCK, axis=-1)  # the largest E2M1 gap is 2 (4 -> 6)
        assert np.all(err <= step * 1.0 + 1e-30)
        # the block scale (E4M3, 3 mantissa bits) keeps the block's largest element within ~7%
        amax = np.abs(x).reshape(*x.shape[:-1], -1, NVFP4_BLOCK).max(-1)
        assert np.all(block_scale * 6 >= amax * (1 - 2.0**-4) - 1e-30)
    rel = np.linalg.norm(back - x) / np.linalg.norm(x)
    assert rel < (0.05 if kv_format == "fp8_e4m3" else 0.15), rel


def test_default_scale_maps_the_largest_magnitude_onto_the_format_max():
    x = _random_kv((1, 8, 2, 32), seed=4)
    x[0, 5, 1, 7] = -1234.0
    assert default_scale_reference(x, "fp8_e4m3", per_head=False)[0] == np.float32(1234.0) / np.float32(448)
    per_head = default_scale_reference(x, "nvfp4", per_head=True)
    assert per_head[1] == np.float32(1234.0) / np.float32(448 * 6)
    assert per_head[0] == np.abs(x[..., 0, :]).max() / np.float32(448 * 6)
    values, _ = quantize_reference(x, "fp8_e4m3", default_scale_reference(x, "fp8_e4m3", per_head=False))
    assert decode_e4m3(values[0, 5, 1, 7]) == -448.0
    # all zeros: scale 1, not 0 (a zero scale would divide by zero)
    assert default_scale_reference(np.zeros((1, 2, 2, 16)), "fp8_e4m3", per_head=True).tolist() == [1.0, 1.0]


def test_non_finite_inputs_become_nan_never_finite():
    x = _random_kv((1, 4, 2, 32), seed=5)
    x[0, 1, 0, 3] = np.nan
    x[0, 2, 1, 20] = np.inf
    x[0, 3, 0, 0] = -np.inf
    scale = default_scale_reference(x, "fp8_e4m3", per_head=False)
    assert np.isfinite(scale).all()  # non-finite elements do not set the scale
    values, _ = quantize_reference(x, "fp8_e4m3", scale)
    assert values[0, 1, 0, 3] == E4M3_NAN and values[0, 2, 1, 20] == E4M3_NAN and values[0, 3, 0, 0] == E4M3_NAN
    assert np.isnan(dequantize_reference(values, None, "fp8_e4m3", scale)).sum() == 3
    values, blocks = quantize_reference(x, "nvfp4", default_scale_reference(x, "nvfp4", per_head=False))
    assert blocks[0, 1, 0, 0] == E4M3_NAN and blocks[0, 2, 1, 1] == E4M3_NAN and blocks[0, 3, 0, 0] == E4M3_NAN
    assert (values[0, 1, 0, :8] == 0).all()  # the elements of a NaN block are zeros
    back = dequantize_reference(values, blocks, "nvfp4", 1.0)
    # exactly the three blocks decode to NaN, whole
    assert np.array_equal(np.isnan(back), np.repeat(blocks == E4M3_NAN, NVFP4_BLOCK, axis=-1))
    assert (blocks == E4M3_NAN).sum() == 3


def test_nvfp4_zero_blocks_tiny_blocks_and_nibble_order():
    x = np.zeros((1, 1, 1, 32), np.float32)
    x[0, 0, 0, 16:] = [0.5, 1, 1.5, 2, 3, 4, 6, -6, -4, -3, -2, -1.5, -1, -0.5, 0, -0.0]
    values, blocks = quantize_reference(x, "nvfp4", 1.0)
    assert blocks[0, 0, 0, 0] == 0 and (values[0, 0, 0, :8] == 0).all()  # an all-zero block
    assert decode_e4m3(blocks[0, 0, 0, 1]) == 1.0  # amax 6 -> block scale 1
    # element 2i in the low nibble: codes 1 (0.5) and 2 (1.0) make byte 0x21
    assert values[0, 0, 0, 8] == 0x21 and values[0, 0, 0, 11] == (0x7 | (0xF << 4))
    # a block 2^-20 of the scale: its scale underflows E4M3, so it is stored as zeros
    tiny = np.full((1, 1, 1, 16), 2.0**-20, np.float32)
    values, blocks = quantize_reference(tiny, "nvfp4", 1.0)
    assert blocks.item() == 0 and not values.any()


def test_reference_rejects_bad_scales_and_shapes():
    x = np.ones((1, 2, 4, 32), np.float32)
    with pytest.raises(ValueError, match="scale: expected 1 or num_kv_heads=4"):
        quantize_reference(x, "fp8_e4m3", [1.0, 2.0])
    for bad in (0.0, -1.0, 1e-37, float("inf")):
        with pytest.raises(ValueError, match="finite and at least 2\\^-100"):
            quantize_reference(x, "nvfp4", bad)


def test_tiny_tensors_get_a_scale_whose_reciprocal_is_finite():
    """A tensor of tiny finite values (largest below 448 x 2^-100) gets the smallest scale taken, so
    1 / scale and 1 / (block scale x scale) stay finite: its zeros stay zeros and nothing turns NaN."""
    from splitkv.kv_formats import MIN_SCALE, default_scale_reference, dequantize_reference

    x = np.zeros((1, 1, 1, 32), np.float32)
    x[..., 0], x[..., 1] = 1e-37, -2e-38
    for kv_format in ("fp8_e4m3", "nvfp4"):
        scale = default_scale_reference(x, kv_format, per_head=False)
        assert scale[0] == np.float32(MIN_SCALE)
        values, blocks = quantize_reference(x, kv_format, scale)
        back = dequantize_reference(values, blocks, kv_format, scale)
        assert np.all(np.isfinite(back)) and np.all(back[..., 2:] == 0)
        assert np.all(np.abs(back - x) <= 1e-36)
    with pytest.raises(ValueError, match="kv_dtype"):
        quantize_reference(x, "int4", 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        kv_formats.stored_shapes((1, 2, 4, 40), "nvfp4")
    assert kv_formats.stored_shapes((3, 5, 2, 128), "nvfp4") == ((3, 5, 2, 64), (3, 5, 2, 8))
    assert kv_formats.format_bytes_per_element("nvfp4") == 0.5625


def test_quantize_spec_validates_and_names():
    assert QuantizeSpec().name == "sm_90-quantize-d128-bf16-fp8_e4m3"
    assert QuantizeSpec(arch="sm100a", head_dim=96, in_dtype="fp16", kv_format="nvfp4").name == \
        "sm_100a-quantize-d96-fp16-nvfp4"
    with pytest.raises(ValueError, match="head_dim"):
        QuantizeSpec(head_dim=40)
    with pytest.raises(ValueError, match="kv_format"):
        QuantizeSpec(kv_format="fp8_e5m2")
    with pytest.raises(ValueError, match="in_dtype"):
        QuantizeSpec(in_dtype="fp32")


@pytest.mark.parametrize("arch", ["sm_90", "sm_100a"])
@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("in_dtype", ["bf16", "fp16"])
def test_quantize_programs_compile_without_spills(arch, kv_format, in_dtype):
    compile_ = pytest.importorskip("splitkv.codegen.compile")
    try:
        compile_.check_compiler()
    except compile_.CompilerUnavailableError as exc:
        pytest.skip(str(exc))
    for head_dim in (64, 128, 256):
        result = compile_.compile_cubin(QuantizeSpec(arch=arch, head_dim=head_dim, in_dtype=in_dtype,
                                                     kv_format=kv_format))
        assert result.cubin[:4] == b"\x7fELF"
        assert result.spill_bytes == 0, result.log


def test_caches_to_quantize_into_are_checked_part_by_part():
    """quantize_kv's checks of ``out``, contiguous and paged (on interfaces: no GPU needed)."""
    from splitkv.quantize import QuantizedKV, _check_cache, _check_paged_cache
    from tests.test_inputs import FakeCAI

    def arr(shape, typestr="|u1", ptr=0x7F00_0000_0000):
        return FakeCAI(shape, typestr, ptr=ptr)

    scale = arr((2,), "<f4")
    cache = QuantizedKV("nvfp4", arr((3, 64, 2, 64)), arr((3, 64, 2, 8)), scale)
    assert _check_cache(cache, "nvfp4", 3, 2, 128) is cache
    with pytest.raises(ValueError, match="out.values: expected uint8"):
        _check_cache(cache, "nvfp4", 4, 2, 128)
    with pytest.raises(ValueError, match="out.block_scales: expected contiguous uint8"):
        _check_cache(QuantizedKV("nvfp4", arr((3, 64, 2, 64)), arr((3, 64, 2, 4)), scale), "nvfp4", 3, 2, 128)
    with pytest.raises(ValueError, match="out.scale"):
        _check_cache(QuantizedKV("nvfp4", arr((3, 64, 2, 64)), arr((3, 64, 2, 8)), arr((3,), "<f4")), "nvfp4", 3, 2, 128)
    with pytest.raises(ValueError, match="the cache holds fp8_e4m3"):
        _check_cache(QuantizedKV("fp8_e4m3", arr((3, 64, 2, 128)), None, scale), "nvfp4", 3, 2, 128)

    pages = QuantizedKV("fp8_e4m3", arr((10, 2, 16, 128)), None, scale)  # HND: 10 pages of 16 tokens
    assert _check_paged_cache(pages, "fp8_e4m3", 2, 128, "HND") == (pages, (10, 16))
    with pytest.raises(ValueError, match=r"expected uint8 pages of 2 K/V heads and head_dim 128 \(NHD\)"):
        _check_paged_cache(pages, "fp8_e4m3", 2, 128, "NHD")  # read as NHD: pages of 2 tokens of 16 heads
    with pytest.raises(ValueError, match="page size 12"):
        _check_paged_cache(QuantizedKV("fp8_e4m3", arr((10, 12, 2, 128)), None, scale), "fp8_e4m3", 2, 128, "NHD")
    with pytest.raises(ValueError, match="expected uint8 pages of 4 K/V heads"):
        _check_paged_cache(pages, "fp8_e4m3", 4, 128, "HND")
    with pytest.raises(TypeError, match="expected a nvfp4 QuantizedKV"):
        _check_paged_cache(pages, "nvfp4", 2, 128, "HND")


def test_host_positions_and_tables_are_checked_not_cast():
    """Host integers outside int32 or of a float dtype are refused (a cast would write another row
    or page); inside CUDA-graph capture, status, positions and tables must be device arrays."""
    from splitkv.quantize import _check_capturable, _host_int32, _positions_array
    from tests.test_inputs import FakeCAI

    assert _host_int32([[3, 4]], "block_table").dtype == np.int32
    with pytest.raises(ValueError, match="block_table: values must fit int32"):
        _host_int32([[2**32 + 5, 1]], "block_table")
    with pytest.raises(ValueError, match="block_table: expected integers"):
        _host_int32([[1.9, 2.0]], "block_table")
    with pytest.raises(ValueError, match="positions: values must fit int32"):
        _positions_array(np.array([2**63 + 5], np.uint64), 1, 1, 64)
    device = FakeCAI((1,), "<i4", ptr=0x7F00_0000_0000)
    _check_capturable(device, device, None)
    for args, name in (((None, device, None), "status"), ((device, [0], None), "positions"),
                       ((device, None, [[0]]), "block_table")):
        with pytest.raises(ValueError, match=f"{name}: while the stream is captured"):
            _check_capturable(*args)


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "nvfp4"])
def test_dequantizing_through_code_tables_gives_the_decoded_values(kv_format):
    """Every code (both nibbles, every block scale) decodes as ml_dtypes decodes it, times the scales."""
    rng = np.random.default_rng(5)
    values = rng.integers(0, 256, size=(3, 4, 64), dtype=np.uint8)
    values[0, 0, :] = np.arange(64)  # the low codes; the rest are random
    blocks = rng.integers(0, 256, size=(3, 4, 128 // NVFP4_BLOCK), dtype=np.uint8) if kv_format == "nvfp4" else None
    scale = np.array([0.5, 2.0, 1.0, 3.0], np.float32)
    got = dequantize_reference(values, blocks, kv_format, scale)
    if kv_format == "fp8_e4m3":
        want = values.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale[:, None]
    else:
        nibbles = np.stack([values & 0xF, values >> 4], axis=-1).reshape(3, 4, 128)
        elements = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
        block = np.repeat(blocks.view(ml_dtypes.float8_e4m3fn).astype(np.float64), NVFP4_BLOCK, axis=-1)
        want = elements * block * scale[:, None]
    np.testing.assert_array_equal(got, want)
