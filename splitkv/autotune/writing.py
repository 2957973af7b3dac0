"""Writing tuned tables (the format: `splitkv.tuned.tables`).

`save` merges: it reads what is there, replaces the entries it has new figures for, keeps the rest,
and replaces the file atomically (a temporary file renamed over it) under a lock, so concurrent
writers lose nothing and a reader never sees half a file. It refuses (`TableError`) to overwrite a
file that cannot be read as a table, or one of another GPU or arch, and to write what the reader
would refuse. `dump` heads the file with the count and digest of its entries, by which the reader
knows a file cut short; `rewrite` writes a table again, in the current schema.
"""

from __future__ import annotations

import contextlib
import datetime
from pathlib import Path

import yaml

from ..arch import parse_arch
from ..tuned.tables import (HEADER_FIELDS, MAX_TABLE_BYTES, SCHEMA, Entry, Table, TableError, UnitCosts,
                             entries_digest, load, parse_text)


def make_header(gpu: str, arch: str, sm_count: int, cuda_runtime: str, nvrtc: str, splitkv: str,
                date: str | None = None) -> dict:
    """A table's header (see `splitkv.tuned.tables`): the GPU, arch and versions of the run."""
    return dict(schema=SCHEMA, gpu=gpu, arch=parse_arch(arch), sm_count=int(sm_count), cuda_runtime=str(cuda_runtime),
                nvrtc=str(nvrtc), splitkv=str(splitkv), date=date or today())


def today() -> str:
    """An entry's date: the ISO date of the run."""
    return datetime.date.today().isoformat()


def dump(table: Table) -> str:
    """The YAML text of ``table`` in the current schema, entries sorted: the same results give the
    same file. The count and digest of the entries lead the header (see `splitkv.tuned.tables`)."""
    entries = [e.to_dict() for e in sorted(table.entries, key=Entry.sort_key)]
    data = dict(schema=SCHEMA, entries_count=len(entries), entries_sha256=entries_digest(entries))
    data.update((name, table.header[name]) for name in HEADER_FIELDS if name != "schema")
    if table.unit_costs is not None:
        data["unit_costs"] = table.unit_costs.to_dict()
    data["entries"] = entries
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120)


def merge(old: Table | None, header: dict, entries, unit_costs: UnitCosts | None = None) -> Table:
    """``old``'s entries with ``entries`` in place of those of the same (key, bucket), under ``header``;
    ``unit_costs`` replaces old's when given."""
    merged = {(e.key, e.bucket.name): e for e in (old.entries if old else ())}
    merged.update({(e.key, e.bucket.name): e for e in entries})
    if unit_costs is None and old is not None:
        unit_costs = old.unit_costs
    return Table(header, tuple(sorted(merged.values(), key=Entry.sort_key)), unit_costs)


def save(path: Path, header: dict, entries, unit_costs: UnitCosts | None = None) -> Table:
    """Merge ``entries`` (and ``unit_costs``, when given) into the table at ``path`` (created with its
    folder if need be) and write it atomically; returns what was written. Refuses (TableError) to
    replace a file that is not a table of the same GPU and arch."""
    path = Path(path)
    arch = parse_arch(header["arch"])
    for e in entries:  # what load() would refuse must not reach the file
        if e.spec is not None and (e.spec.arch != arch or any(
                getattr(e.spec, name) != value for name, value in e.key.spec_fields().items())):
            raise TableError(f"{path}: entry {e.key.label} {e.bucket.name} holds {e.spec.name}, "
                             f"not a program of that key on {arch}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        old = load(path) if path.exists() else None
        if old is not None and (old.gpu, old.arch) != (header["gpu"], parse_arch(header["arch"])):
            raise TableError(f"{path}: holds {old.gpu} ({old.arch}), not {header['gpu']} ({header['arch']})")
        table = merge(old, header, entries, unit_costs)
        _write(path, table)
    return table


def rewrite(path: Path) -> Table:
    """The table at ``path`` written again as it is, in the current schema (a schema-1 table gains
    the count and digest of its entries). Every field is checked but the count and digest, so it
    also writes anew a table edited by hand; one refused as cut short must be looked at first,
    since what it lost is not written back."""
    path = Path(path)
    with _locked(path):
        table = load(path, check_entries=False)
        _write(path, table)
    return table


def _write(path: Path, table: Table) -> None:
    """``table``'s file at ``path``, atomically; TableError, and nothing written, where the reader
    would refuse it."""
    text = dump(table)
    data = text.encode()
    if len(data) > MAX_TABLE_BYTES:
        raise TableError(f"{path}: not written: {len(data)} bytes, over the {MAX_TABLE_BYTES} a table may hold")
    parse_text(text, f"{path} (not written)")
    from ..codegen.compile import atomic_write  # here: `splitkv-gen --help` imports this module, not codegen

    atomic_write(path, data)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on the hidden file ``.<name>.lock`` beside ``path`` (POSIX; elsewhere none)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
