"""The tuner's measurement of one launch by its two paths: the built-in choice (what
``GpuObjective.measure(None)`` times: ``DecodeAttention(tuned=False)``) and the same programs given
explicitly as a candidate (``measure(spec)``), in rounds of alternating order. Identical launches
should measure alike, which is why the tuner identifies a candidate by what it launches and
measures each launch once (docs/experiments.md: "Identical launches, two paths"). Given the dense
program where the built-in choice splits (``64:1:b32-l4k:dense``), the two paths launch different
plans: the control that shows the probe tells launches apart.

    python bench/same_launch.py                      # the default cases (DEFAULT_CASES)
    python bench/same_launch.py --case 64:1:b32-l4k:split --rounds 20

A case is ``HEAD_DIM:GROUP:BUCKET:VARIANT`` (VARIANT: which built-in program to give explicitly:
the one the bucket's plan launches, or the other one as the control). Needs a GPU.
"""

from __future__ import annotations

import argparse
import statistics

from splitkv.autotune import measure
from splitkv.tuned import keys, lookup

DEFAULT_CASES = ["64:1:b32-l4k:split", "128:4:b1-l2k:split", "128:4:b1-l32k:split"]


def probe(case: str, rounds: int, iters: int) -> None:
    head_dim, group, bucket_name, variant = case.split(":")
    key, bucket = keys.TuneKey(int(head_dim), int(group)), keys.parse_bucket(bucket_name)
    objective = measure.GpuObjective(key, bucket, iters=iters)
    split, dense, _ = lookup.programs(None, objective.arch, key)
    explicit = dense if variant == "dense" else split
    failures = objective.prepare([explicit])
    if failures:
        raise SystemExit(f"{case}: {failures}")
    print(f"{key.label} {bucket.name}\n  built-in launches: {objective.runs(None)}\n"
          f"  explicit launches: {objective.runs(explicit)}", flush=True)
    figures = {"built-in": [], "explicit": []}
    for r in range(rounds):
        order = [("built-in", None), ("explicit", explicit)][::-1 if r % 2 else 1]
        for position, (name, spec) in enumerate(order):
            m = objective.measure(spec)
            figures[name].append((m.us, position, objective.harness.last_flush_reps,
                                  statistics.median(objective.harness.last_host_us)))
    for name, rows in figures.items():
        first = [us for us, position, _, _ in rows if position == 0]
        second = [us for us, position, _, _ in rows if position == 1]
        print(f"  {name:9s} median {statistics.median(r[0] for r in rows):8.2f} µs | measured first "
              f"{statistics.median(first):8.2f}, second {statistics.median(second):8.2f} | flush reps "
              f"{sorted({r[2] for r in rows})} | host µs per call {statistics.median(r[3] for r in rows):.1f}",
              flush=True)
    objective.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="HEAD_DIM:GROUP:BUCKET:VARIANT (repeatable)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--iters", type=int, default=40)
    args = parser.parse_args(argv)
    for case in args.case or DEFAULT_CASES:
        probe(case, args.rounds, args.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
