"""The host side of kv_copy='tma': the box geometry the tensor maps are encoded with (no GPU)."""

import numpy as np
import pytest

from splitkv.choices import TMA_BOX_BYTES
from splitkv.codegen.render import flat_source
from splitkv.spec import KernelSpec
from splitkv.tensor_map import MAP_ALIGN, MAP_BYTES, TensorMapCache, _aligned_buffer, box_geometry


def test_geometry_of_a_bf16_cache():
    # K of batch 3, 1000 tokens, 8 K/V heads of 128 dims: 3000 rows of 1024 elements, 2048 bytes apart,
    # boxes of 64 dims (128 bytes) x 32 tokens, as the program's kv_at expects.
    geo = box_geometry(3 * 1000, 8 * 128, 2, 32)
    assert geo["dims"] == (1024, 3000) and geo["row_stride"] == 2048 and geo["box"] == (64, 32)
    # The program takes its box width from the same constant: boxes of 128 bytes, 64 bf16 dims.
    source = flat_source(KernelSpec(arch="sm_90", kv_copy="tma"))  # the config and the headers it includes
    assert f"constexpr int BOX_BYTES = {TMA_BOX_BYTES};" in source
    assert "constexpr int BOX_ELEMS = BOX_BYTES / MAP_ELEM_BYTES;" in source and "constexpr int KV_BITS = 16;" in source
    assert geo["swizzle"] == 3  # the 128-byte swizzle
    assert geo["l2_promotion"] == 0  # whole lines already: no promotion


def test_geometry_of_an_nvfp4_cache():
    # NVFP4 rows of 128 dims are 64 bytes, one box each with the 64-byte swizzle; head_dim 64's rows
    # of 32 bytes take the 32-byte swizzle. The map's elements are bytes (two values each).
    geo = box_geometry(3 * 1000, 8 * 64, 1, 32, 64)
    assert geo["dims"] == (512, 3000) and geo["row_stride"] == 512 and geo["box"] == (64, 32) and geo["swizzle"] == 2
    assert box_geometry(3000, 8 * 32, 1, 32, 32)["swizzle"] == 1
    # Rows narrower than a 128-byte line fill the whole line in L2 (the neighbouring head's half).
    assert geo["l2_promotion"] == 2 and box_geometry(3000, 8 * 32, 1, 32, 32)["l2_promotion"] == 2
    spec = KernelSpec(arch="sm_90", kv_dtype="nvfp4", kv_copy="tma", warps=8, chunk_size=256)
    assert spec.tma_box_bytes == 64 and spec.kv_elem_bytes == 1
    # Tiles start on the 64-byte swizzle's period (8 rows, 512 bytes): 32 rows of 64 bytes and
    # 32 rows of 8 block-scale bytes (2304 bytes) take 2560.
    assert spec.tile_bytes == 2560
    source = flat_source(spec)
    assert "constexpr int BOX_BYTES = 64;" in source and "constexpr int TILE_BYTES = 2560;" in source
    with pytest.raises(ValueError, match="32, 64 or 128"):
        box_geometry(3000, 8 * 64, 1, 32, 48)


def test_geometry_of_an_fp8_cache():
    # FP8 rows of 128 dims are one box of 128 one-byte elements.
    geo = box_geometry(3 * 1000, 8 * 128, 1, 64)
    assert geo["dims"] == (1024, 3000) and geo["row_stride"] == 1024 and geo["box"] == (128, 64)


@pytest.mark.parametrize("args, match", [
    ((10, 4, 2, 32), "multiple of 16"),   # 8-byte rows
    ((10, 1024, 4, 32), "not supported"),  # fp32 elements
    ((10, 1024, 2, 512), "1 to 256"),
    ((0, 1024, 2, 32), "coordinates"),
])
def test_geometry_rejects_what_the_copy_engine_cannot_read(args, match):
    with pytest.raises(ValueError, match=match):
        box_geometry(*args)


def test_map_buffers_are_aligned():
    for _ in range(8):
        buf = _aligned_buffer()
        assert buf.ctypes.data % MAP_ALIGN == 0 and buf.nbytes == MAP_BYTES and buf.dtype == np.uint8


def test_cache_encodes_each_cache_once_and_evicts_the_least_recently_used(monkeypatch):
    # run() asks for the maps of K and V on every call: a loop over the same caches must not encode
    # again, and once more maps are in use than the cache holds, the least recently used goes.
    import splitkv.tensor_map as tm

    encoded = []

    def fake_encode(ptr, rows, cols, elem_bytes, box_rows, box_bytes):
        encoded.append((ptr, box_rows))
        return tm._aligned_buffer()

    monkeypatch.setattr(tm, "encode", fake_encode)
    cache = tm.TensorMapCache(entries=2)
    a = cache.encoded(0x1000, 10, 1024, 2, 32)
    b = cache.encoded(0x2000, 10, 1024, 2, 32)
    assert cache.encoded(0x1000, 10, 1024, 2, 32) is a  # a hit, and now the most recent
    assert encoded == [(0x1000, 32), (0x2000, 32)]
    assert isinstance(a, bytes) and len(a) == 128  # the map's bytes, copied into a launch's struct
    cache.encoded(0x1000, 10, 1024, 2, 16)  # another box is another map: evicts b, not a
    assert cache.encoded(0x1000, 10, 1024, 2, 32) is a
    assert cache.encoded(0x2000, 10, 1024, 2, 32) is not b
    assert encoded == [(0x1000, 32), (0x2000, 32), (0x1000, 16), (0x2000, 32)]


def test_cache_needs_room_for_k_and_v():
    with pytest.raises(ValueError, match="entries"):
        TensorMapCache(entries=1)


def test_missing_driver_library_is_a_clear_error(monkeypatch):
    import splitkv.tensor_map as tm

    monkeypatch.setattr(tm, "_driver", None)
    monkeypatch.setattr(tm, "_DRIVER_LIBRARIES", ("libsplitkv-no-such-driver.so",))
    with pytest.raises(RuntimeError, match="kv_copy='cp_async'"):
        tm.encode(0x1000, 10, 1024, 2, 32)
