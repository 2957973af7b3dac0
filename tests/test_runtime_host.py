"""Host-side parts of the runtime that need no GPU: length checks of plan()."""

import numpy as np
import pytest

from splitkv.runtime import DecodeAttention
from tests.test_inputs import FakeCAI

host_lengths = DecodeAttention._host_lengths  # uses no instance state


def test_host_lengths_become_int32():
    lens = host_lengths(None, [5, 0, 17], None)
    assert lens.dtype == np.int32 and lens.tolist() == [5, 0, 17]


@pytest.mark.parametrize("lens, max_len, message", [
    (None, None, "needs the lengths"),
    ([], None, "non-empty"),
    ([[1, 2]], None, "1-D"),
    ([4, -1], None, r"seq_lens\[1\]"),
    ([4, 9], 8, r"seq_lens\[1\]"),
])
def test_bad_host_lengths(lens, max_len, message):
    with pytest.raises(ValueError, match=message):
        host_lengths(None, lens, max_len)


def test_device_lengths_must_be_int32_vectors():
    with pytest.raises(TypeError, match="seq_lens"):
        host_lengths(None, FakeCAI((4,), "<i8"), None)
    with pytest.raises(ValueError, match="seq_lens"):
        host_lengths(None, FakeCAI((2, 2), "<i4"), None)
