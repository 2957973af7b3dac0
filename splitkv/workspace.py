"""The device memory a `DecodeAttention`'s plans share: the workspace buffers (partials, counters,
lengths, tables), reused by later plans while they fit, and the block-table checks before a plan
writes any of them.
"""

from __future__ import annotations

import numpy as np

from . import arrays, paged, tensors
from .launch import BlockTable
from .spec import KernelSpec
from .streams import StreamOrder


class Workspace:
    """Named device buffers that only grow. ``order`` is the instance's `StreamOrder`: before a
    buffer is replaced, the host waits for the work that may still use it."""

    def __init__(self, order: StreamOrder):
        self._buffers: dict[str, object] = {}
        self._order = order

    def buffer(self, name: str, size: int, dtype, zero: bool = False):
        """A workspace array of at least ``size`` elements, reused across plans while it fits."""
        import cupy

        held = self._buffers.get(name)
        fresh = held is None or held.size < size
        if fresh:
            if held is not None:
                # The block returns to the pool of the stream it was allocated on, which may hand it
                # out at once; runs on other streams may still use it. A rare sync: buffers only grow.
                self._order.synchronize()
            held = cupy.zeros(max(size, 1), dtype=dtype)
            self._buffers[name] = held
        view = held if held.size == size else held[:size]  # slicing a CuPy array costs host time
        if zero and not fresh:  # a fresh buffer is zeros already
            view.fill(0)
        return view

    def lengths(self, seq_lens, on_device: bool, lens: np.ndarray):
        """The lengths the programs read: the caller's device array (``on_device``; lengths it
        rewrites in place reach graph replays), or the plan's copy of host lengths."""
        if on_device:
            return arrays.to_cupy(seq_lens)
        device_lens = self.buffer("seq_lens", lens.size, np.int32)
        device_lens.set(lens)
        return device_lens

    def block_table(self, checked: tuple) -> BlockTable:
        """A checked table (`check_table`) on the device: a device table in place, a host one copied
        to the plan's buffer."""
        device_table, host, stride, highest = checked
        if device_table is None:
            device_table = self.buffer("block_table", host.size, np.int32)
            device_table.set(host.ravel())
        return BlockTable(device_table, device_table.data.ptr, stride, highest)

    def empty_kv_ptr(self, spec: KernelSpec, num_kv_heads: int, max_planned: int) -> int:
        """Where the tensor maps of a plan of no tokens point (0: not needed). k.shape[1] may then be 0,
        and a tensor map cannot describe no rows: such maps describe this tile instead, which no CTA
        reads (every length is 0, so no tile is requested)."""
        if spec.kv_copy != "tma" or max_planned:
            return 0
        tile_bytes = spec.tile_tokens * num_kv_heads * spec.kv_row_bytes
        return self.buffer("empty_kv", tile_bytes, np.uint8).data.ptr


def check_table(block_table, lens: np.ndarray, host_lens: np.ndarray, validate: bool, page_size: int,
                device: int) -> tuple:
    """A plan's block table (see `DecodeAttention.plan`), checked and not yet written anywhere:
    (device table or None, host table or None, stride, highest page used). Its entries are checked
    against the lengths ``lens`` (pages a length does not use yet are not); its width against the
    longest length the plan covers (``host_lens``: lengths may grow up to max_len)."""
    host = device_table = None
    if tensors.is_device_array(block_table):
        info = tensors.describe(block_table, "block_table")
        tensors.check_block_table_info(info, lens.size)
        tensors.check_device("block_table", info, device, "this DecodeAttention runs on")
        device_table, stride = arrays.to_cupy(block_table), info.shape[1]
        if validate:
            host = device_table.get()  # like device lengths, read back once here
    else:
        host = np.asarray(block_table)
        stride = host.shape[1] if host.ndim == 2 else 0
    highest = (-1, -1, -1)
    if host is not None:
        host, highest = paged.used_pages(host, lens, page_size)
    if int(host_lens.max(initial=0)) > stride * page_size:
        raise ValueError(f"block_table: holds {stride} pages of {page_size} tokens per sequence, "
                         f"but the plan covers a sequence of {int(host_lens.max())}")
    return device_table, None if device_table is not None else host, stride, highest
