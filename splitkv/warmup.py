"""The programs a head layout's plans may launch, over ranges of batch and length: compiled ahead, so
that no plan() compiles while serving.

plan() compiles (or loads from the cache) what its batch needs: the dense program, its warp-per-K/V-
head layout, the split program in each cluster size the planner tries (it asks the GPU how many
clusters of a size are resident, which needs that program), the units program, and the two merge
programs; and with a tuned table, those of the entry nearest the workload. `programs_to_warm` lists
all of them for every tuned entry some (rows, length) in the ranges is nearest to. It is pure (no
GPU), so `splitkv-gen --warm` fills a cache folder for a fleet on a machine without one;
`DecodeAttention.warmup` compiles the same list on a thread pool and loads it on the instance's GPU.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .spec import KernelSpec, MergeSpec
from .tuned import lookup
from .tuned.keys import TuneKey

#: Points per axis of the (rows, length) grid whose nearest tuned entries are warmed: buckets are
#: compared in log space (`Bucket.distance`), so a geometric grid of this many points meets every
#: entry nearest to some workload of the range whose region is wider than a 5% step.
GRID_POINTS = 96


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What a warm-up did: ``programs`` listed, ``compiled`` of them by NVRTC in this process (by
    this warm-up, or earlier by a plan or warm-up of it; the rest were read from the disk cache), in
    ``seconds``, for ``tuned_entries`` tuned entries of the range."""

    programs: int
    compiled: int
    seconds: float
    tuned_entries: int

    def __str__(self) -> str:
        return (f"{self.programs} programs ({self.compiled} compiled in this process, {self.programs - self.compiled} "
                f"read from the disk cache) for {self.tuned_entries} tuned entries in {self.seconds:.1f} s")


def check_ranges(max_batch, max_len) -> tuple[int, int]:
    for name, value, low in (("max_batch", max_batch, 1), ("max_len", max_len, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name}: expected an int of at least {low}, got {value!r}")
    if max_len > 2**31 - 1:
        raise ValueError(f"max_len: at most {2**31 - 1} tokens (the programs index tokens with int32), got {max_len}")
    return int(max_batch), int(max_len)


def tuned_entries_in_range(choices, num_kv_heads: int, max_batch: int, max_len: int) -> list:
    """The tuned entries of ``choices`` (`lookup.TunedChoices`) nearest to some workload of 1..max_batch
    sequences of 1..max_len tokens, in table order."""
    rows = np.unique(np.geomspace(num_kv_heads, max_batch * num_kv_heads, GRID_POINTS).round().astype(int))
    lengths = np.unique(np.geomspace(1, max_len, GRID_POINTS).round().astype(int))
    reached = {id(choices.entry_for(int(r), int(n))) for r in rows for n in lengths}
    return [entry for entry in choices.entries if id(entry) in reached]


def split_and_dense(split: KernelSpec, dense: KernelSpec) -> list[KernelSpec]:
    """The programs plans derive from one split and one dense program: the split program in every
    cluster size up to its own, its units program, the dense program and its warp-per-head layout."""
    specs = [split.replace(cluster=c) for c in range(1, split.cluster + 1)]
    specs.append(split.as_units())
    specs.append(dense)
    try:
        specs.append(dense.as_warp_heads())
    except ValueError:  # a layout this program has not (one warp): plans never pack its heads
        pass
    return specs


def programs_to_warm(arch: str, gpu_name: str | None, key: TuneKey, num_kv_heads: int, max_batch: int,
                     max_len: int, *, tuned: bool = True) -> tuple[list, int]:
    """(every program plans of this layout may launch for 1..max_batch sequences of 1..max_len
    tokens, the tuned entries they come from), without duplicates. ``gpu_name`` (the driver's, e.g.
    'NVIDIA H200') picks the tuned table as `DecodeAttention` does; ``tuned=False`` or no name: the
    built-in choice alone, as for `DecodeAttention(tuned=False)`."""
    max_batch, max_len = check_ranges(max_batch, max_len)
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, (int, np.integer)) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads: expected a positive int, got {num_kv_heads!r}")
    choices = lookup.find(arch, gpu_name, key) if tuned and gpu_name else None
    entries = tuned_entries_in_range(choices, num_kv_heads, max_batch, max_len) if choices else []
    pairs = [lookup.programs(None, arch, key)[:2]]  # the built-in choice serves where no entry does
    for entry in entries:
        split, dense, dense_only = lookup.programs(entry.spec, arch, key)
        pairs.append((split, dense))
        if dense_only:  # a tuned dense program serves full waves only, the built-in one the rest
            pairs.append((split, lookup.programs(None, arch, key)[1]))
    specs = [spec for split, dense in pairs for spec in split_and_dense(split, dense)]
    specs += merge_programs(arch, key)
    return list(dict.fromkeys(specs)), len(entries)


def programs_of_specs(split: KernelSpec, dense: KernelSpec, key: TuneKey) -> list:
    """`programs_to_warm` of an instance built with its own ``spec`` / ``dense_spec``."""
    return list(dict.fromkeys(split_and_dense(split, dense) + merge_programs(split.arch, key)))


def merge_programs(arch: str, key: TuneKey) -> list[MergeSpec]:
    """The split rows' merge program and the work units' (as the runtime builds them)."""
    from .launch import MERGE_THREADS

    merge = MergeSpec(arch=arch, head_dim=key.head_dim, out_dtype=key.q_dtype, threads=MERGE_THREADS)
    return [merge, dataclasses.replace(merge, tables=True)]


def compile_all(specs, *, jobs: int | None = None, load=None) -> tuple[int, float]:
    """Compiles ``specs`` on ``jobs`` threads (None: one per CPU; NVRTC runs outside the GIL) into
    the memory and disk caches, then ``load(spec)`` each in order when given (loading needs the GPU,
    and one thread). Returns (programs compiled by NVRTC in this process, seconds)."""
    from .codegen.compile import compile_cubin

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(compile_cubin, specs))
    if load is not None:
        for spec in specs:
            load(spec)
    return sum(not r.cached for r in results), time.perf_counter() - start
