"""CPU tests of the programs' Params layouts (splitkv/params.py) against the rendered configs."""

from __future__ import annotations

import re

import numpy as np
import pytest

from splitkv.codegen.render import flat_source, render
from splitkv.heuristics import default_spec
from splitkv.params import DECODE, MERGE, QUANTIZE
from splitkv.spec import KernelSpec, MergeSpec, QuantizeSpec

DECODE_FIELDS, DECODE_OFFSETS, DECODE_SIZE, DECODE_DTYPE = DECODE.fields, DECODE.offsets, DECODE.size, DECODE.dtype


def test_layout_follows_c_alignment_with_the_maps_64_byte_aligned():
    offsets = dict(zip((f for f, _, _ in DECODE_FIELDS), DECODE_OFFSETS))
    assert offsets["k_map"] == 0 and offsets["v_map"] == 128
    for (name, _, kind), offset in zip(DECODE_FIELDS, DECODE_OFFSETS):
        assert offset % {"map": 64, "ptr": 8, "int": 4, "float": 4}[kind] == 0, name
        assert DECODE_DTYPE.fields[name][1] == offset
    assert DECODE_SIZE % 64 == 0 and DECODE_DTYPE.itemsize == DECODE_SIZE <= 4096  # the kernel-argument limit
    for layout in (MERGE, QUANTIZE):
        for (name, _, kind), offset in zip(layout.fields, layout.offsets):
            assert offset % {"ptr": 8, "int": 4, "int64": 8}[kind] == 0 and layout.dtype.fields[name][1] == offset, name
        assert layout.size % 8 == 0 and layout.dtype.itemsize == layout.size


@pytest.mark.parametrize("spec", [KernelSpec(), KernelSpec(kv_copy="tma", cluster=8, mma_m="tokens"),
                                  default_spec("sm_90", 128, 4, "bf16", "nvfp4", page_size=16, kv_layout="HND"),
                                  default_spec("sm_90", 128, 4).as_units()])
def test_every_program_declares_the_same_struct_and_asserts_the_host_size(spec):
    source = render(spec)
    body = source[source.index("struct Params {"):source.index("};", source.index("struct Params {"))]
    assert re.findall(r"\b(\w+);", body) == [f for f, _, _ in DECODE_FIELDS]
    assert f"sizeof(Params) == {DECODE_SIZE}," in source


@pytest.mark.parametrize("spec, layout, kernel", [
    (MergeSpec(), MERGE, "splitkv_merge(const __grid_constant__ splitkv::merge::Params p)"),
    (MergeSpec(tables=True), MERGE, "splitkv_merge(const __grid_constant__ splitkv::merge::Params p)"),
    (QuantizeSpec(), QUANTIZE, "splitkv_quantize(const __grid_constant__ splitkv::quantize::Params p)"),
    (QuantizeSpec(kv_format="nvfp4", head_dim=64), QUANTIZE,
     "splitkv_quantize(const __grid_constant__ splitkv::quantize::Params p)"),
])
def test_merge_and_quantize_programs_declare_their_struct(spec, layout, kernel):
    source = render(spec)
    body = source[source.index("struct Params {"):source.index("};", source.index("struct Params {"))]
    assert re.findall(r"\b(\w+);", body) == [f for f, _, _ in layout.fields]
    assert f"sizeof(Params) == {layout.size}," in source and "__global__" not in source
    assert kernel in flat_source(spec)


def test_a_packed_buffer_reads_back_field_by_field():
    buffer = DECODE.new()
    assert buffer.ctypes.data % 64 == 0 and not buffer.tobytes().strip(b"\0")
    buffer["q"], buffer["max_len"], buffer["scale_log2"] = 0x1234_5678_9ABC, 4096, 0.125
    buffer["v_map"] = np.arange(128, dtype=np.uint8)
    raw = buffer.tobytes()
    offsets = dict(zip((f for f, _, _ in DECODE_FIELDS), DECODE_OFFSETS))
    assert int.from_bytes(raw[offsets["q"]:offsets["q"] + 8], "little") == 0x1234_5678_9ABC
    assert int.from_bytes(raw[offsets["max_len"]:offsets["max_len"] + 4], "little") == 4096
    assert raw[128:256] == bytes(range(128))
    back = DECODE.read(buffer.ctypes.data)
    assert int(back["q"]) == 0x1234_5678_9ABC and float(back["scale_log2"]) == 0.125


def test_kernel_bodies_hold_no_jinja_and_the_config_no_kernel():
    from splitkv.codegen.render import helper_headers

    for name, text in helper_headers().items():
        assert "{{ " not in text and "{% " not in text and "{%-" not in text, name
    config = render(KernelSpec())
    assert "__global__" not in config and '#include "decode/kernel.cuh"' in config
    flat = flat_source(KernelSpec())
    assert "splitkv_decode(const __grid_constant__ splitkv::decode::Params p)" in flat
    assert '#include "decode/' not in flat and flat.count("struct TileLoader {") == 1
