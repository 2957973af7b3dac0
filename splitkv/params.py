"""The decode program's one kernel argument, ``Params``, laid out once for the host and the device.

Every decode program takes the same struct by value (``const __grid_constant__ Params p``), with
every field present whatever the spec (a field a program does not read is zero), so the host packs
one layout. `DECODE_FIELDS` is that layout's single source: the rendered config declares the C++
struct from it field by field and static_asserts each offset and the size against the numbers
computed here, so the two cannot disagree without the program failing to compile; `DECODE_DTYPE`
is the numpy structured type the runtime fills.
"""

from __future__ import annotations

import numpy as np

from .tensor_map import MAP_ALIGN, MAP_BYTES

#: (field, C++ type in the config's aliases, kind): kind "map" is a 128-byte CUtensorMap,
#: "ptr" a device address, "int" an int32, "float" a float32. The maps lead: they need 64-byte
#: alignment, and the struct's start has it.
DECODE_FIELDS = (
    ("k_map", "splitkv::TensorMap", "map"),   # tma: k as [batch x max_len][num_kv_heads x HEAD_DIM]
    ("v_map", "splitkv::TensorMap", "map"),
    ("q", "const q_t*", "ptr"),               # [batch][num_qo_heads][HEAD_DIM]
    ("k", "const unsigned char*", "ptr"),     # [batch][max_len][num_kv_heads][ROW_BYTES] (or pages)
    ("v", "const unsigned char*", "ptr"),
    ("seq_lens", "const int*", "ptr"),        # [batch]
    ("out", "out_t*", "ptr"),                 # [batch][num_qo_heads][HEAD_DIM]
    ("lse", "float*", "ptr"),                 # [batch][num_qo_heads] natural log, or null
    ("partial_o", "float*", "ptr"),           # split: [batch][slots][num_qo_heads][HEAD_DIM]
    ("partial_lse", "float*", "ptr"),         # split: [batch][slots][num_qo_heads], base 2
    ("counters", "int*", "ptr"),              # split, zeroed: [batch][num_kv_heads][ROW_COUNTERS]
    ("k_scale", "const float*", "ptr"),       # quantized: [1] or [num_kv_heads]
    ("v_scale", "const float*", "ptr"),
    ("k_block_scales", "const unsigned char*", "ptr"),  # NVFP4: [batch][max_len][num_kv_heads][SCALE_ROW]
    ("v_block_scales", "const unsigned char*", "ptr"),
    ("block_table", "const int*", "ptr"),     # paged: [batch][table_stride] page indices
    ("units", "const int*", "ptr"),           # units: the work-unit tables
    ("max_len", "int", "int"),
    ("num_kv_heads", "int", "int"),
    ("tokens_per_split", "int", "int"),
    ("scale_log2", "float", "float"),
    ("k_per_head", "int", "int"),             # quantized: 1 when k_scale has one value per K/V head
    ("v_per_head", "int", "int"),
    ("table_stride", "int", "int"),
    ("num_pages", "int", "int"),
)

_NUMPY = {"map": np.dtype((np.uint8, MAP_BYTES)), "ptr": np.dtype(np.uint64), "int": np.dtype(np.int32),
          "float": np.dtype(np.float32)}
_ALIGN = {"map": MAP_ALIGN, "ptr": 8, "int": 4, "float": 4}


def _layout(fields) -> tuple[list[int], int]:
    """C's layout of ``fields``: each offset rounded up to its alignment, the size to the largest."""
    offsets, end = [], 0
    for _, _, kind in fields:
        end = -(-end // _ALIGN[kind]) * _ALIGN[kind]
        offsets.append(end)
        end += _NUMPY[kind].itemsize
    align = max(_ALIGN[kind] for _, _, kind in fields)
    return offsets, -(-end // align) * align


DECODE_OFFSETS, DECODE_SIZE = _layout(DECODE_FIELDS)
DECODE_DTYPE = np.dtype({"names": [f for f, _, _ in DECODE_FIELDS],
                         "formats": [_NUMPY[kind] for _, _, kind in DECODE_FIELDS],
                         "offsets": DECODE_OFFSETS, "itemsize": DECODE_SIZE})


def config_fields() -> list[dict]:
    """The fields as the config template declares and checks them."""
    return [dict(name=name, ctype=ctype, offset=offset)
            for (name, ctype, _), offset in zip(DECODE_FIELDS, DECODE_OFFSETS)]


def new_decode_params() -> np.ndarray:
    """A zeroed host buffer of one ``Params``, 64-byte aligned in host memory like the device's
    (the launch copies it; the alignment keeps the maps' bytes where the struct puts them)."""
    raw = np.zeros(DECODE_SIZE + MAP_ALIGN, np.uint8)
    start = -raw.ctypes.data % MAP_ALIGN
    return raw[start:start + DECODE_SIZE].view(DECODE_DTYPE)[0:1]


def decode_params(address: int) -> np.void:
    """A copy of the ``Params`` at host ``address`` (what a launch argument points at), as a record
    of `DECODE_DTYPE`: for tests and tools that check what a launch would pass."""
    import ctypes

    raw = (ctypes.c_char * DECODE_SIZE).from_address(address)
    return np.frombuffer(raw, DECODE_DTYPE, count=1)[0].copy()
