"""The API's edge inputs, refused with an error naming the argument before any GPU work (CPU only:
arrays here are described through __cuda_array_interface__, never touched)."""

from __future__ import annotations

import numpy as np
import pytest

import splitkv
from splitkv import arrays, tensors


class _Interface:
    """A device array as its __cuda_array_interface__ alone: nothing behind the pointer is read."""

    def __init__(self, shape, ptr=1 << 20, typestr="<f2"):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "version": 3, "strides": None}


def test_lengths_past_int32_without_seq_lens():
    with pytest.raises(ValueError, match=r"seq_lens: None reads every sequence as k.shape\[1\] = 2147483648 "
                                         r"tokens, above the 2147483647 the programs index with int32"):
        tensors.check_seq_lens(None, 1, 2**31)
    assert tensors.check_seq_lens(None, 2, 2**31 - 1).tolist() == [2**31 - 1] * 2


def test_a_null_pointer_is_refused():
    q = _Interface((1, 8, 128), ptr=0)
    k = _Interface((1, 16, 1, 128))
    with pytest.raises(ValueError, match=r"q: __cuda_array_interface__ data pointer is 0 \(a null pointer\) for a "
                                         r"shape \(1, 8, 128\) array holding 1024 elements"):
        splitkv.decode(q, k, k)


def test_a_null_pointer_of_an_empty_array_is_allowed():
    info = arrays.describe(_Interface((0, 8, 128), ptr=0), "q")
    assert info.ptr == 0 and info.shape == (0, 8, 128)


@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0])
def test_return_lse_is_a_bool(value):
    q, k = _Interface((1, 8, 128)), _Interface((1, 16, 1, 128))
    with pytest.raises(TypeError, match=f"return_lse: expected True or False, got {value!r}"):
        splitkv.decode(q, k, k, [3], return_lse=value)


def test_numpy_bools_are_bools():
    assert tensors.check_flag(np.True_, "return_lse") is True
    assert tensors.check_flag(np.bool_(False), "return_lse") is False


@pytest.mark.parametrize("max_len, error, message", [
    (-1, ValueError, "max_len: expected None or a bound of 0 or more tokens, got -1"),
    (2.0, TypeError, "max_len: expected None or an int, got 2.0"),
    (True, TypeError, "max_len: expected None or an int, got True"),
])
def test_plan_max_len(max_len, error, message):
    with pytest.raises(error, match=message):
        tensors.plan_lengths([1, 2], max_len, False, 0)
