"""CPU tests of run()'s launch path (splitkv/launch.py) that need no fake GPU."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv.launch import _APART, check_outputs_apart, read_arrays


def _overlapping_pair(pointers, extents):
    for i, j in _APART:
        if extents[i] and extents[j] and pointers[i] < pointers[j] + extents[j] and pointers[j] < pointers[i] + extents[i]:
            return i, j
    return None


def test_the_spelled_out_overlap_check_agrees_with_every_pair_checked():
    rng = np.random.default_rng(0)
    names = ("q", "k", "v", "out", "lse")
    for _ in range(20000):
        # A few small arrays on a short address range, some empty: touching, overlapping, apart.
        pointers = tuple(int(p) for p in rng.integers(0, 64, 5))
        extents = tuple(int(e) * int(rng.random() > 0.2) for e in rng.integers(1, 24, 5))
        pair = _overlapping_pair(pointers, extents)
        if pair is None:
            check_outputs_apart(pointers, extents)
        else:
            with pytest.raises(ValueError, match=f"^{names[pair[0]]}: overlaps {names[pair[1]]}"):
                check_outputs_apart(pointers, extents)


def test_arrays_known_only_by_an_interface_have_no_layout_to_reuse():
    class Interface:
        __cuda_array_interface__ = {"version": 3, "shape": (2, 8, 128), "typestr": "<f2",
                                    "data": (0x7000_0000, False), "strides": None}

    layout, pointers, quantized, k_shape = read_arrays(Interface(), None, None, None, None)
    assert layout is None and pointers == (0x7000_0000, 0, 0, 0, 0) and quantized == (0,) * 6 and k_shape == ()


@pytest.mark.parametrize("with_lse", [False, True])
def test_torch_tensors_read_spelled_out_give_the_generic_loops_layout(with_lse):
    torch = pytest.importorskip("torch")
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16)
    v = torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16)[:, :, :, :]
    out = torch.empty(2, 8, 128, dtype=torch.bfloat16)
    lse = torch.empty(2, 8, dtype=torch.float32) if with_lse else None
    fast = read_arrays(q, k, v, out, lse)
    # A None among the torch tensors (here k) takes the generic loop: each entry read alone.
    generic = [read_arrays(x, None, None, None, None) for x in (q, k, v, out)]
    lse_entry = () if lse is None else read_arrays(lse, None, None, None, None)[0][0]
    expected = tuple(g[0][0] for g in generic) + (lse_entry,)
    assert fast[0] == expected
    assert fast[1] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr())
    assert fast[2] == (0,) * 6 and fast[3] == k.shape
    # The layout names what validation depends on: another stride or dtype is another layout.
    assert read_arrays(q, k, v.transpose(1, 2), out, lse)[0] != fast[0]
    assert read_arrays(q, k, v, out.float(), lse)[0] != fast[0]


@pytest.mark.parametrize("kv_dtype, per_head", [("fp8_e4m3", False), ("fp8_e4m3", True), ("nvfp4", False)])
def test_quantized_caches_of_torch_tensors_read_spelled_out_give_the_generic_loops_layout(kv_dtype, per_head):
    torch = pytest.importorskip("torch")
    from splitkv.quantized_kv import QuantizedKV

    width = 64 if kv_dtype == "nvfp4" else 128

    def cache():
        blocks = torch.zeros(2, 64, 2, 8, dtype=torch.uint8) if kv_dtype == "nvfp4" else None
        return QuantizedKV(kv_dtype, torch.zeros(2, 64, 2, width, dtype=torch.uint8), blocks,
                           torch.ones(2 if per_head else 1))

    q, out = torch.zeros(2, 8, 128, dtype=torch.bfloat16), torch.empty(2, 8, 128, dtype=torch.bfloat16)
    k, v = cache(), cache()
    fast = read_arrays(q, k, v, out, None)
    # An out of another torch type takes the generic loop: each array read by its kind.
    generic = read_arrays(q, k, v, torch.nn.Parameter(out, requires_grad=False), None)
    assert fast == generic
    assert fast[1][1] == k.values.data_ptr() and fast[3] == k.values.shape
    assert fast[2][:2] == (k.scale.data_ptr(), v.scale.data_ptr()) and fast[2][4:] == (int(per_head),) * 2
    if kv_dtype == "nvfp4":
        assert fast[2][2:4] == (k.block_scales.data_ptr(), v.block_scales.data_ptr())


def test_a_quantized_cache_with_a_part_of_another_kind_has_no_layout_to_reuse():
    torch = pytest.importorskip("torch")
    from splitkv.quantized_kv import QuantizedKV

    from tests.test_inputs import FakeCAI

    q, out = torch.zeros(2, 8, 128, dtype=torch.bfloat16), torch.empty(2, 8, 128, dtype=torch.bfloat16)
    k = QuantizedKV("fp8_e4m3", torch.zeros(2, 64, 2, 128, dtype=torch.uint8), None, FakeCAI((1,), "<f4"))
    layout, pointers, quantized, _ = read_arrays(q, k, k, out, None)
    assert layout is None and pointers[1] == k.values.data_ptr() and quantized[0] == FakeCAI((1,), "<f4").__cuda_array_interface__["data"][0]


def test_an_array_of_no_known_kind_is_named_in_the_error():
    torch = pytest.importorskip("torch")

    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    with pytest.raises((TypeError, ValueError), match="^out"):
        read_arrays(q, q, q, object(), None)
