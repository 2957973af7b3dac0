"""Tuned tables: one YAML file per GPU model, ``<arch>/<GPU_NAME>.yaml``.

::

    schema: 1
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

``unit_costs`` (`UnitCosts`, from `splitkv-gen --tune --unit-costs`) holds the work-unit planner's
cost model measured on this GPU (`splitkv.work_units.CostModel`), which the runtime plans units
with; without it the planner's built-in priors serve. ``spec`` holds every KernelSpec field but the
arch and the key's own; ``spec: null`` says the built-in choice was measured best, and the runtime
keeps it. ``planner`` names the planner's split-count rules the entry was measured under
(`PLANNERS`): the runtime plans a tuned program by those rules, so it launches what was measured.
Entries are sorted by key and bucket, so a table written twice from the same results is the same
file. A file that cannot be read as a table raises `TableError` naming the file and what is wrong
with it. This module reads tables (what the runtime needs); the tuner writes them
(`splitkv.autotune.writing`: merged, atomic, locked).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..spec import KernelSpec, parse_arch
from ..work_units import COST_FIELDS, CostModel
from .keys import Bucket, TuneKey, gpu_file_stem

SCHEMA = 1
HEADER_FIELDS = ("schema", "gpu", "arch", "sm_count", "cuda_runtime", "nvrtc", "splitkv", "date")
#: The planner's split-count rules an entry can have been measured under: "waves" (the wave model
#: alone, every entry tuned before the short-row rule), "short-rows" (`plan.plan_splits` with the
#: short-row rule, what the tuner measures now: `CURRENT_PLANNER`).
PLANNERS = ("waves", "short-rows")
CURRENT_PLANNER = "short-rows"
ENTRY_FIELDS = ("key", "bucket", "spec", "tuned_us", "bandwidth_pct", "default_us", "trials", "date", "exhaustive",
                "plan", "default_plan", "planner")
#: KernelSpec fields an entry's spec leaves out: the table's arch, and the key's fields.
_KEY_SPEC_FIELDS = ("arch", "head_dim", "group_size", "q_dtype", "kv_dtype", "page_size", "kv_layout")
#: Fields of programs KernelSpec no longer has, which tables written before they went hold with
#: their off value in every spec: at that value they are skipped (the spec names the same program);
#: any other value names a program that cannot be built, and the table is refused.
_RETIRED_SPEC_FIELDS = {"steal_tiles": 0, "span_rows": False}


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
                   bucket=dict(name=self.bucket.name, batch=self.bucket.batch, seq_len=self.bucket.seq_len),
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
        if not isinstance(data, dict):
            raise ValueError(f"an entry must be a mapping, got {type(data).__name__}")
        unknown = set(data) - set(ENTRY_FIELDS)
        if unknown:
            raise ValueError(f"unknown entry fields {sorted(unknown)}")
        missing = {"key", "bucket", "spec", "tuned_us", "default_us"} - set(data)
        if missing:
            raise ValueError(f"entry lacks {sorted(missing)}")
        key = TuneKey.from_dict(_mapping(data["key"], "key"))
        b = _mapping(data["bucket"], "bucket")
        bucket = Bucket(str(b["name"]), int(b["batch"]), int(b["seq_len"]))
        spec = None
        if data["spec"] is not None:
            fields = _mapping(data["spec"], "spec")
            clash = set(fields) & set(_KEY_SPEC_FIELDS)
            if clash:
                raise ValueError(f"spec repeats the key's fields {sorted(clash)}")
            spec = KernelSpec.from_dict({**_without_retired_fields(fields), "arch": arch, **key.spec_fields()})
        exhaustive = data.get("exhaustive")
        if exhaustive is not None:
            exhaustive = dict(_mapping(exhaustive, "exhaustive"))
        return cls(key, bucket, spec, float(data["tuned_us"]), float(data["default_us"]),
                   None if data.get("bandwidth_pct") is None else float(data["bandwidth_pct"]),
                   int(data.get("trials", 0)), str(data.get("date", "")), exhaustive,
                   None if data.get("plan") is None else str(data["plan"]),
                   None if data.get("default_plan") is None else str(data["default_plan"]),
                   str(data.get("planner") or "waves"))


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
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unit_costs: unknown fields {sorted(unknown)}")
        missing = {"costs", "tuned_us", "default_us"} - set(data)
        if missing:
            raise ValueError(f"unit_costs: lacks {sorted(missing)}")
        costs = _mapping(data.get("costs"), "unit_costs.costs")
        if set(costs) != set(COST_FIELDS):
            raise ValueError(f"unit_costs.costs: expected the fields {list(COST_FIELDS)}, got {sorted(costs)}")
        try:
            model = CostModel(**costs)  # validates each value
        except (TypeError, ValueError) as e:
            raise ValueError(f"unit_costs.costs: {e}") from None
        workloads = data.get("workloads") or []
        if not isinstance(workloads, list):
            raise ValueError("unit_costs.workloads: expected a list of workload names")
        try:
            figures = float(data["tuned_us"]), float(data["default_us"]), int(data.get("trials") or 0)
        except (TypeError, ValueError):
            raise ValueError(f"unit_costs: tuned_us and default_us must be numbers and trials an int, got "
                             f"{data['tuned_us']!r}, {data['default_us']!r}, {data.get('trials')!r}") from None
        return cls(model, *figures, str(data.get("date", "")), tuple(str(w) for w in workloads))


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


def load(path: Path) -> Table:
    """Read and check a table (raises `TableError` with the file and the reason)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise TableError(f"{path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise TableError(f"{path}: not text ({e})") from None
    except yaml.YAMLError as e:
        raise TableError(f"{path}: not valid YAML ({e})") from None
    try:
        return parse(data)
    except (ValueError, TypeError, KeyError) as e:
        raise TableError(f"{path}: {e}") from None


def parse(data) -> Table:
    if not isinstance(data, dict):
        raise ValueError("a table must be a mapping with a header and 'entries'")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"schema {data.get('schema')!r}; this splitkv reads schema {SCHEMA}")
    missing = set(HEADER_FIELDS) - set(data)
    if missing:
        raise ValueError(f"header lacks {sorted(missing)}")
    unknown = set(data) - set(HEADER_FIELDS) - {"entries", "unit_costs"}
    if unknown:
        raise ValueError(f"unknown header fields {sorted(unknown)}")
    header = {k: data[k] for k in HEADER_FIELDS}
    header["arch"] = parse_arch(header["arch"])
    entries = data.get("entries") or []
    if not isinstance(entries, list):
        raise ValueError("'entries' must be a list")
    parsed = []
    for i, item in enumerate(entries):
        try:
            parsed.append(Entry.from_dict(item, header["arch"]))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"entry {i}: {e}") from None
    seen = set()
    for e in parsed:
        if (e.key, e.bucket.name) in seen:
            raise ValueError(f"two entries for {e.key.label} {e.bucket.name}")
        seen.add((e.key, e.bucket.name))
    unit_costs = None if data.get("unit_costs") is None else UnitCosts.from_dict(data["unit_costs"])
    return Table(header, tuple(sorted(parsed, key=Entry.sort_key)), unit_costs)


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


def _round(x):
    return None if x is None else round(float(x), 3)
