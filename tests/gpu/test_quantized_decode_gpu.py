"""GPU correctness of the decode programs on FP8 E4M3 and NVFP4 caches (marker: gpu).

The caches come from the GPU quantizer (bit-exact against the NumPy reference, see
test_quantize_gpu.py) or are drawn as random codes. Each case compares against a float64 reference
computed over the dequantized values (`QuantizedKV.dequantize_reference`), so the error measured is
the kernel's own: relative error < 1e-2, every element within its bound, outputs poisoned first.
The error of the whole path against the unquantized bf16 values (what the format costs) is printed
and held to a loose bound only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import splitkv  # noqa: E402
from splitkv import DecodeAttention, QuantizedKV  # noqa: E402
from splitkv.heuristics import default_spec  # noqa: E402

from decode_checks import _rng, check_close, fresh_seed, poisoned, random_values, reference, to_float64  # noqa: E402

pytestmark = pytest.mark.gpu

FORMATS = ["fp8_e4m3", "nvfp4"]
#: End to end against the unquantized values: FP8 keeps 3 mantissa bits, NVFP4 1 (with a scale per
#: 16 values); the figures are printed, and bounded only to catch a broken format.
END_TO_END_BOUND = {"fp8_e4m3": 0.1, "nvfp4": 0.3}


def head_dims(kv_dtype):
    return [64, 96, 128, 256] if kv_dtype == "fp8_e4m3" else [64, 128, 256]


def quantized_inputs(kv_dtype, batch, max_len, num_kv, head_dim, seed, *, per_head=False):
    """(k, v as QuantizedKV, their dequantized float64 device copies, and the bf16 float64 originals)."""
    k, k_bf16 = random_values((batch, max_len, num_kv, head_dim), "bf16", seed)
    v, v_bf16 = random_values((batch, max_len, num_kv, head_dim), "bf16", seed + 1)
    kq = splitkv.quantize_kv(k, kv_dtype, per_head=per_head)
    vq = splitkv.quantize_kv(v, kv_dtype, per_head=per_head)
    return kq, vq, cupy.asarray(kq.dequantize_reference()), cupy.asarray(vq.dequantize_reference()), k_bf16, v_bf16


def run_quantized(kv_dtype, head_dim, group, lens, *, variant=None, num_splits=None, q_dtype="bf16", num_kv=2,
                  max_len=None, spec_changes=None, per_head=False, q_scale=1.0, warp_heads=None):
    lens = [int(n) for n in lens]
    max_len = max_len or max(max(lens), 1)
    batch, num_qo = len(lens), num_kv * group
    seed = int(_rng(kv_dtype, head_dim, group, tuple(lens), variant, q_dtype).integers(2**31))
    q, q64 = random_values((batch, num_qo, head_dim), q_dtype, seed, q_scale)
    kq, vq, k64, v64, k_bf16, v_bf16 = quantized_inputs(kv_dtype, batch, max_len, num_kv, head_dim, seed + 1,
                                                        per_head=per_head)
    spec = None
    if spec_changes:
        spec = default_spec("sm_90", head_dim, group, q_dtype, kv_dtype).replace(**spec_changes)
    attn = DecodeAttention(num_qo, num_kv, head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype, spec=spec)
    plan = attn.plan(lens, variant=variant, num_splits=num_splits, warp_heads=warp_heads)
    if spec_changes:  # the layout the test is about was really launched
        launched = attn._launch.spec
        assert all(getattr(launched, name) == value for name, value in spec_changes.items()
                   if name not in ("variant", "cluster")), attn.plan_info
    out = poisoned((batch, num_qo, head_dim), q_dtype)
    lse = cupy.full((batch, num_qo), cupy.nan, dtype=cupy.float32)
    attn.run(q, kq, vq, out=out, lse=lse)
    sm_scale = 1.0 / math.sqrt(head_dim)
    ref_out, ref_lse = reference(q64, k64, v64, lens, sm_scale)
    label = f"{kv_dtype} D={head_dim} G={group} {q_dtype} lens={lens[:4]}{'...' if batch > 4 else ''} {attn.plan_info}"
    check_close(out, lse, ref_out, ref_lse, lens, q_dtype, label)
    # What the format costs: the same attention over the unquantized values.
    full_out, _ = reference(q64, k_bf16, v_bf16, lens, sm_scale)
    out64 = to_float64(out, q_dtype)
    end_to_end = float(cupy.linalg.norm(out64 - full_out) / max(float(cupy.linalg.norm(full_out)), 1e-30))
    print(f"{label}: end-to-end relative error against bf16 K/V {end_to_end:.2e}")
    if q_scale == 1.0:  # sharper softmaxes (larger logits) magnify the format's error in K
        assert end_to_end < END_TO_END_BOUND[kv_dtype], f"{label}: end-to-end error {end_to_end:.3e}"
    return attn, plan


@pytest.mark.parametrize("variant", ["dense", "split"])
@pytest.mark.parametrize("group", [1, 4, 16])
@pytest.mark.parametrize("kv_dtype, head_dim", [(f, d) for f in FORMATS for d in head_dims(f)])
def test_lengths_and_ragged_batches(kv_dtype, head_dim, group, variant):
    for lens in ([1], [129], [4096 + 77], [0, 7, 1077, 2048, 300]):
        run_quantized(kv_dtype, head_dim, group, lens, variant=variant, num_splits=5)


@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("group", [4, 8])
def test_planner_choice_long_rows(kv_dtype, group):
    run_quantized(kv_dtype, 128, group, [65536], num_kv=1)
    run_quantized(kv_dtype, 128, group, [3000, 5, 0, 16384], num_kv=2)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_per_head_scales_fp16_queries_and_large_logits(kv_dtype):
    run_quantized(kv_dtype, 128, 4, [5000, 33], num_kv=4, per_head=True)
    run_quantized(kv_dtype, 128, 4, [5000, 33], num_kv=2, q_dtype="fp16")
    run_quantized(kv_dtype, 128, 4, [3000, 5, 0], q_scale=30.0)


SHAPES = [
    {"cluster": 1},
    {"cluster": 4},
    {"fused_merge": False, "cluster": 1},
    {"warps": 8, "tile_tokens": 16, "chunk_size": 128},
    {"warps": 2, "tile_tokens": 64, "chunk_size": 128},
    {"stages": 3},
    {"mma_m": "heads"},  # 8 query heads on the MMA's 16 rows: the rows-8 MMAs
]


@pytest.mark.parametrize("changes", SHAPES + [{"kv_copy": "cp_async"}, {"kv_copy": "tma"}])
def test_fp8_cta_shapes_and_copies(changes):
    run_quantized("fp8_e4m3", 128, 4, [7000, 1, 2500, 0], variant="split", num_splits=9, spec_changes=changes,
                  num_kv=2, per_head=True)


# NVFP4: every shape through per-lane copies, and the shapes that do not ask for per-lane copies
# through tensor maps too (values in boxes, block scales per lane on the same stage barriers).
NVFP4_SHAPES = ([{**c, "kv_copy": "cp_async"} for c in SHAPES]
                + [{**c, "kv_copy": "tma"} for c in SHAPES if "kv_copy" not in c])


@pytest.mark.parametrize("changes", NVFP4_SHAPES)
def test_nvfp4_cta_shapes(changes):
    run_quantized("nvfp4", 128, 4, [7000, 1, 2500, 0], variant="split", num_splits=9, spec_changes=changes,
                  num_kv=2, per_head=True)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_a_warp_per_kv_head(kv_dtype):
    run_quantized(kv_dtype, 128, 4, [700] * 16, variant="dense", warp_heads=True, num_kv=8)


def random_codes(kv_dtype, shape, rng, scale_codes):
    """A QuantizedKV of random bytes: every finite E4M3 code (FP8), every E2M1 code and block scales
    drawn from ``scale_codes`` (NVFP4), with a per-tensor scale."""
    if kv_dtype == "fp8_e4m3":
        values = rng.integers(0, 256, size=shape, dtype=np.uint8)
        values[(values & 0x7F) == 0x7F] = 0x3C  # NaN codes are tested on their own
        blocks = None
    else:
        values = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // 2), dtype=np.uint8)
        blocks = rng.choice(np.asarray(scale_codes, np.uint8), size=(*shape[:-1], shape[-1] // 16))
    scale = cupy.asarray([rng.uniform(0.5, 2.0)], dtype=cupy.float32)
    return QuantizedKV(kv_dtype, cupy.asarray(values), None if blocks is None else cupy.asarray(blocks), scale)


@pytest.mark.parametrize("kv_dtype, scale_codes", [
    ("fp8_e4m3", None),
    ("nvfp4", range(0x30, 0x40)),   # block scales 0.5 .. 0.94
    ("nvfp4", range(0x00, 0x08)),   # E4M3 subnormal block scales: fp16 subnormal products
    ("nvfp4", range(0x08, 0x7F)),   # every normal block scale up to 448
])
def test_random_codes_over_the_format(kv_dtype, scale_codes):
    # Codes no quantizer would write next to each other: the whole value range of the format, and
    # products that are fp16 subnormals (E2M1 0.5 x 2^-14 x a block scale of 2^-9 is 2^-24).
    rng = _rng("codes", kv_dtype, str(scale_codes))
    lens, num_kv, group, dim = [3000, 17, 1024], 2, 4, 128
    q, q64 = random_values((3, num_kv * group, dim), "bf16", fresh_seed(71), 0.05 if scale_codes is None else 1.0)
    kq = random_codes(kv_dtype, (3, 3000, num_kv, dim), rng, scale_codes)
    vq = random_codes(kv_dtype, (3, 3000, num_kv, dim), rng, scale_codes)
    for variant in ("dense", "split"):
        attn = DecodeAttention(num_kv * group, num_kv, dim, kv_dtype=kv_dtype)
        attn.plan(lens, variant=variant, num_splits=4)
        out = poisoned(q.shape, "bf16")
        lse = cupy.full(q.shape[:2], cupy.nan, dtype=cupy.float32)
        attn.run(q, kq, vq, out=out, lse=lse)
        ref_out, ref_lse = reference(q64, cupy.asarray(kq.dequantize_reference()),
                                     cupy.asarray(vq.dequantize_reference()), lens, 1 / math.sqrt(dim))
        check_close(out, lse, ref_out, ref_lse, lens, "bf16", f"random {kv_dtype} codes {variant}")


def _nan_code_at(cache: QuantizedKV, b, t, h):
    """Writes the format's NaN code at token t of K/V head h of sequence b (NVFP4: a block scale)."""
    target = cache.values if cache.kv_dtype == "fp8_e4m3" else cache.block_scales
    target[b, t, h, 0] = 0x7F


@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("variant", ["dense", "split"])
def test_nan_codes(kv_dtype, variant):
    # NaN codes past the lengths never reach the output; inside a length they make their head's
    # outputs NaN (never silently finite), and only theirs.
    lens, num_kv, group, dim = [2000, 77], 2, 4, 128
    q, q64 = random_values((2, num_kv * group, dim), "bf16", fresh_seed(81))
    kq, vq, k64, v64, _, _ = quantized_inputs(kv_dtype, 2, 2048, num_kv, dim, fresh_seed(82))
    for cache in (kq, vq):
        for b, n in enumerate(lens):
            for t in range(n, 2048, 97):
                _nan_code_at(cache, b, t, b % num_kv)
        cache.values[1, 77:] = 0xFF  # all of a tail (FP8 -NaN; NVFP4 -6, scaled by NaN below)
        if cache.block_scales is not None:
            cache.block_scales[1, 77:] = 0x7F
    attn = DecodeAttention(num_kv * group, num_kv, dim, kv_dtype=kv_dtype)
    attn.plan(lens, variant=variant, num_splits=3)
    out = poisoned(q.shape, "bf16")
    attn.run(q, kq, vq, out=out)
    k64, v64 = (cupy.asarray(c.dequantize_reference()) for c in (kq, vq))
    ref_out, ref_lse = reference(q64, k64, v64, lens, 1 / math.sqrt(dim))
    check_close(out, None, ref_out, ref_lse, lens, "bf16", f"NaN codes past the length, {kv_dtype} {variant}")

    _nan_code_at(vq, 0, 1500, 1)  # inside sequence 0's length, K/V head 1
    out = poisoned(q.shape, "bf16")
    attn.run(q, kq, vq, out=out)
    out64 = to_float64(out, "bf16")
    assert bool(cupy.isnan(out64[0, group:2 * group]).any()), "a NaN code inside the length must show"
    assert bool(cupy.isfinite(out64[0, :group]).all()) and bool(cupy.isfinite(out64[1]).all()), \
        "a NaN code must reach only its own head's outputs"


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_cuda_graph_replays_read_new_scales(kv_dtype):
    num_kv, group, dim, lens = 2, 4, 128, [3000, 17, 5000]
    q, q64 = random_values((3, num_kv * group, dim), "bf16", fresh_seed(91))
    kq, vq, k64, v64, _, _ = quantized_inputs(kv_dtype, 3, 5000, num_kv, dim, fresh_seed(92))
    device_lens = cupy.asarray(lens, dtype=cupy.int32)
    attn = DecodeAttention(num_kv * group, num_kv, dim, kv_dtype=kv_dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    attn.plan(device_lens, stream=stream)
    out = cupy.empty(q.shape, cupy.uint16)
    with stream:
        attn.run(q, kq, vq, out=out)
        stream.begin_capture()
        attn.run(q, kq, vq, out=out)
        graph = stream.end_capture()
    for replay, factor in enumerate([1.0, 0.25]):
        kq.scale[...] = kq.scale * factor  # new scales in place: the graph reads them at each replay
        vq.scale[...] = vq.scale * 2
        out[...] = poisoned(out.shape, "bf16")
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        k64, v64 = (cupy.asarray(c.dequantize_reference()) for c in (kq, vq))
        ref_out, ref_lse = reference(q64, k64, v64, lens, 1 / math.sqrt(dim))
        check_close(out, None, ref_out, ref_lse, lens, "bf16", f"{kv_dtype} graph replay {replay}")


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_torch_caches_through_decode(kv_dtype):
    torch = pytest.importorskip("torch")
    q = torch.randn(2, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 4000, 4, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 4000, 4, 128, device="cuda", dtype=torch.bfloat16)
    kq, vq = splitkv.quantize_kv(k, kv_dtype), splitkv.quantize_kv(v, kv_dtype, per_head=True)
    assert isinstance(kq.values, torch.Tensor)
    lens = [4000, 999]
    out, lse = splitkv.decode(q, kq, vq, lens, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == q.shape
    k64, v64 = (cupy.asarray(c.dequantize_reference()) for c in (kq, vq))
    ref_out, ref_lse = reference(cupy.asarray(q.double()), k64, v64, lens, 1 / math.sqrt(128))
    out_bits = cupy.asarray(out.view(torch.int16)).view(cupy.uint16)
    check_close(out_bits, cupy.asarray(lse), ref_out, ref_lse, lens, "bf16", f"torch {kv_dtype} through decode()")


def test_mismatched_caches_are_refused():
    q, _ = random_values((1, 8, 128), "bf16", fresh_seed(101))
    k, _ = random_values((1, 256, 2, 128), "bf16", fresh_seed(102))
    kq = splitkv.quantize_kv(k, "fp8_e4m3")
    k4 = splitkv.quantize_kv(k, "nvfp4")
    attn = DecodeAttention(8, 2, 128, kv_dtype="fp8_e4m3")
    attn.plan([256])
    with pytest.raises(ValueError, match="kv_dtype"):
        attn.run(q, k4, k4)  # NVFP4 caches for an FP8 instance
    with pytest.raises(TypeError, match="v"):
        attn.run(q, kq, k4)  # K and V of different formats
    with pytest.raises(TypeError, match="uint8"):
        attn.run(q, kq.values, kq.values)  # bare bytes: no format, no scale
    bad = QuantizedKV("fp8_e4m3", kq.values, None, cupy.ones(3, cupy.float32))
    with pytest.raises(ValueError, match="scale"):
        attn.run(q, bad, kq)
