"""Paged K/V caches: their layouts, the checks of a block table, and the gather the reference reads.

A paged cache holds K (and V) in pages of ``page_size`` tokens, ``[num_pages, page_size, Hkv, D]``
("NHD") or ``[num_pages, Hkv, page_size, D]`` ("HND"), as vLLM- and SGLang-style engines keep them.
Token t of sequence b lies on page ``block_table[b, t // page_size]``, at row ``t % page_size``;
pages may come in any order, and a sequence's last page may be partly filled. Entries of a row past
the pages its length needs are never read. The contiguous layout ``[B, L, Hkv, D]`` is the special
case of one page of L tokens per sequence.

Host-side and NumPy only; the decode programs read pages through the block table on the device
(``KernelSpec.page_size``).
"""

from __future__ import annotations

import numpy as np

from .choices import KV_LAYOUTS as PAGED_LAYOUTS
from .choices import PAGE_SIZES
from .plan import _check_lens, _positive_int


def check_layout(layout: str, name: str = "layout") -> str:
    if layout not in PAGED_LAYOUTS:
        raise ValueError(f"{name}: expected one of {list(PAGED_LAYOUTS)}, got {layout!r}")
    return layout


def cache_geometry(shape, layout: str, name: str = "k_cache") -> tuple[int, int, int, int]:
    """(num_pages, page_size, num_kv_heads, head_dim) of a paged cache ``name`` of (logical)
    ``shape`` in ``layout``; ValueError for a rank other than 4 or a page size that is no power of
    two up to 256."""
    check_layout(layout, "kv_layout")
    shape = tuple(int(n) for n in shape)
    if len(shape) != 4:
        raise ValueError(f"{name}: expected 4 dimensions [num_pages, page_size, num_kv_heads, head_dim] "
                         f"(NHD) or [num_pages, num_kv_heads, page_size, head_dim] (HND), got shape {shape}")
    num_pages, a, b, head_dim = shape
    page_size, num_kv_heads = (a, b) if layout == "NHD" else (b, a)
    if page_size not in PAGE_SIZES:
        raise ValueError(f"{name}: page size {page_size} (from shape {shape}, layout {layout}) is not a power "
                         f"of two from 1 to {PAGE_SIZES[-1]}")
    return num_pages, page_size, num_kv_heads, head_dim


def pages_needed(seq_lens, page_size: int) -> np.ndarray:
    """Pages each sequence's tokens occupy (0 for an empty sequence)."""
    lens = _check_lens(seq_lens).astype(np.int64)
    page_size = _positive_int("page_size", page_size)
    return -(-lens // page_size)


def check_block_table(block_table, seq_lens, *, num_pages: int, page_size: int) -> np.ndarray:
    """Checks a host block table against the lengths and the cache; returns it as int32.

    ``block_table``: integers ``[B, max_pages_per_seq]``. Raises ValueError naming the first
    sequence (and entry) at fault when a sequence needs more pages than its row holds, or an entry
    it reads lies outside ``0 .. num_pages - 1``. Entries past what a length needs are not read,
    so they are not checked (engines leave them stale)."""
    num_pages = _positive_int("num_pages", num_pages)
    table, highest = used_pages(block_table, seq_lens, page_size)
    check_pages_exist(highest, num_pages)
    return table


def used_pages(block_table, seq_lens, page_size: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The checks of `check_block_table` that need no cache: the table as int32, and where its
    highest entry that the lengths read lies, as (page, sequence, entry) ((-1, -1, -1) when none
    is read), for `check_pages_exist` once the cache is known. ValueError for a row too short for
    its length or a negative entry it reads; TypeError for entries that are no integers."""
    lens = _check_lens(seq_lens).astype(np.int64)
    table = np.asarray(block_table)
    if table.ndim != 2 or table.shape[0] != lens.size:
        raise ValueError(f"block_table: expected shape [{lens.size}, max_pages_per_seq] (one row per sequence), "
                         f"got {table.shape}")
    if table.size and not np.issubdtype(table.dtype, np.integer):
        raise TypeError(f"block_table: expected integers, got {table.dtype}")
    needed = pages_needed(lens, page_size)
    short = np.flatnonzero(needed > table.shape[1])
    if short.size:
        b = int(short[0])
        raise ValueError(f"block_table: sequence {b} of {int(lens[b])} tokens needs {int(needed[b])} pages of "
                         f"{page_size}, but the table holds {table.shape[1]} per sequence")
    used = np.arange(table.shape[1])[None, :] < needed[:, None]
    negative = used & (table < 0)
    if negative.any():
        b, i = (int(x) for x in np.argwhere(negative)[0])
        raise ValueError(f"block_table: sequence {b}'s page {i} is {int(table[b, i])}, not a page index")
    highest = (-1, -1, -1)
    if used.any():
        masked = np.where(used, table, -1)
        b, i = np.unravel_index(int(np.argmax(masked)), masked.shape)
        highest = (int(masked[b, i]), int(b), int(i))
        if highest[0] > np.iinfo(np.int32).max:
            raise ValueError(f"block_table: sequence {b}'s page {i} is {highest[0]}, past the int32 page indices")
    return np.ascontiguousarray(table, dtype=np.int32), highest


def check_pages_exist(highest: tuple[int, int, int], num_pages: int) -> None:
    """ValueError when the highest page a table reads (from `used_pages`) is not in a cache of
    ``num_pages`` pages, naming the sequence and entry."""
    page, b, i = highest
    if page >= num_pages:
        raise ValueError(f"block_table: sequence {b}'s page {i} is {page}, outside the cache's {num_pages} pages")


def gather_pages(cache, block_table, seq_lens, layout: str, max_len: int | None = None) -> np.ndarray:
    """The contiguous ``[B, max_len, Hkv, D]`` view of a paged cache (a NumPy copy; zeros past each
    length), for references and tests. ``max_len`` defaults to the longest length."""
    cache = np.asarray(cache)
    num_pages, page_size, num_kv_heads, head_dim = cache_geometry(cache.shape, layout)
    lens = _check_lens(seq_lens).astype(np.int64)
    table = check_block_table(block_table, lens, num_pages=num_pages, page_size=page_size)
    max_len = int(lens.max(initial=0)) if max_len is None else int(max_len)
    if lens.size and int(lens.max()) > max_len:
        raise ValueError(f"max_len: {max_len} is shorter than the longest sequence ({int(lens.max())})")
    pages = cache if layout == "NHD" else cache.transpose(0, 2, 1, 3)  # [num_pages, page_size, Hkv, D]
    out = np.zeros((lens.size, max_len, num_kv_heads, head_dim), dtype=cache.dtype)
    for b, length in enumerate(lens.tolist()):
        tokens = np.arange(length)
        out[b, :length] = pages[table[b, tokens // page_size], tokens % page_size]
    return out


def paginate(kv, page_size: int, layout: str, *, order=None, spare_pages: int = 0):
    """A contiguous ``[B, L, Hkv, D]`` cache laid out as pages: ``(pages in layout, block_table
    [B, ceil(L / page_size)])``. ``order`` (a permutation of the ``B x ceil(L / page_size) +
    spare_pages`` pages; None: in order) says where logical page i goes, so that K and V laid out
    with one order share one block table; the spare pages stay unused. For tests and benchmarks;
    the tail of each sequence's last page past L holds zeros."""
    kv = np.asarray(kv)
    check_layout(layout)
    page_size = _positive_int("page_size", page_size)
    batch, length, num_kv_heads, head_dim = kv.shape
    per_seq = -(-length // page_size)
    total = batch * per_seq + spare_pages
    order = np.arange(total) if order is None else np.asarray(order)
    if sorted(order.tolist()) != list(range(total)):
        raise ValueError(f"order: expected a permutation of the {total} pages")
    padded = np.zeros((batch, per_seq * page_size, num_kv_heads, head_dim), dtype=kv.dtype)
    padded[:, :length] = kv
    pages = np.zeros((total, page_size, num_kv_heads, head_dim), dtype=kv.dtype)
    pages[order[: batch * per_seq]] = padded.reshape(batch * per_seq, page_size, num_kv_heads, head_dim)
    table = order[: batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    if layout == "HND":
        pages = np.ascontiguousarray(pages.transpose(0, 2, 1, 3))
    return pages, table
