"""Tuned tables: one YAML file per GPU model, ``<arch>/<GPU_NAME>.yaml``.

::

    schema: 2
    entries_count: 144          # the entries below: how many, and their SHA-256 (`entries_digest`)
    entries_sha256: 9c1e...
    gpu: NVIDIA H200
    arch: sm_90
    sm_count: 132
    cuda_runtime: "13.0"
    nvrtc: "13.0"
    splitkv: 0.1.0
    date: "2026-11-30"
    unit_costs:                 # optional: the work-unit planner's costs for this GPU
      costs: {unit_overhead: 64, merge_fixed: 128, merge_per_partial: 16, threshold: 0.03, max_ways: 8}
      tuned_us: 31.2            # geometric mean of the workloads' medians under these costs
      default_us: 31.9          # the same under the built-in costs, same run
      trials: 40
      date: "2026-11-30"
      workloads: ["1 x 6096", "3 x 4096", ...]
    entries:
    - key: {head_dim: 128, group_size: 4, q_dtype: bf16, kv_dtype: bf16, layout: contiguous}
      bucket: {name: b1-l32k, batch: 1, seq_len: 32768}
      spec: {variant: split, chunk_size: 128, warps: 4, tile_tokens: 32, stages: 2, ...}
      tuned_us: 37.9            # median, CUDA events, cold L2
      bandwidth_pct: 83.1       # of the copy bandwidth measured in the same run
      default_us: 38.2          # the built-in heuristic, same run
      trials: 40
      date: "2026-11-30"
      plan: "split: B=1, 16 x 2048 tokens ..."  # how the winner planned the bucket (optional)
      planner: short-rows       # the split-count rules it was measured under (absent: waves)
      exhaustive: {best_us: 37.8, points: 252, trials_to_within_3pct: 17}   # when it was run
    - key: {head_dim: 128, group_size: 4, q_dtype: bf16, kv_dtype: bf16, layout: contiguous, query_tokens: 4}
      ...                       # plans of 4 query tokens per sequence (absent: one)

``unit_costs`` (`UnitCosts`, from `splitkv-gen --tune --unit-costs`) holds the work-unit planner's
cost model measured on this GPU (`splitkv.work_units.CostModel`), which the runtime plans units
with; without it the planner's built-in priors serve. ``spec`` holds every KernelSpec field but the
arch and the key's own; ``spec: null`` says the built-in choice was measured best, and the runtime
keeps it. ``planner`` names the planner's split-count rules the entry was measured under
(`PLANNERS`): the runtime plans a tuned program by those rules, so it launches what was measured.
Entries are sorted by key and bucket, so a table written twice from the same results is the same
file.

Every field is checked when a table is read: its type (an int is neither a bool nor a string, a
name is a string), its range (µs figures finite and above 0, ``bandwidth_pct`` at most
`MAX_BANDWIDTH_PCT`, trials from 1, a bucket's batch and length within `keys.Bucket`'s limits and
what its name says), dates as ISO dates (quoted or not), a spec through KernelSpec's own checks.
An unknown field is refused, like a file over `MAX_TABLE_BYTES` (before it is parsed). A file that
fails a check raises `TableError` naming the file and the field; the runtime then warns once and
goes on without it (`splitkv.tuned.lookup`).

Schema 2 puts the count and digest of the entries at the head of the file, before all they cover:
a file cut at any line (a full disk, a copy stopped) lacks header fields, or ``entries``, or holds
fewer or other entries than the header says, and is refused. An entry edited by hand no longer
matches the digest either; `splitkv.autotune.writing.rewrite` writes such a table anew. Schema 1
tables (written before the check) carry neither field and are read without it; the runtime warns
that a cut one cannot be told from a whole one, and `rewrite` makes them schema 2. This module
reads tables (what the runtime needs); the tuner writes them (`splitkv.autotune.writing`: merged,
atomic, locked, and only what this module reads back).
"""


from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..arch import parse_arch
from ..spec import KernelSpec
from ..work_units import COST_FIELDS, CostModel
from .keys import Bucket, TuneKey, gpu_file_stem

SCHEMA = 2
#: The schemas this splitkv reads: 1 lacks the entries' count and digest (see the module notes).
READ_SCHEMAS = (1, 2)
HEADER_FIELDS = ("schema", "gpu", "arch", "sm_count", "cuda_runtime", "nvrtc", "splitkv", "date")
#: What a schema-2 header says of its entries, written right after ``schema`` (see the module notes).
CHECK_FIELDS = ("entries_count", "entries_sha256")
#: The largest table file read: 4 MiB, 60 times the shipped H200 table (69 kB, 144 entries), room
#: for every key and layout the tuner knows in many buckets. A file is parsed at the first
#: DecodeAttention() that looks its GPU up, about 0.3 s per MiB with libyaml and 2 s without: a
#: larger file is refused before it is parsed.
MAX_TABLE_BYTES = 4 << 20
#: The largest ``bandwidth_pct``: the copy bandwidth counts bytes read and written, and a decode,
#: which only reads, can beat it by a little (101.6% in the shipped H200 table); half again the
#: copy rate means the bytes were not read from DRAM or the time is wrong.
MAX_BANDWIDTH_PCT = 150.0
#: The planner's split-count rules an entry can have been measured under: "waves" (the wave model
#: alone, every entry tuned before the short-row rule), "short-rows" (`plan.plan_splits` with the
#: short-row rule, what the tuner measures now: `CURRENT_PLANNER`).
PLANNERS = ("waves", "short-rows")
CURRENT_PLANNER = "short-rows"
ENTRY_FIELDS = ("key", "bucket", "spec", "tuned_us", "bandwidth_pct", "default_us", "trials", "date", "exhaustive",
                "plan", "default_plan", "planner")
#: The fields every entry holds (`Entry.to_dict` writes them all).
REQUIRED_ENTRY_FIELDS = ("key", "bucket", "spec", "tuned_us", "default_us", "trials", "date")
#: What an entry's ``exhaustive`` record may hold (`splitkv.autotune.confirm.compare_with_exhaustive`):
#: counts, and µs figures; any of them null.
EXHAUSTIVE_COUNTS = ("points", "failed", "trials_to_within_3pct")
EXHAUSTIVE_FIGURES = ("best_us", "tuned_spec_us", "builtin_spec_us")
#: KernelSpec fields an entry's spec leaves out: the table's arch, and the key's fields.
_KEY_SPEC_FIELDS = ("arch", "head_dim", "group_size", "q_dtype", "kv_dtype", "page_size", "kv_layout", "query_tokens")
#: Fields of programs KernelSpec no longer has, which tables written before they went hold with
#: their off value in every spec: at that value they are skipped (the spec names the same program);
#: any other value names a program that cannot be built, and the table is refused.
_RETIRED_SPEC_FIELDS = {"steal_tiles": 0, "span_rows": False}
#: libyaml's parser where PyYAML has it (several times faster), else PyYAML's own: the same values.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class TableError(ValueError):
    """A tuned table that cannot be used: the file and the reason."""


@dataclass(frozen=True)
class Entry:
    """The tuned choice of one (key, bucket) on one GPU model, with the figures behind it."""

    key: TuneKey
    bucket: Bucket
    spec: KernelSpec | None  # None: the built-in choice was best
    tuned_us: float
    default_us: float
    bandwidth_pct: float | None = None
    trials: int = 0
    date: str = ""
    exhaustive: dict | None = None
    plan: str | None = None  # how the winner planned the bucket's shape (`DecodeAttention.plan_info`)
    # What the built-in choice launched on the bucket, for a tuned entry (`Objective.runs`: the
    # plan, programs named, on a GPU; the program's name for the cost model): a winner must launch
    # something else (the same plan would be the built-in choice measured twice).
    default_plan: str | None = None
    # The split-count rules the entry was measured under (see PLANNERS).
    planner: str = "waves"

    def __post_init__(self):
        if self.planner not in PLANNERS:
            raise ValueError(f"planner: expected one of {list(PLANNERS)}, got {self.planner!r}")

    @property
    def speedup(self) -> float:
        return self.default_us / self.tuned_us if self.tuned_us > 0 else float("nan")

    def sort_key(self) -> tuple:
        return (self.key, self.bucket.rows, self.bucket.seq_len, self.bucket.name)

    def to_dict(self) -> dict:
        spec = None
        if self.spec is not None:
            spec = {k: v for k, v in self.spec.to_dict().items() if k not in _KEY_SPEC_FIELDS}
        out = dict(key=self.key.to_dict(),
                   bucket=self.bucket.to_dict(),
                   spec=spec, tuned_us=_round(self.tuned_us), bandwidth_pct=_round(self.bandwidth_pct),
                   default_us=_round(self.default_us), trials=int(self.trials), date=self.date)
        if self.exhaustive:
            out["exhaustive"] = dict(self.exhaustive)
        if self.plan:
            out["plan"] = self.plan
        if self.default_plan:
            out["default_plan"] = self.default_plan
        if self.planner != "waves":
            out["planner"] = self.planner
        return out

    @classmethod
    def from_dict(cls, data: dict, arch: str) -> "Entry":
        """An entry as a table holds it, every field checked (see the module notes)."""
        if not isinstance(data, dict):
            raise ValueError(f"an entry must be a mapping, got {type(data).__name__}")
        unknown = set(data) - set(ENTRY_FIELDS)
        if unknown:
            raise ValueError(f"unknown entry fields {sorted(unknown)}")
        missing = set(REQUIRED_ENTRY_FIELDS) - set(data)
        if missing:
            raise ValueError(f"entry lacks {sorted(missing)}")
        key = TuneKey.from_dict(_mapping(data["key"], "key"))
        bucket = Bucket.from_dict(_mapping(data["bucket"], "bucket"))
        spec = None
        if data["spec"] is not None:
            fields = _mapping(data["spec"], "spec")
            clash = set(fields) & set(_KEY_SPEC_FIELDS)
            if clash:
                raise ValueError(f"spec repeats the key's fields {sorted(clash)}")
            spec = KernelSpec.from_dict({**_without_retired_fields(fields), "arch": arch, **key.spec_fields()})
        return cls(key, bucket, spec, _figure(data["tuned_us"], "tuned_us"), _figure(data["default_us"], "default_us"),
                   _optional(data, "bandwidth_pct", lambda v, name: _figure(v, name, MAX_BANDWIDTH_PCT)),
                   _count(data["trials"], "trials", least=1), _date(data["date"], "date"),
                   _optional(data, "exhaustive", _exhaustive), _optional(data, "plan", _text),
                   _optional(data, "default_plan", _text), _optional(data, "planner", _text) or "waves")


@dataclass(frozen=True)
class UnitCosts:
    """The work-unit planner's costs measured for a GPU, with the figures that chose them: the
    geometric mean of the workloads' median µs under ``costs`` and under the built-in costs, in the
    same run (``costs`` equal to the built-in ones when no candidate beat them)."""

    costs: CostModel
    tuned_us: float
    default_us: float
    trials: int
    date: str
    workloads: tuple

    def to_dict(self) -> dict:
        return dict(costs=self.costs.as_dict(), tuned_us=_round(self.tuned_us), default_us=_round(self.default_us),
                    trials=self.trials, date=self.date, workloads=list(self.workloads))

    @classmethod
    def from_dict(cls, data) -> "UnitCosts":
        data = _mapping(data, "unit_costs")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unit_costs: unknown fields {sorted(unknown)}")
        missing = names - set(data)  # `to_dict` writes them all
        if missing:
            raise ValueError(f"unit_costs: lacks {sorted(missing)}")
        costs = _mapping(data.get("costs"), "unit_costs.costs")
        if set(costs) != set(COST_FIELDS):
            raise ValueError(f"unit_costs.costs: expected the fields {list(COST_FIELDS)}, got {sorted(costs)}")
        try:
            model = CostModel(**costs)  # validates each value
        except (TypeError, ValueError) as e:
            raise ValueError(f"unit_costs.costs: {e}") from None
        workloads = data["workloads"]
        if not isinstance(workloads, list):
            raise ValueError(f"unit_costs.workloads: expected a list of workload names, got {workloads!r}")
        return cls(model, _figure(data["tuned_us"], "unit_costs.tuned_us"),
                   _figure(data["default_us"], "unit_costs.default_us"),
                   _count(data["trials"], "unit_costs.trials", least=1), _date(data["date"], "unit_costs.date"),
                   tuple(_text(w, "unit_costs.workloads") for w in workloads))


@dataclass(frozen=True)
class Table:
    """A header (see the module notes), entries and, optionally, the work-unit planner's costs."""

    header: dict
    entries: tuple
    unit_costs: UnitCosts | None = None

    @property
    def arch(self) -> str:
        return self.header["arch"]

    @property
    def gpu(self) -> str:
        return self.header["gpu"]

    def for_key(self, key: TuneKey) -> list:
        return [e for e in self.entries if e.key == key]


def table_path(directory: Path, arch: str, gpu: str) -> Path:
    """``directory/<arch>/<GPU_NAME>.yaml``."""
    return Path(directory) / parse_arch(arch) / f"{gpu_file_stem(gpu)}.yaml"


def load(path: Path, check_entries: bool = True) -> Table:
    """Read and check a table (raises `TableError` with the file and the reason). ``check_entries``
    False skips the schema-2 count and digest of the entries (`splitkv.autotune.writing.rewrite`)."""
    path = Path(path)
    return parse_text(_read_text(path), path, check_entries)


def parse_text(text: str, source, check_entries: bool = True) -> Table:
    """The table a file's ``text`` holds (`TableError` names ``source``, the file, and the reason)."""
    try:
        data = yaml.load(text, Loader=_YAML_LOADER)
    except (yaml.YAMLError, ValueError, TypeError, RecursionError) as e:  # ValueError: an unquoted 2026-13-01
        raise TableError(f"{source}: not valid YAML ({e})") from None
    try:
        return parse(data, check_entries)
    except (ValueError, TypeError, KeyError) as e:
        raise TableError(f"{source}: {e}") from None


def parse(data, check_entries: bool = True) -> Table:
    """The table of YAML's ``data``, every field checked (see the module notes; ValueError)."""
    if not isinstance(data, dict):
        raise ValueError("a table must be a mapping with a header and 'entries'")
    schema = data.get("schema")
    if type(schema) is not int or schema not in READ_SCHEMAS:
        raise ValueError(f"schema {schema!r}; this splitkv reads schemas {list(READ_SCHEMAS)}")
    checks = CHECK_FIELDS if schema >= 2 else ()
    missing = (set(HEADER_FIELDS) | set(checks)) - set(data)
    if missing:
        raise ValueError(f"header lacks {sorted(missing)}")
    unknown = set(data) - set(HEADER_FIELDS) - set(checks) - {"entries", "unit_costs"}
    if unknown:
        raise ValueError(f"unknown header fields {sorted(unknown)}")
    header = _header(data)
    if "entries" not in data:
        raise ValueError("no 'entries' (a table lists them, '[]' when it holds none)")
    entries = data["entries"]
    if not isinstance(entries, list):
        raise ValueError(f"'entries' must be a list, got {entries!r}")
    if checks and check_entries:  # the count before the entries: a cut between entries says so
        count = _count(data["entries_count"], "entries_count")
        if len(entries) != count:
            raise ValueError(f"lists {len(entries)} entries where its header counts {count}: the file was cut "
                             f"short, or changed since it was written")
    parsed = []
    for i, item in enumerate(entries):
        try:
            parsed.append(Entry.from_dict(item, header["arch"]))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"entry {i}: {e}") from None
    if checks and check_entries and data["entries_sha256"] != entries_digest(entries):  # after the checks,
        # which bound what the entries can hold (YAML aliases could make a small file a vast JSON text)
        raise ValueError("the entries do not match the header's entries_sha256: the file was cut short, or "
                         "changed since it was written (splitkv.autotune.writing.rewrite writes a table edited "
                         "by hand anew)")
    seen = set()
    for e in parsed:
        if (e.key, e.bucket.name) in seen:
            raise ValueError(f"two entries for {e.key.label} {e.bucket.name}")
        seen.add((e.key, e.bucket.name))
    unit_costs = None if data.get("unit_costs") is None else UnitCosts.from_dict(data["unit_costs"])
    return Table(header, tuple(sorted(parsed, key=Entry.sort_key)), unit_costs)


def entries_digest(entries: list) -> str:
    """The SHA-256 (hex) of a table's entries as canonical JSON (sorted keys, no spaces): the same
    for `Entry.to_dict`'s values as for what YAML reads back from their file."""
    text = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _read_text(path: Path) -> str:
    """The file's text, refused (TableError) over MAX_TABLE_BYTES before any of it is parsed; a
    file that grows while it is read cannot pass the bound either: at most one byte more is read."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(MAX_TABLE_BYTES + 1) if size <= MAX_TABLE_BYTES else b""
    except OSError as e:
        raise TableError(f"{path}: cannot be read ({e.strerror or e})") from None
    if max(size, len(raw)) > MAX_TABLE_BYTES:
        raise TableError(f"{path}: {max(size, len(raw))} bytes or more, over the {MAX_TABLE_BYTES} a table may "
                         f"hold (MAX_TABLE_BYTES); not read")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TableError(f"{path}: not UTF-8 text ({e})") from None


def _header(data: dict) -> dict:
    """The header fields, checked; the arch normalised ('sm_90') and the date as its ISO text."""
    header = {k: data[k] for k in HEADER_FIELDS}
    header["arch"] = parse_arch(_text(header["arch"], "arch"))
    for name in ("gpu", "cuda_runtime", "nvrtc", "splitkv"):
        _text(header[name], name)
    _count(header["sm_count"], "sm_count", least=1)
    header["date"] = _date(header["date"], "date")
    return header


def _without_retired_fields(fields: dict) -> dict:
    """An entry's spec fields without the `_RETIRED_SPEC_FIELDS` (ValueError for one that is not off)."""
    for name, off in _RETIRED_SPEC_FIELDS.items():
        if name in fields and (type(fields[name]) is not type(off) or fields[name] != off):
            raise ValueError(f"spec: {name}={fields[name]!r} chooses a program splitkv no longer builds "
                             f"(only {name}: {off!r} is still read)")
    return {k: v for k, v in fields.items() if k not in _RETIRED_SPEC_FIELDS}


def _mapping(value, name):
    if not isinstance(value, dict):
        raise ValueError(f"'{name}' must be a mapping, got {value!r}")
    return value


def _optional(data: dict, name: str, check):
    """``check(value, name)`` of a field that may be absent or null (None)."""
    return None if data.get(name) is None else check(data[name], name)


def _count(value, name: str, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
    return value


def _figure(value, name: str, most: float = math.inf) -> float:
    """A measured figure: a finite number above 0, and at most ``most``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= most:
        bound = "" if most == math.inf else f" and at most {most:g}"
        raise ValueError(f"{name}: expected a finite number above 0{bound}, got {value!r}")
    return float(value)


def _text(value, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
    return value


_DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _date(value, name: str) -> str:
    """An ISO date's text ('2026-12-02'); YAML reads an unquoted one as a date."""
    if type(value) is datetime.date:
        return value.isoformat()
    if isinstance(value, str) and _DATE_RE.fullmatch(value):
        try:
            datetime.date.fromisoformat(value)
            return value
        except ValueError:
            pass
    raise ValueError(f"{name}: expected a date 'YYYY-MM-DD', got {value!r}")


def _exhaustive(value, name: str) -> dict:
    """An entry's exhaustive record (EXHAUSTIVE_COUNTS and EXHAUSTIVE_FIGURES, each optional or null)."""
    record = _mapping(value, name)
    unknown = set(record) - set(EXHAUSTIVE_COUNTS) - set(EXHAUSTIVE_FIGURES)
    if unknown:
        raise ValueError(f"{name}: unknown fields {sorted(unknown)}")
    for field, figure in record.items():
        if figure is not None:
            (_count if field in EXHAUSTIVE_COUNTS else _figure)(figure, f"{name}.{field}")
    return dict(record)


def _round(x):
    return None if x is None else round(float(x), 3)
