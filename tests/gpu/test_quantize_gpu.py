"""GPU K/V quantizer (marker: gpu): bit for bit the NumPy reference of splitkv.kv_formats, on fresh
random inputs of several magnitudes, for whole caches and appends; non-finite inputs and bad
positions reported; torch tensors and CUDA-graph capture."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import seeds

cupy = pytest.importorskip("cupy")

import splitkv  # noqa: E402
from splitkv import NonFiniteInputError, QuantizedKV, quantize_kv  # noqa: E402
from splitkv.kv_formats import default_scale_reference, quantize_reference  # noqa: E402

pytestmark = pytest.mark.gpu

FORMATS = ["fp8_e4m3", "nvfp4"]
_NUMPY = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}
_POISON = 0xA5


#: A generator per key, from the run's seed (tests/seeds.py; SPLITKV_TEST_SEED replays a run).
_rng = seeds.rng


def random_kv(shape, dtype: str, *key):
    """(host float32 copy of the exact values, device array in the quantizer's storage type): normal
    values scaled per head over 5 decades, an outlier channel, some all-zero 16-element blocks, some
    negative zeros and values near the bottom of the formats' ranges."""
    rng = _rng(*key)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= (10.0 ** rng.uniform(-3, 2, size=shape[-2])).astype(np.float32)[:, None]  # fp16 stays finite
    x[..., 5] *= 50
    blocks = x.reshape(-1, 16)
    blocks[rng.random(blocks.shape[0]) < 0.05] = 0
    blocks[rng.random(blocks.shape[0]) < 0.02] *= 1e-6
    x.reshape(-1)[rng.random(x.size) < 0.01] = -0.0
    stored = x.astype(_NUMPY[dtype])
    host = stored.astype(np.float32)
    device = cupy.asarray(stored.view(np.uint16) if dtype == "bf16" else stored)
    return host, device


def host(a):
    return None if a is None else cupy.asnumpy(splitkv.arrays.to_cupy(a))


def assert_bytes_equal(got: QuantizedKV, values, blocks, where=np.s_[...]):
    np.testing.assert_array_equal(host(got.values)[where], values)
    if blocks is not None:
        np.testing.assert_array_equal(host(got.block_scales)[where], blocks)


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim, per_head", [(128, False), (64, True), (256, True), (96, False)])
def test_whole_cache_is_bit_exact_with_the_reference(kv_format, dtype, head_dim, per_head):
    shape = (3, 77, 4, head_dim)
    x, x_dev = random_kv(shape, dtype, kv_format, dtype, head_dim)
    got = quantize_kv(x_dev, kv_format, per_head=per_head)
    scale = default_scale_reference(x, kv_format, per_head=per_head)
    np.testing.assert_array_equal(host(got.scale), scale)
    values, blocks = quantize_reference(x, kv_format, scale)
    assert_bytes_equal(got, values, blocks)
    err = np.linalg.norm(got.dequantize_reference() - x) / np.linalg.norm(x)
    print(f"{kv_format} {dtype} d{head_dim}: relative round-trip error {err:.2e}")
    assert err < (0.05 if kv_format == "fp8_e4m3" else 0.15)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_given_scales_host_and_device(kv_format):
    x, x_dev = random_kv((2, 40, 3, 128), "bf16", kv_format, "given")
    for scale in (0.37, [0.01, 2.5, 1e-4], cupy.asarray([0.05, 0.5, 5.0], dtype=cupy.float32)):
        got = quantize_kv(x_dev, kv_format, scale=scale)
        ref_scale = np.asarray(host(scale) if isinstance(scale, cupy.ndarray) else scale, np.float32).reshape(-1)
        assert_bytes_equal(got, *quantize_reference(x, kv_format, ref_scale))


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("device_positions", [False, True])
def test_append_writes_only_the_new_rows(kv_format, device_positions):
    batch, cache_len, heads, head_dim, tokens = 4, 300, 2, 128, 3
    base, base_dev = random_kv((batch, cache_len, heads, head_dim), "bf16", kv_format, "cache")
    cache = quantize_kv(base_dev, kv_format, per_head=True)
    cache.values[...] = _POISON  # rows the append must not touch keep this
    if cache.block_scales is not None:
        cache.block_scales[...] = _POISON
    new, new_dev = random_kv((batch, tokens, heads, head_dim), "bf16", kv_format, "new")
    positions = np.array([0, 17, 296, 150], np.int32)
    result = quantize_kv(new_dev, kv_format, out=cache, positions=cupy.asarray(positions) if device_positions else positions)
    assert result is cache
    values, blocks = quantize_reference(new, kv_format, host(cache.scale))
    written = np.zeros((batch, cache_len), bool)
    for b, p in enumerate(positions):
        written[b, p:p + tokens] = True
        assert_bytes_equal(cache, values[b], None if blocks is None else blocks[b], np.s_[b, p:p + tokens])
    assert (host(cache.values)[~written] == _POISON).all()
    if blocks is not None:
        assert (host(cache.block_scales)[~written] == _POISON).all()
    # one token per sequence, as a decode step appends it: [B, Hkv, D]
    one, one_dev = random_kv((batch, heads, head_dim), "bf16", kv_format, "one")
    quantize_kv(one_dev, kv_format, out=cache, positions=positions + tokens)
    values, blocks = quantize_reference(one, kv_format, host(cache.scale))
    for b, p in enumerate(positions + tokens):
        assert_bytes_equal(cache, values[b], None if blocks is None else blocks[b], np.s_[b, p])


@pytest.mark.parametrize("kv_format", FORMATS)
def test_non_finite_inputs_are_reported_and_written_as_nan(kv_format):
    x, x_dev = random_kv((2, 10, 2, 64), "fp16", kv_format, "nan")
    for where, bad in (((0, 3, 1, 7), np.nan), ((1, 9, 0, 63), np.inf), ((1, 0, 0, 0), -np.inf)):
        x[where] = bad
        x_dev[where] = bad
    with pytest.raises(NonFiniteInputError, match="NaN or Inf"):
        quantize_kv(x_dev, kv_format, scale=0.01)
    got = quantize_kv(x_dev, kv_format, scale=0.01, check=False)
    assert_bytes_equal(got, *quantize_reference(x, kv_format, 0.01))
    status = cupy.zeros(1, cupy.int32)
    quantize_kv(x_dev, kv_format, scale=0.01, check=False, status=status)
    assert int(status.get()[0]) == splitkv.quantize.NONFINITE_INPUT


def test_positions_out_of_range():
    x, x_dev = random_kv((2, 4, 1, 64), "bf16", "pos")
    cache = quantize_kv(cupy.zeros((2, 16, 1, 64), cupy.uint16), "fp8_e4m3", scale=1.0)
    with pytest.raises(ValueError, match=r"positions\[1\] = 13 with 4 tokens"):
        quantize_kv(x_dev, "fp8_e4m3", out=cache, positions=[0, 13])
    cache.values[...] = _POISON
    # Sequence 0's last two tokens fall past its 16 rows: only the device can tell, and they must
    # not land in sequence 1's first rows.
    with pytest.raises(ValueError, match="outside the cache"):
        quantize_kv(x_dev, "fp8_e4m3", out=cache, positions=cupy.asarray([14, 2], cupy.int32))
    values, _ = quantize_reference(x, "fp8_e4m3", 1.0)
    got = host(cache.values)
    np.testing.assert_array_equal(got[0, 14:16], values[0, :2])
    np.testing.assert_array_equal(got[1, 2:6], values[1])
    assert (got[1, :2] == _POISON).all() and (got[0, :14] == _POISON).all() and (got[1, 6:] == _POISON).all()


def test_input_errors_name_the_argument():
    x = cupy.zeros((2, 4, 2, 64), cupy.uint16)
    with pytest.raises(ValueError, match="kv_dtype"):
        quantize_kv(x, "fp8_e5m2")
    with pytest.raises(TypeError, match="x: expected dtype bf16 or fp16"):
        quantize_kv(cupy.zeros((2, 4, 2, 64), cupy.float32), "nvfp4")
    with pytest.raises(ValueError, match="x: expected \\[batch, tokens"):
        quantize_kv(cupy.zeros((8, 64), cupy.float16), "nvfp4")
    with pytest.raises(ValueError, match="head_dim"):
        quantize_kv(cupy.zeros((1, 1, 1, 40), cupy.float16), "nvfp4")
    with pytest.raises(ValueError, match="x: expected contiguous"):
        quantize_kv(cupy.zeros((2, 4, 2, 128), cupy.float16)[..., :64], "fp8_e4m3")
    with pytest.raises(ValueError, match="scale: every scale must be finite and at least"):
        quantize_kv(x, "fp8_e4m3", scale=-1.0)
    cache = quantize_kv(x, "nvfp4", scale=1.0)
    with pytest.raises(ValueError, match="scale: a cache keeps its own scale"):
        quantize_kv(x, "nvfp4", out=cache, scale=2.0)
    with pytest.raises(ValueError, match="out: the cache holds nvfp4"):
        quantize_kv(x, "fp8_e4m3", out=cache)
    with pytest.raises(ValueError, match="out.values: expected uint8"):
        quantize_kv(cupy.zeros((3, 4, 2, 64), cupy.uint16), "nvfp4", out=cache)
    with pytest.raises(ValueError, match="positions: only for writing into a cache"):
        quantize_kv(x, "nvfp4", positions=[0, 0])


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    x, _ = random_kv((2, 33, 2, 128), "bf16", "torch")
    x_t = torch.from_numpy(x).to("cuda", torch.bfloat16)
    got = quantize_kv(x_t, "nvfp4")
    assert isinstance(got.values, torch.Tensor) and got.values.dtype == torch.uint8
    assert isinstance(got.scale, torch.Tensor) and got.scale.dtype == torch.float32
    scale = default_scale_reference(x, "nvfp4", per_head=False)
    assert_bytes_equal(got, *quantize_reference(x, "nvfp4", scale))
    new = torch.randn(2, 1, 2, 128, device="cuda", dtype=torch.bfloat16)
    quantize_kv(new, "nvfp4", out=got, positions=torch.tensor([5, 32], device="cuda", dtype=torch.int32))
    values, blocks = quantize_reference(new.float().cpu().numpy(), "nvfp4", scale)
    assert_bytes_equal(got, values[0], blocks[0], np.s_[0, 5:6])
    assert_bytes_equal(got, values[1], blocks[1], np.s_[1, 32:33])


def test_append_in_a_cuda_graph_replays_for_new_positions():
    kv_format = "fp8_e4m3"
    cache = quantize_kv(cupy.zeros((2, 64, 2, 64), cupy.uint16), kv_format, scale=[0.02, 0.3])
    new, new_dev = random_kv((2, 1, 2, 64), "bf16", "graph")
    positions = cupy.asarray([0, 0], cupy.int32)
    status = cupy.zeros(1, cupy.int32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        quantize_kv(new_dev, kv_format, out=cache, positions=positions, check=False, status=status)  # compile
        stream.begin_capture()
        with pytest.raises(ValueError, match="check: the status cannot be read back"):
            quantize_kv(new_dev, kv_format, out=cache, positions=positions, check=True)
        with pytest.raises(ValueError, match="positions: while the stream is captured"):
            quantize_kv(new_dev, kv_format, out=cache, positions=[0, 0], check=False, status=status)
        quantize_kv(new_dev, kv_format, out=cache, positions=positions, status=status)
        graph = stream.end_capture()
    values, _ = quantize_reference(new, kv_format, [0.02, 0.3])
    for step in (7, 40, 63):
        positions[...] = cupy.asarray([step, 63 - step], cupy.int32)
        cache.values[...] = _POISON  # each replay must write its rows, and only them
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        assert_bytes_equal(cache, values[0], None, np.s_[0, step:step + 1])
        assert_bytes_equal(cache, values[1], None, np.s_[1, 63 - step:64 - step])
        written = np.zeros(cache.values.shape, bool)
        written[0, step], written[1, 63 - step] = True, True
        assert (host(cache.values)[~written] == _POISON).all()
    assert int(status.get()[0]) == 0


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("page_size, layout", [(1, "NHD"), (16, "HND"), (64, "NHD")])
def test_appending_into_pages_writes_the_bytes_of_the_contiguous_append(kv_format, page_size, layout):
    from splitkv.paged import gather_pages, paginate

    batch, length, heads, dim, tokens = 3, 256, 2, 128, 5
    _, x = random_kv((batch, length, heads, dim), "bf16", "paged cache", kv_format, page_size, layout)
    _, new = random_kv((batch, tokens, heads, dim), "bf16", "paged append", kv_format, page_size, layout)
    cache = quantize_kv(x, kv_format, per_head=True)
    rng = _rng("paged order", kv_format, page_size, layout)
    spare = 3
    order = rng.permutation(batch * length // page_size + spare)
    parts = [paginate(host(a), page_size, layout, order=order, spare_pages=spare) for a in (cache.values, cache.block_scales)
             if a is not None]
    table = parts[0][1]
    pages = QuantizedKV(kv_format, cupy.asarray(parts[0][0]), cupy.asarray(parts[1][0]) if len(parts) > 1 else None,
                        cache.scale)
    before = [host(a).copy() for a in (pages.values, pages.block_scales) if a is not None]
    positions = np.array([0, 100, length - tokens], np.int32)
    quantize_kv(new, kv_format, out=cache, positions=positions)
    quantize_kv(new, kv_format, out=pages, positions=cupy.asarray(positions), block_table=cupy.asarray(table),
                kv_layout=layout)
    lens = [length] * batch
    for got, want, old in zip((pages.values, pages.block_scales), (cache.values, cache.block_scales), before):
        np.testing.assert_array_equal(gather_pages(host(got), table, lens, layout), host(want))
        unused = np.setdiff1d(np.arange(order.size), table.ravel())  # the spare pages stay as they were
        np.testing.assert_array_equal(host(got)[unused], old[unused])
    # A page the cache does not have is refused, and nothing is written onto it.
    bad = table.copy()
    bad[1, 100 // page_size] = order.size
    with pytest.raises(ValueError, match="block_table: some tokens fall on pages outside the cache"):
        quantize_kv(new, kv_format, out=pages, positions=positions, block_table=bad, kv_layout=layout)
