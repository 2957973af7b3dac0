"""Which tuned entry the runtime uses, and from which table.

Tables are searched in this order, the first that holds entries for the key winning:

1. this GPU's own table (``<dir>/<arch>/<GPU_NAME>.yaml``), in ``SPLITKV_TUNED_CONFIG_DIR`` first
   (when set), then in the tables shipped with splitkv;
2. any other table of the same arch, in the same order of folders (files in name order);
3. none: the built-in heuristic (`splitkv.heuristics.default_spec`).

Within the table, the entry of the bucket nearest the plan's workload is used (`keys.nearest_bucket`).
Each table is read once per process. A table that cannot be read, or fails any check of
`splitkv.tuned.tables` (a field, its count and digest, its size), gives one warning (the file and
the reason) and is skipped: serving goes on with the next table or the heuristic. A table of an
older schema is used, with one warning that a cut one cannot be told. Which table a key uses is
logged once, at INFO, on the ``splitkv`` logger.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..arch import parse_arch
from ..heuristics import default_spec
from ..spec import KernelSpec
from . import tables
from .keys import TuneKey, gpu_file_stem, nearest_bucket

ENV_DIR = "SPLITKV_TUNED_CONFIG_DIR"
#: The GPU name of tables written from cost-model predictions (`splitkv-gen --tune --cost-model`):
#: never used as another GPU's table, since nothing in them was measured.
COST_MODEL_GPU = "cost model"
log = logging.getLogger("splitkv")
_lock = threading.Lock()
_warned: set = set()
_logged: set = set()


def shipped_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "tuned_configs"


def table_dirs() -> list[Path]:
    """The folders searched, the user's first."""
    user = os.environ.get(ENV_DIR)
    return ([Path(user)] if user else []) + [shipped_dir()]


def candidate_files(arch: str, gpu: str) -> list[tuple[Path, str]]:
    """(file, 'exact GPU' or 'same arch') in search order; only files that exist."""
    arch = parse_arch(arch)
    stem = f"{gpu_file_stem(gpu)}.yaml"
    exact = [d / arch / stem for d in table_dirs()]
    same_arch = [p for d in table_dirs() for p in sorted((d / arch).glob("*.yaml")) if p.name != stem and p.is_file()]
    return [(p, "exact GPU") for p in exact if p.is_file()] + [(p, "same arch") for p in same_arch]


@functools.lru_cache(maxsize=64)
def _read(path: Path, mtime_ns: int) -> tables.Table | None:
    try:
        return tables.load(path)
    except tables.TableError as e:
        _warn_once(str(path), f"splitkv: ignoring tuned table {e}; using the next table or the built-in choice")
    except Exception as e:  # noqa: BLE001 - whatever a file does, serving goes on without it
        _warn_once(str(path), f"splitkv: ignoring tuned table {path} ({type(e).__name__}: {e}); using the next "
                              f"table or the built-in choice")
    return None


def read_table(path: Path) -> tables.Table | None:
    """The table at ``path``, or None (warned once) when it cannot be used."""
    try:
        mtime = path.stat().st_mtime_ns
    except OSError as e:
        _warn_once(str(path), f"splitkv: ignoring tuned table {path}: {e.strerror or e}")
        return None
    table = _read(path, mtime)
    if table is not None and table.header["schema"] < tables.SCHEMA:
        _warn_once(str(path), f"splitkv: the tuned table {path} is of schema {table.header['schema']}, without the "
                              f"count and digest of its entries: a file cut short reads as a smaller table; "
                              f"splitkv.autotune.writing.rewrite writes it as schema {tables.SCHEMA}")
    return table


@dataclass(frozen=True)
class TunedChoices:
    """The entries of one key from one table (``source``: its path and why it was chosen)."""

    key: TuneKey
    entries: tuple
    source: str

    def entry_for(self, rows: int, max_len: int) -> tables.Entry | None:
        return nearest_bucket(self.entries, rows, max_len, bucket_of=lambda e: e.bucket)


def _usable_tables(arch: str, gpu: str):
    """(path, why, table) of the tables this GPU may use, in search order (see the module notes):
    readable, of ``arch``, and never a cost-model table of another GPU."""
    arch = parse_arch(arch)
    for path, why in candidate_files(arch, gpu):
        table = read_table(path)
        if table is not None and table.arch == arch and not (why == "same arch" and table.gpu == COST_MODEL_GPU):
            yield path, why, table


def find(arch: str, gpu: str, key: TuneKey) -> TunedChoices | None:
    """The first table (see the module notes) with entries for ``key``, or None."""
    arch = parse_arch(arch)
    for path, why, table in _usable_tables(arch, gpu):
        entries = table.for_key(key)
        if entries:
            source = f"{path} ({why}: {table.gpu})"
            _log_once((source, key), f"splitkv: {key.label} uses the tuned table {source}")
            return TunedChoices(key, tuple(entries), source)
    _log_once(("heuristic", arch, gpu, key),
              f"splitkv: no tuned table for {key.label} on {gpu} ({arch}); using the built-in choice")
    return None


def unit_costs(arch: str, gpu: str) -> tuple[tables.UnitCosts, str] | None:
    """The work-unit planner's costs for this GPU and where they come from: those of the first
    table, in the order of the module notes, that holds them (this GPU's, else another GPU's of
    the same arch, never a cost-model table of another GPU), with its path and why it was chosen;
    or None: the planner's built-in priors."""
    for path, why, table in _usable_tables(arch, gpu):
        if table.unit_costs is not None:
            source = f"{path} ({why}: {table.gpu}, {table.unit_costs.date})"
            _log_once(("unit costs", source), f"splitkv: the work-unit planner on {gpu} uses the costs of {source}")
            return table.unit_costs, source
    return None


@functools.lru_cache(maxsize=256)  # plan() asks on every call: the heuristic's specs take ~0.1 ms to build
def programs(spec: KernelSpec | None, arch: str, key: TuneKey) -> tuple[KernelSpec, KernelSpec, bool]:
    """(split program, dense program, dense only) for a tuned entry's spec (None: the built-in choice).

    A tuned split program serves every plan of its bucket the planner splits, and the built-in dense
    program the plans it does not; a tuned dense program makes dense the plans that fill the GPU
    in rows (`forces_dense`), where the tuner measured it against every split candidate, and serves
    those only (`programs_for`). The tuner measures each candidate planned this way, so what it
    measured is what the runtime runs."""
    fields = key.spec_fields()
    builtin_split, builtin_dense = (default_spec(arch, key.head_dim, key.group_size, key.q_dtype, key.kv_dtype,
                                                 variant, key.page_size, key.kv_layout, key.query_tokens)
                                    for variant in ("split", "dense"))
    if spec is None:
        return builtin_split, builtin_dense, False
    spec = spec.replace(arch=arch, **fields)
    if spec.variant == "dense":
        return builtin_split, spec, True
    return spec, builtin_dense, False


def programs_for(spec: KernelSpec | None, arch: str, key: TuneKey, rows: int,
                 num_sms: int) -> tuple[KernelSpec, KernelSpec, bool]:
    """`programs` for a plan of ``rows`` rows (sequences x K/V heads) on ``num_sms`` SMs: (split
    program, dense program, whether the plan must be dense). A tuned dense program serves only
    where it makes the plan dense (`forces_dense`), the regime its bucket measured; with fewer rows
    than SMs each of its CTAs streams alone on an SM, and the built-in dense program serves (H200,
    FP8 d128-g4: the 32 x 4k winner, 16-token tiles, 1.4% faster at 256 rows, took 54.6 µs at
    16 x 4k where the built-in dense program takes 47.7)."""
    split, dense, dense_only = programs(spec, arch, key)
    forced = forces_dense(dense_only, rows, num_sms)
    if dense_only and not forced:
        dense = programs(None, arch, key)[1]
    return split, dense, forced


def forces_dense(dense_only: bool, rows: int, num_sms: int) -> bool:
    """Whether a tuned dense program makes a plan dense: only where the rows (sequences x K/V heads)
    fill every SM, the regime of the buckets a dense program can win. Fewer rows than SMs leave
    the choice to the planner, which splits them (a bucket's nearest plans may lie far from it)."""
    return dense_only and rows >= num_sms


def _warn_once(token, message: str) -> None:
    with _lock:
        if token in _warned:
            return
        _warned.add(token)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _log_once(token, message: str) -> None:
    with _lock:
        if token in _logged:
            return
        _logged.add(token)
    log.info(message)


def forget() -> None:
    """Drop what was read, warned and logged (tests; after tables change on disk mid-process the
    mtime check already rereads them)."""
    _read.cache_clear()
    with _lock:
        _warned.clear()
        _logged.clear()
