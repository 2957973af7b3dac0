"""`splitkv-gen --tune --remeasure`: a table's figures measured again, its choices kept.

A table's figures describe the programs they were measured with; after a change to the programs
(or the driver) they can be measured again without searching. The table is the one the runtime
loads for this GPU (``SPLITKV_TUNED_CONFIG_DIR`` first, then the shipped tables), or the one under
``--out``. Each selected entry's spec (``spec: null``: the built-in choice) and the built-in
choice are measured on the entry's bucket as the tuner confirms a winner (`confirm.confirm`: rounds
of alternating order, twice the calls), each checked against the reference first, a tuned
spec planned as the runtime plans its entry (`Objective.served`) and checked once more on a ragged
batch (`Objective.verify`). The entry keeps its spec and choice and takes the new figures and
today's date; the table is written after each key (`writing.save`: merged, atomic), so entries
not measured again, and those measured before a run stopped, are never lost. A tuned spec that no
longer beats the built-in choice by `confirm.MARGIN` (the rule a search's winner meets), or fails
the ragged check, gives way to the built-in choice (`built_in_instead`), and the summary gives the
command that tunes its key again: a table measured again obeys the rules of a table tuned. Without entry selectors the table's
``unit_costs`` are measured again too (`unit_costs.against_priors`); ``--unit-costs`` measures
them alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from concurrent import futures
from pathlib import Path

from ..tuned import lookup, tables
from ..tuned.keys import TuneKey
from ..tuned.tables import CURRENT_PLANNER, Entry
from .confirm import MARGIN, beats_built_in, confirm
from .objective import ContextLost, TrialFailed
from .progress import progress_bar
from .tuning import EXIT_CONTEXT_LOST, TuneRun, compile_jobs, header
from .writing import save, today


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which entries are measured again: None matches every value. ``page_sizes`` given also
    selects paged entries by ``kv_layout`` (contiguous caches are NHD)."""

    head_dims: tuple | None = None
    group_sizes: tuple | None = None
    kv_dtypes: tuple | None = None
    page_sizes: tuple | None = None
    kv_layout: str = "NHD"
    buckets: tuple | None = None  # bucket names

    @property
    def narrowed(self) -> bool:
        return any(v is not None for v in (self.head_dims, self.group_sizes, self.kv_dtypes, self.page_sizes,
                                           self.buckets))

    def __contains__(self, entry: Entry) -> bool:
        k = entry.key
        return ((self.head_dims is None or k.head_dim in self.head_dims)
                and (self.group_sizes is None or k.group_size in self.group_sizes)
                and (self.kv_dtypes is None or k.kv_dtype in self.kv_dtypes)
                and (self.page_sizes is None or (k.page_size in self.page_sizes
                                                 and (not k.page_size or k.kv_layout == self.kv_layout)))
                and (self.buckets is None or entry.bucket.name in self.buckets))


@dataclasses.dataclass
class Result:
    """One entry: as it was, as written (None: not measured again, ``reason`` says why), and why
    it is flagged (None: not)."""

    old: Entry
    new: Entry | None = None
    reason: str | None = None
    flag: str | None = None
    measured: Entry | None = None  # a flagged entry's figures as measured, before the built-in choice took its place

    @property
    def figures(self) -> Entry | None:
        """The entry's measured figures (a flagged one's tuned spec's, not those written)."""
        return self.measured or self.new


class Refused(Exception):
    """Nothing can be measured or written (no table, another GPU's, nothing selected): one line."""


def table_file(run: TuneRun, gpu: dict) -> Path:
    """The table measured again: this GPU's under ``--out``, else the one the runtime loads first
    (`lookup.table_dirs`). Raises `Refused` when there is none."""
    if run.out is not None:
        path = tables.table_path(run.out, run.arch, gpu["name"])
        if not path.is_file():
            raise Refused(f"--remeasure: no table of {gpu['name']} ({run.arch}) under --out: {path} does not exist")
        return path
    for folder in lookup.table_dirs():
        path = tables.table_path(folder, run.arch, gpu["name"])
        if path.is_file():
            return path
    where = " or ".join(str(d) for d in lookup.table_dirs())
    raise Refused(f"--remeasure: no tuned table of {gpu['name']} ({run.arch}) in {where}; give --out DIR holding one")


def run(tune: TuneRun, gpu: dict, selection: Selection, unit_costs_only: bool = False) -> int:
    """Measure the selected entries again (and the unit costs: see the module notes), print the
    summary, write the table (none for a cost-model run without --out) and the --report."""
    try:
        path = table_file(tune, gpu)
        table = tables.load(path)
        if (table.gpu, table.arch) != (gpu["name"], tune.arch):
            raise Refused(f"--remeasure: {path} holds {table.gpu} ({table.arch}), not {gpu['name']} ({tune.arch})")
        writes = not (tune.cost_model and tune.out is None)
        if writes and not os.access(path.parent, os.W_OK):
            raise Refused(f"--remeasure: {path.parent} is not writable; copy the table under --out DIR")
        entries = [] if unit_costs_only else [e for e in table.entries if e in selection]
        costs = table.unit_costs if (unit_costs_only or not selection.narrowed) else None
        if unit_costs_only and costs is None:
            raise Refused(f"--remeasure --unit-costs: {path} holds no unit_costs")
        if not entries and costs is None:
            raise Refused(f"--remeasure: no entry of {path} matches the selection")
    except (Refused, tables.TableError) as e:
        print(f"splitkv-gen: {e}", file=sys.stderr)
        return 2
    print(f"re-measuring {len(entries)} entries{' and unit_costs' if costs else ''} of {path} on {gpu['name']} "
          f"({tune.arch}), {tune.iters * 2} timed calls per measurement", file=sys.stderr)
    results, unit = [], None
    try:
        results = remeasure_entries(tune, gpu, entries, path if writes else None)
        if costs is not None:
            unit = remeasure_unit_costs(tune, costs, path if writes else None)
    except ContextLost as e:
        print(f"splitkv-gen: the GPU can run nothing more in this process: {e}\nThe entries measured before "
              f"it are written; measure the rest again with --head-dim/--bucket selectors.", file=sys.stderr)
        return EXIT_CONTEXT_LOST
    except (OSError, tables.TableError) as e:
        print(f"splitkv-gen: cannot write the table {path}: {e}; copy it under --out DIR", file=sys.stderr)
        return 2
    text = summary(results, unit, tune, path)
    print(text)
    if writes:
        print(f"wrote {sum(r.new is not None for r in results)} entries"
              f"{' and unit_costs' if unit and unit[1] is not None else ''} to {path}", file=sys.stderr)
    if tune.report is not None:
        print(f"wrote the report to {write_report(tune.report, results, unit, text, tables.load(path).header)}",
              file=sys.stderr)
    failed = any(r.new is None for r in results) or (unit is not None and unit[1] is None and not tune.cost_model)
    return 1 if failed else 0


def remeasure_entries(tune: TuneRun, gpu: dict, entries, path: Path | None) -> list:
    """Every entry measured again (`remeasure_entry`), a key's entries written after its last (and
    what was measured when the run stops)."""
    from .tuning import _objective

    ahead, pending = (None, None) if tune.cost_model else _compile_ahead(entries, tune)
    results, unwritten = [], []
    bar = progress_bar(True, total=len(entries), desc="re-measured", position=0)
    try:
        for i, entry in enumerate(entries):
            if bar is not None:
                bar.set_postfix_str(f"{entry.key.label} {entry.bucket.name}", refresh=False)
            if pending is not None:  # its programs compiled (or failed: its measurement says why)
                futures.wait([future for _, future in pending[i]])
            with _objective(tune, entry.key, entry.bucket) as lazy:
                results.append(remeasure_entry(lazy, entry, tune.iters * 2))
            if results[-1].new is not None:
                unwritten.append(results[-1].new)
            if path is not None and unwritten and (i + 1 == len(entries) or entries[i + 1].key != entry.key):
                save(path, header(tune, gpu), unwritten)
                unwritten = []
            if bar is not None:
                bar.update(1)
    finally:
        if path is not None and unwritten:  # a run stopped mid-key (a lost GPU, ^C) keeps what it measured
            save(path, header(tune, gpu), unwritten)
        if bar is not None:
            bar.close()
        if ahead is not None:
            ahead.close()
    return results


def remeasure_entry(lazy, entry: Entry, iters: int) -> Result:
    """One entry measured again on its bucket (see the module notes); ``lazy`` makes the objective."""
    spec = entry.spec
    candidates = [] if spec is None else [spec]
    failing = spec  # what a TrialFailed is about
    try:
        objective = lazy.get()
        objective.served = entry
        for failing in [*candidates, None]:  # checked first, with the reason kept when one fails
            objective.measure(failing)
        failing = None  # confirm raises only for the built-in choice; a failing candidate is left out
        figures = confirm(objective, candidates, iters=iters)
        failing = spec
        if spec is not None and spec.name not in figures:
            raise TrialFailed("it failed when measured again")
        problem = None if spec is None else objective.verify(spec)
        failing = None
        default_plan = None if spec is None else objective.runs(None)
        failing = spec
        same_launch = spec is not None and objective.runs(spec) == default_plan
    except ContextLost:
        raise
    except TrialFailed as e:
        return Result(entry, reason=f"{'the built-in choice' if failing is None else failing.name} failed: {e}")
    except Exception as e:  # noqa: BLE001 - e.g. no memory for this bucket's inputs: the next may fit
        return Result(entry, reason=f"{type(e).__name__}: {e}")
    tuned, default = figures[None if spec is None else spec.name], figures[None]
    new = dataclasses.replace(entry, tuned_us=tuned.us, default_us=default.us, bandwidth_pct=tuned.bandwidth_pct,
                              date=today(), plan=tuned.detail.get("plan") or entry.plan,
                              default_plan=(default_plan or entry.default_plan) if spec is not None else None,
                              planner=_planner(entry))
    flag = None
    if problem:
        flag = f"failed its check on a ragged batch: {problem}"
    elif same_launch:  # as a search counts it: the built-in choice measured twice
        flag = "launches what the built-in choice launches"
    elif spec is not None and not beats_built_in(new.tuned_us, new.default_us):
        change = new.tuned_us / new.default_us - 1
        flag = f"{abs(change):.1%} {'slower' if change > 0 else 'faster'} than the built-in choice"
    if flag is not None:
        return Result(entry, built_in_instead(new), flag=flag + "; the built-in choice takes its place", measured=new)
    return Result(entry, new)


def built_in_instead(entry: Entry) -> Entry:
    """``entry`` (a tuned one, its figures measured) holding the built-in choice instead, with the
    built-in choice's figures: its µs, its bandwidth (the same bytes in its time) and its plan."""
    bandwidth = (None if entry.bandwidth_pct is None
                 else entry.bandwidth_pct * entry.tuned_us / entry.default_us)
    return dataclasses.replace(entry, spec=None, tuned_us=entry.default_us, bandwidth_pct=bandwidth,
                               plan=entry.default_plan or entry.plan, default_plan=None, planner=CURRENT_PLANNER)


def _planner(entry: Entry) -> str:
    """The rules the new figures were measured under: a tuned split program's own (the runtime
    plans it by its entry's), else the current ones (the built-in programs, and a tuned dense one
    where it serves, are planned by those whatever the entry says)."""
    return entry.planner if entry.spec is not None and entry.spec.variant == "split" else CURRENT_PLANNER


def remeasure_unit_costs(tune: TuneRun, old: tables.UnitCosts, path: Path | None):
    """(old, new or None, reason or flag): the table's unit costs and the built-in ones measured
    again on the GPU (`unit_costs.against_priors`), written under the table's header."""
    from . import unit_costs

    if tune.cost_model:
        return old, None, "not measured by the cost model: kept"
    measure = unit_costs.GpuMeasure(iters=tune.iters, seed=tune.seed)
    try:
        tuned_us, default_us, _ = unit_costs.against_priors(measure, old.costs)
    except ContextLost:
        raise
    except TrialFailed as e:
        return old, None, f"{'the built-in' if e.priors_failed else 'the tuned'} costs' plans failed: {e}"
    finally:
        measure.close()
    new = dataclasses.replace(old, tuned_us=tuned_us, default_us=default_us, date=today(),
                              workloads=tuple(name for name, _ in unit_costs.WORKLOADS))
    note = None
    if old.costs != _priors() and not beats_built_in(tuned_us, default_us):  # as `unit_costs.search` keeps them
        change = tuned_us / default_us - 1
        note = (f"{abs(change):.1%} {'slower' if change > 0 else 'faster'} than the built-in costs; the built-in "
                f"costs take their place")
        new = dataclasses.replace(new, costs=_priors(), tuned_us=default_us)
    if path is not None:
        save(path, tables.load(path).header, [], unit_costs=new)  # the header describes the entries' run
    return old, new, note


def retune_command(tune: TuneRun, key: TuneKey, buckets) -> str:
    """The command that tunes ``key`` again on ``buckets`` into the same table."""
    arch = tune.arch.replace("_", "")
    cmd = f"splitkv-gen --arch {arch} --tune --head-dim {key.head_dim} --group {key.group_size} --dtype {key.kv_dtype}"
    if key.page_size:
        cmd += f" --page-size {key.page_size} --layout {key.kv_layout}"
    cmd += " --bucket " + ",".join(buckets)
    return cmd + (f" --out {tune.out}" if tune.out is not None else "") + (" --cost-model" if tune.cost_model else "")


def summary(results, unit, tune: TuneRun, path: Path) -> str:
    """Per entry: the old and new figures (µs), the new speedup and its flag; then the entries not
    measured again, and the commands that tune the flagged keys again."""
    head = ("key", "bucket", "program", "old default", "old tuned", "new default", "new tuned", "speedup", "flag")
    rows = [head]
    for r in results:
        e, n = r.old, r.figures
        rows.append((e.key.label, e.bucket.name, "built-in" if e.spec is None else e.spec.name,
                     f"{e.default_us:.2f}", f"{e.tuned_us:.2f}", "-" if n is None else f"{n.default_us:.2f}",
                     "-" if n is None else f"{n.tuned_us:.2f}", "-" if n is None else f"{n.speedup:.3f}x",
                     "not measured" if n is None else ("FLAGGED" if r.flag else "")))
    if unit is not None:
        old, new, note = unit
        rows.append(("unit_costs", f"{len(old.workloads)} workloads", "built-in" if old.costs == _priors() else
                     "tuned costs", f"{old.default_us:.2f}", f"{old.tuned_us:.2f}",
                     "-" if new is None else f"{new.default_us:.2f}", "-" if new is None else f"{new.tuned_us:.2f}",
                     "-" if new is None else f"{new.default_us / new.tuned_us:.3f}x",
                     "not measured" if new is None else ("FLAGGED" if note else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    for r in results:
        if r.new is None:
            lines.append(f"not measured again (kept as it was): {r.old.key.label} {r.old.bucket.name}: {r.reason}")
    if unit is not None and unit[1] is None:
        lines.append(f"unit_costs not measured again (kept as they were): {unit[2]}")
    flagged = {}
    for r in results:
        if r.flag:
            lines.append(f"flagged: {r.old.key.label} {r.old.bucket.name}: {r.old.spec.name} {r.flag}")
            flagged.setdefault(r.old.key, []).append(r.old.bucket.name)
    if flagged:
        lines.append(f"The flagged entries now hold the built-in choice (a tuned spec stays only when {MARGIN:.0%} "
                     f"faster than it); tune their keys again to look for another winner:")
        lines += [f"  {retune_command(tune, key, buckets)}" for key, buckets in flagged.items()]
    if unit is not None and unit[1] is not None and unit[2]:
        lines.append(f"flagged: unit_costs {unit[2]}; tune them again: splitkv-gen --arch "
                     f"{tune.arch.replace('_', '')} --tune --unit-costs" + (f" --out {tune.out}" if tune.out else ""))
    if tune.cost_model:
        lines.append("(cost model: the figures are predictions, not measurements"
                     + ("" if tune.out is not None else "; no table written without --out") + ")")
    return "\n".join(lines)


def _priors():
    from ..work_units import PRIOR_COSTS

    return PRIOR_COSTS


def write_report(directory: Path, results, unit, text: str, table_header: dict) -> Path:
    """``remeasure.json`` (every entry before and after, its reason or flag) and ``remeasure.md``
    (the summary) in ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = dict(header=table_header, entries=[dict(old=r.old.to_dict(), new=None if r.new is None else r.new.to_dict(),
                                                   measured=None if r.measured is None else r.measured.to_dict(),
                                                   reason=r.reason, flag=r.flag) for r in results])
    if unit is not None:
        data["unit_costs"] = dict(old=unit[0].to_dict(), new=None if unit[1] is None else unit[1].to_dict(),
                                  note=unit[2])
    (directory / "remeasure.json").write_text(json.dumps(data, indent=1, default=str))
    h = table_header
    (directory / "remeasure.md").write_text(f"# Re-measured: {h['gpu']} ({h['arch']}), {today()}\n\n"
                                            f"```\n{text}\n```\n")
    return directory


class _Ahead:
    """The programs every re-measured entry loads, compiled on a thread pool while the GPU
    measures the first (`compiling.Compiler`: each once; a measurement finds it compiled, or
    compiles it itself)."""

    def __init__(self, jobs: int):
        self.jobs = jobs

    def programs(self, programs) -> list:
        return list(programs)

    def compile(self, program) -> None:
        from ..codegen import compile_cubin

        compile_cubin(program)

    def failure_is_final(self, error) -> bool:
        return True  # the measurement that needs it compiles it again, and says why it fails


def _compile_ahead(entries, tune: TuneRun):
    """Start compiling, in the entries' order, what `GpuObjective.programs` names for each tuned
    spec and the built-in programs, with the units and packed dense programs plans may take:
    (the compiler, each entry's (program name, future)s)."""
    from .compiling import Compiler
    from .measure import _companions

    compiler, pending = Compiler(_Ahead(compile_jobs(tune.jobs))), []
    for entry in entries:
        split, dense, _ = lookup.programs(None, tune.arch, entry.key)
        programs = [split, *_companions(split, split, dense)]
        variants = [dense]
        if entry.spec is not None:
            spec = entry.spec.replace(arch=tune.arch)
            programs += [spec, *_companions(spec, split, dense)]
            variants.append(spec)
        for spec in variants:  # the program a ragged batch (units) or a packed dense plan loads
            try:
                programs.append(spec.as_units() if spec.variant == "split" else spec.replace(warp_heads=True))
            except ValueError:  # one that cannot be built: no plan of this entry takes it
                continue
        pending.append(compiler.submit(programs))
    return compiler, pending
