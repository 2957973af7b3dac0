"""The host side of kv_copy='tma': the box geometry the tensor maps are encoded with (no GPU)."""

import numpy as np
import pytest

from splitkv.spec import KernelSpec
from splitkv.tensor_map import MAP_ALIGN, MAP_BYTES, _aligned_buffer, box_geometry


def test_geometry_of_a_bf16_cache():
    # K of batch 3, 1000 tokens, 8 K/V heads of 128 dims: 3000 rows of 1024 elements, 2048 bytes apart,
    # boxes of 64 dims (128 bytes) x 32 tokens, as the program's kv_at expects.
    geo = box_geometry(3 * 1000, 8 * 128, 2, 32)
    assert geo["dims"] == (1024, 3000) and geo["row_stride"] == 2048 and geo["box"] == (64, 32)
    spec = KernelSpec(arch="sm_90", kv_copy="tma")
    assert geo["box"][0] * 2 == 128 and spec.head_dim % geo["box"][0] == 0


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


def test_cache_encodes_each_cache_once_and_keeps_the_latest(monkeypatch):
    # run() asks for the maps of K and V on every call: a loop over the same cache must not encode
    # again, and the oldest caches give way once more than `entries` are in use.
    import splitkv.tensor_map as tm

    encoded = []

    def fake_encode(ptr, rows, cols, elem_bytes, box_rows):
        encoded.append(ptr)
        buf = tm._aligned_buffer()
        buf[:8] = np.frombuffer(np.uint64(ptr).tobytes(), dtype=np.uint8)
        return buf

    monkeypatch.setattr(tm, "encode", fake_encode)
    cache = tm.TensorMapCache(entries=2)
    first = cache.argument(0x1000, 10, 1024, 2, 32)
    assert cache.argument(0x1000, 10, 1024, 2, 32) is first and encoded == [0x1000]
    cache.argument(0x1000, 10, 1024, 2, 16)  # another box: another map
    cache.argument(0x2000, 10, 1024, 2, 32)  # evicts the least recently used (0x1000, box 32)
    assert encoded == [0x1000, 0x1000, 0x2000]
    assert cache.argument(0x1000, 10, 1024, 2, 32) is not first and encoded[-1] == 0x1000
