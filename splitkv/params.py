"""The programs' one kernel argument, a ``Params`` struct, laid out once for the host and the device.

Every decode program takes the same struct by value (``const __grid_constant__ Params p``), with
every field present whatever the spec (a field a program does not read is zero), so the host packs
one layout; the merge program and the K/V quantizer likewise take their own (`MERGE`, `QUANTIZE`). A `StructLayout` is that
layout's single source: the rendered config declares the C++ struct from it field by field and
static_asserts the size against the one computed here, so the two cannot disagree without the
program failing to compile; its numpy structured type is what the host fills.
"""

from __future__ import annotations

import numpy as np

from .tensor_map import MAP_ALIGN, MAP_BYTES

_NUMPY = {"map": np.dtype((np.uint8, MAP_BYTES)), "ptr": np.dtype(np.uint64), "int": np.dtype(np.int32),
          "int64": np.dtype(np.int64), "float": np.dtype(np.float32)}
_ALIGN = {"map": MAP_ALIGN, "ptr": 8, "int": 4, "int64": 8, "float": 4}


class StructLayout:
    """C's layout of a struct of (field, C++ type in the config's aliases, kind) fields: kind "map"
    is a 128-byte CUtensorMap, "ptr" a device address, "int" an int32, "int64" an int64, "float" a
    float32. Each
    offset is rounded up to its field's alignment, the size to the largest alignment (at least 8,
    so the host can write the struct as 64-bit words)."""

    def __init__(self, fields: tuple):
        self.fields = fields
        offsets, end = [], 0
        for _, _, kind in fields:
            end = -(-end // _ALIGN[kind]) * _ALIGN[kind]
            offsets.append(end)
            end += _NUMPY[kind].itemsize
        self.align = max(8, *(_ALIGN[kind] for _, _, kind in fields))
        self.offsets, self.size = offsets, -(-end // self.align) * self.align
        self.offset = dict(zip((name for name, _, _ in fields), offsets))
        self.dtype = np.dtype({"names": [name for name, _, _ in fields],
                               "formats": [_NUMPY[kind] for _, _, kind in fields],
                               "offsets": offsets, "itemsize": self.size})

    def config_fields(self) -> list[dict]:
        """The fields as a config template declares them."""
        return [dict(name=name, ctype=ctype, offset=offset)
                for (name, ctype, _), offset in zip(self.fields, self.offsets)]

    def new(self) -> np.ndarray:
        """A zeroed host buffer of one struct (a record array of one), aligned in host memory like
        the device's (a launch copies it; the alignment keeps a map's bytes where the struct puts them)."""
        raw = np.zeros(self.size + self.align, np.uint8)
        start = -raw.ctypes.data % self.align
        return raw[start:start + self.size].view(self.dtype)[0:1]

    def read(self, address: int) -> np.void:
        """A copy of the struct at host ``address`` (what a launch argument points at), as a record:
        for tests and tools that check what a launch would pass."""
        import ctypes

        raw = (ctypes.c_char * self.size).from_address(address)
        return np.frombuffer(raw, self.dtype, count=1)[0].copy()


#: The decode program's Params. The maps lead: they need 64-byte alignment, and the struct's start has it.
DECODE = StructLayout((
    ("k_map", "splitkv::TensorMap", "map"),   # tma: k as [batch x max_len][num_kv_heads x HEAD_DIM]
    ("v_map", "splitkv::TensorMap", "map"),
    ("q", "const q_t*", "ptr"),               # [batch][query_tokens][num_qo_heads][HEAD_DIM]
    ("k", "const unsigned char*", "ptr"),     # [batch][kv_stride][num_kv_heads][ROW_BYTES], HND [batch][heads][kv_stride][..] (or pages)
    ("v", "const unsigned char*", "ptr"),
    ("seq_lens", "const int*", "ptr"),        # [batch]
    ("out", "out_t*", "ptr"),                 # [batch][query_tokens][num_qo_heads][HEAD_DIM]
    ("lse", "float*", "ptr"),                 # [batch][query_tokens][num_qo_heads] natural log, or null
    ("partial_o", "float*", "ptr"),           # split: [batch][slots][CTA rows x ROWS][HEAD_DIM]
    ("partial_lse", "float*", "ptr"),         # split: [batch][slots][CTA rows x ROWS], base 2
    ("counters", "int*", "ptr"),              # split, zeroed: [batch][CTA rows][ROW_COUNTERS]
    ("k_scale", "const float*", "ptr"),       # quantized: [1] or [num_kv_heads]
    ("v_scale", "const float*", "ptr"),
    ("k_block_scales", "const unsigned char*", "ptr"),  # NVFP4: [batch][max_len][num_kv_heads][SCALE_ROW]
    ("v_block_scales", "const unsigned char*", "ptr"),
    ("block_table", "const int*", "ptr"),     # paged: [batch][table_stride] page indices
    ("units", "const int*", "ptr"),           # units: the work-unit tables
    ("sinks", "const float*", "ptr"),         # sinks: [num_qo_heads] natural-log logits
    ("max_len", "int", "int"),
    ("num_kv_heads", "int", "int"),
    ("tokens_per_split", "int", "int"),
    ("scale_log2", "float", "float"),
    ("k_per_head", "int", "int"),             # quantized: 1 when k_scale has one value per K/V head
    ("v_per_head", "int", "int"),
    ("table_stride", "int", "int"),
    ("num_pages", "int", "int"),
    ("window_left", "int", "int"),            # window: tokens before a query's own that it sees
    ("soft_cap_log2", "float", "float"),      # soft_cap: the cap in base-2 units (cap x log2 e)
    ("kv_stride", "int", "int"),              # contiguous: tokens per sequence (NHD) or head (HND) in memory
))

#: The merge program's Params: the split plans' fields, then the units plans' (each program reads its own).
MERGE = StructLayout((
    ("partial_o", "const float*", "ptr"),     # split: [batch][num_splits][rows][HEAD_DIM]; units: [slots][cta_rows][HEAD_DIM]
    ("partial_lse", "const float*", "ptr"),   # the same rows' log-sum-exps, base 2
    ("out", "out_t*", "ptr"),                 # [batch][query_tokens][num_qo_heads][HEAD_DIM]
    ("lse", "float*", "ptr"),                 # [batch][query_tokens][num_qo_heads] natural log, or null
    ("seq_lens", "const int*", "ptr"),        # split: [batch]
    ("units", "const int*", "ptr"),           # units: the plan's buffer (header, unit rows, merge rows)
    ("sinks", "const float*", "ptr"),         # [num_qo_heads] natural-log logits, or null
    ("batch", "int", "int"),                  # split
    ("num_qo_heads", "int", "int"),
    ("num_splits", "int", "int"),             # split
    ("tokens_per_split", "int", "int"),       # split
    ("max_len", "int", "int"),                # split: the cache's tokens per sequence (lengths clamp to it)
    ("group", "int", "int"),                  # query heads per K/V head
    ("max_units", "int", "int"),              # units: the unit rows the buffer holds
    ("query_tokens", "int", "int"),           # the decode program's rows (merge.cuh's OutRows)
    ("row_blocks", "int", "int"),
    ("cta_rows", "int", "int"),
    ("rows_per_slot", "int", "int"),          # split: a slot's rows (K/V heads x row_blocks x cta_rows)
    ("window_left", "int", "int"),            # split: -1, or the window (merge.cuh's window_begin)
    ("window_align", "int", "int"),           # split: the decode program's tile
    ("empty_states", "int", "int"),           # 1 (merge_states): rows of no tokens merge to 0 and -inf
))

#: The K/V quantizer's Params.
QUANTIZE = StructLayout((
    ("x", "const in_t*", "ptr"),                      # [batch][tokens][num_kv_heads][HEAD_DIM]
    ("values", "unsigned char*", "ptr"),              # the cache's values (contiguous rows or pages)
    ("block_scales", "unsigned char*", "ptr"),        # nvfp4: the cache's block scales
    ("scale", "const float*", "ptr"),                 # [1], or [num_kv_heads]
    ("positions", "const int*", "ptr"),               # [batch] first cache row, or null: 0
    ("status", "int*", "ptr"),                        # bits the kernel ORs in (splitkv/quantize.py)
    ("block_table", "const int*", "ptr"),             # paged: [batch][table_stride]
    ("num_groups", "long long", "int64"),             # 16-element groups of x
    ("tokens", "int", "int"),
    ("num_kv_heads", "int", "int"),
    ("cache_len", "int", "int"),                      # rows per sequence (paged: table_stride x page_size)
    ("per_head", "int", "int"),                       # 1: scale has one value per K/V head
    ("table_stride", "int", "int"),
    ("page_size", "int", "int"),                      # 0: contiguous cache
    ("hnd", "int", "int"),                            # paged: 1 for the HND page layout
    ("num_pages", "int", "int"),
))
