"""merge_states on the CPU: the layouts it takes and refuses (`check_states`), and the struct it
hands the merge program (on the fake GPU of tests/fake_gpu.py). What it computes is the GPU
suite's (tests/gpu/test_merge_states_gpu.py)."""

from __future__ import annotations

import pytest

from splitkv.arrays import TensorInfo
from splitkv.merge_states import check_states


def _info(shape, dtype):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return TensorInfo(ptr=1 << 32, shape=tuple(shape), strides=tuple(reversed(strides)), dtype=dtype, device=0,
                      kind="cai")


def test_states_of_every_head_dim_are_taken():
    for head_dim in (64, 96, 128, 256):
        check_states(_info((5, 3, 8, head_dim), "bf16"), _info((5, 3, 8), "fp32"), _info((8,), "fp32"))
    check_states(_info((1, 1, 1, 128), "fp16"), _info((1, 1, 1), "fp32"), None)


@pytest.mark.parametrize("states, lses, sinks, error, match", [
    ((5, 8, 128), (5, 8), None, ValueError, "states: expected \\[N, S, H, D\\]"),
    ((5, 2, 8, 128), (5, 2, 8), None, None, None),
    ((5, 2, 8, 100), (5, 2, 8), None, ValueError, "head_dim 100"),
    ((5, 0, 8, 128), (5, 0, 8), None, ValueError, "at least one state"),
    ((5, 2, 8, 128), (5, 8), None, ValueError, "lses: expected float32"),
    ((5, 2, 8, 128), (5, 2, 8), (4,), ValueError, "sinks: expected a contiguous float32 \\[8\\]"),
])
def test_bad_layouts_are_named(states, lses, sinks, error, match):
    args = (_info(states, "bf16"), _info(lses, "fp32"), None if sinks is None else _info(sinks, "fp32"))
    if error is None:
        check_states(*args)
        return
    with pytest.raises(error, match=match):
        check_states(*args)


def test_fp32_states_are_refused():
    with pytest.raises(TypeError, match="bf16 or fp16"):
        check_states(_info((2, 2, 8, 128), "fp32"), _info((2, 2, 8), "fp32"), None)
