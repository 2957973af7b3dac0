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


class _Recorder:
    """Stands in for cupy.empty and cupy.cuda.Device: records what would be allocated where."""

    def __init__(self):
        self.calls = []
        self.device = None

    def empty(self, shape, dtype):
        self.calls.append((tuple(shape), np.dtype(dtype), self.device))
        return self.calls[-1]


@pytest.mark.parametrize("typestr, lse, expected", [
    ("<V2", False, ((2, 8, 64), np.dtype(np.uint16))),    # bf16 travels as uint16 in CuPy
    ("<f2", False, ((2, 8, 64), np.dtype(np.float16))),
    ("<f2", True, ((2, 8), np.dtype(np.float32))),
])
def test_outputs_for_foreign_arrays(monkeypatch, typestr, lse, expected):
    import contextlib

    import cupy

    from splitkv import runtime

    recorder = _Recorder()

    class Device(contextlib.AbstractContextManager):
        def __init__(self, ordinal=None):
            self.id = 0 if ordinal is None else ordinal

        def __enter__(self):
            recorder.device = self.id
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(cupy, "empty", recorder.empty)
    monkeypatch.setattr(cupy.cuda, "Device", Device)
    q = FakeCAI((2, 8, 64), typestr)
    shape, dtype, device = runtime._new_output(q, lse=lse)
    assert (shape, dtype) == expected
    assert device == 0  # a bare interface names no device: the current one


@pytest.mark.parametrize("changes", [{}, {"cluster": 1, "span_rows": True, "kv_copy": "cp_async"},
                                     {"kv_copy": "cp_async", "steal_tiles": 4}, {"cluster": 8}])
def test_a_given_split_spec_yields_a_valid_dense_spec(monkeypatch, changes):
    # The dense program derived from a caller's spec drops the split-only choices (clusters,
    # stolen tiles, CTAs spanning rows) and keeps the CTA shape.
    import cupy

    from splitkv import DecodeAttention, KernelSpec

    class Device:
        id = 0
        compute_capability = "90"
        attributes = {"MultiProcessorCount": 132}

    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: Device())
    spec = KernelSpec(arch="sm_90", head_dim=128, group_size=4).replace(**changes)
    attn = DecodeAttention(32, 8, 128, spec=spec)
    assert attn.split_spec == spec
    assert attn.dense_spec.variant == "dense" and attn.dense_spec.cluster == 1
    assert not attn.dense_spec.steal_tiles and not attn.dense_spec.span_rows
    assert (attn.dense_spec.warps, attn.dense_spec.tile_tokens) == (spec.warps, spec.tile_tokens)
