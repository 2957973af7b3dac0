"""`--report DIR`: what a tuning run found, as JSON, markdown and PNG plots.

- ``results.json``: every study's entry, its trials and the confirmation round;
- ``summary.md``: the summary table (key, bucket, default µs, tuned µs, speedup, % copy bandwidth),
  and the exhaustive comparison where it was run;
- ``chunk-<key>.png``: µs against chunk size of every completed trial, a panel per bucket;
- ``bandwidth-<key>.png``: % of the copy bandwidth against context length, tuned and default
  (and peers, when a sweep measured them: `sweep`).

Plots need matplotlib (``pip install 'splitkv[tune]'``); without it the JSON and markdown are
still written and the summary says the plots were skipped.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def write(directory: Path, outcomes, header: dict, sweeps: dict | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = dict(header=header, objective=outcomes[0].objective if outcomes else None,
                studies=[dict(entry=o.entry.to_dict(), confirm=o.confirm, trials=o.trials,
                              seconds={k: round(v, 3) for k, v in o.seconds.items()}) for o in outcomes],
                sweeps=sweeps or {})
    (directory / "results.json").write_text(json.dumps(data, indent=1, default=str))
    plots = _plots(directory, outcomes, sweeps or {})
    (directory / "summary.md").write_text(markdown(outcomes, header, plots))
    return directory


def outcomes_from_storage(entries, table, storage, prefix: str = "") -> tuple[list, list]:
    """(outcomes, entries without a study): each table entry with its study's trials from an Optuna
    ``storage``, for a report written after the run. The study is the one named for the entry
    (under ``prefix``); of several code versions, this one's, else the one started last: give the
    storage (and prefix) of the run that wrote the entries. The confirmation round is not in the
    storage: the outcomes carry none."""
    from ..tuned.lookup import COST_MODEL_GPU
    from .costmodel import CostModelObjective
    from .measure import GpuObjective
    from .studies import Outcome, import_optuna, study_seconds, trial_rows
    from .versions import code_version, study_name

    optuna = import_optuna()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    summaries = optuna.get_all_study_summaries(storage)
    objective = CostModelObjective.name if table.gpu == COST_MODEL_GPU else GpuObjective.name
    outcomes, missing = [], []
    for entry in entries:
        base = study_name(prefix, table.gpu, table.arch, entry.key, entry.bucket)
        mine = f"{base}-{code_version()}"
        found = [s for s in summaries if s.study_name == base or s.study_name.startswith(base + "-")]
        found.sort(key=lambda s: (s.study_name == mine, s.datetime_start is not None, s.datetime_start or 0))
        if not found:
            missing.append(entry)
            continue
        study = optuna.load_study(study_name=found[-1].study_name, storage=storage)
        outcomes.append(Outcome(entry, trial_rows(study), {}, objective, study_seconds(study)))
    return outcomes, missing


def format_summary(entries, seconds=None) -> str:
    """The run's summary table: key, bucket, default µs, tuned µs, speedup, % copy bandwidth, program,
    and with ``seconds`` (per entry, phase -> seconds, see `studies.study_seconds`) the time the
    study took per phase."""
    from .studies import PHASES

    timed = seconds is not None and any(seconds)
    head = ("key", "bucket", "default µs", "tuned µs", "speedup", "% copy bw", "tuned program")
    rows = [head + ((f"s {'/'.join(PHASES)}",) if timed else ())]
    for i, e in enumerate(entries):
        row = (e.key.label, e.bucket.name, f"{e.default_us:.2f}", f"{e.tuned_us:.2f}", f"{e.speedup:.3f}x",
               "-" if e.bandwidth_pct is None else f"{e.bandwidth_pct:.1f}",
               "built-in" if e.spec is None else e.spec.name)
        if timed:
            row += ("/".join(f"{seconds[i].get(p, 0.0):.1f}" for p in PHASES) if seconds[i] else "-",)
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def markdown(outcomes, header: dict, plots) -> str:
    lines = [f"# Tuning report: {header['gpu']} ({header['arch']}), {header['date']}", "",
             f"splitkv {header['splitkv']}, CUDA runtime {header['cuda_runtime']}, NVRTC {header['nvrtc']}, "
             f"{header['sm_count']} SMs. Objective: {outcomes[0].objective if outcomes else '-'}.", "",
             "```", format_summary([o.entry for o in outcomes], [o.seconds for o in outcomes]), "```", ""]
    compared = [o.entry for o in outcomes if o.entry.exhaustive]
    if compared:
        lines += ["## Against exhaustive search of the same space", "",
                  "| key | bucket | points | exhaustive best µs | chosen program's µs there | within | trials to 3% |",
                  "|---|---|---|---|---|---|---|"]
        for e in compared:
            x = e.exhaustive
            mine = x.get("tuned_spec_us") if e.spec is not None else x.get("builtin_spec_us")
            if e.spec is None and mine and x.get("best_us"):
                within = f"{100 * (mine / x['best_us'] - 1):+.1f}% (built-in kept)"
            elif e.spec is None:
                within = "built-in kept"
            elif mine and x.get("best_us"):
                within = f"{100 * (mine / x['best_us'] - 1):+.1f}%"
            else:
                within = "failed in the exhaustive run"
            lines.append(f"| {e.key.label} | {e.bucket.name} | {x['points']} | {x['best_us']} | {mine or '-'} | "
                         f"{within} | {x.get('trials_to_within_3pct') or '-'} |")
        lines.append("")
    if plots is None:
        lines.append("Plots skipped: matplotlib is not installed.")
    else:
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def _plots(directory: Path, outcomes, sweeps: dict):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    written = []
    by_key = defaultdict(list)
    for o in outcomes:
        by_key[o.entry.key].append(o)
    for key, group in by_key.items():
        fig, axes = plt.subplots(1, len(group), figsize=(4.2 * len(group), 3.4), squeeze=False)
        for ax, o in zip(axes[0], group):
            for variant, marker in (("dense", "s"), ("split", "o")):
                pts = [(t["chunk_size"], t["us"]) for t in o.trials
                       if t["state"] == "COMPLETE" and t["us"] is not None and t["variant"] == variant]
                if pts:
                    ax.scatter(*zip(*pts), marker=marker, alpha=0.6, label=variant)
            ax.axhline(o.entry.default_us, color="grey", linestyle="--", linewidth=1, label="built-in")
            ax.set_xscale("log", base=2)
            ax.set_title(o.entry.bucket.name, fontsize=9)
            ax.set_xlabel("chunk size (tokens)")
            ax.set_ylabel("µs")
            ax.legend(fontsize=7)
        fig.suptitle(f"{key.label}: every completed trial", fontsize=10)
        fig.tight_layout()
        path = directory / f"chunk-{key.label}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
        sweep = sweeps.get(key.label)
        if sweep:
            written.append(_bandwidth_plot(plt, directory, key, sweep))
    return written


def _bandwidth_plot(plt, directory: Path, key, sweep: dict) -> Path:
    """``sweep``: {'lengths': [...], series name: [% copy bandwidth or None per length]}."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    lengths = sweep["lengths"]
    for name, values in sweep.items():
        if name == "lengths":
            continue
        pts = [(n, v) for n, v in zip(lengths, values) if v is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens), batch 1")
    ax.set_ylabel("% of copy bandwidth")
    top = max((v for name, vs in sweep.items() if name != "lengths" for v in vs if v is not None), default=100)
    ax.set_ylim(0, max(100, top * 1.05))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(key.label, fontsize=10)
    fig.tight_layout()
    path = directory / f"bandwidth-{key.label}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
