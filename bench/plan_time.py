"""Host time of the work-unit planner (`splitkv.work_units.choose_kv_splits`), no GPU; with
``--runtime``, of the whole `DecodeAttention.plan` on this host's GPU (32 query and 8 K/V heads of
128, the built-in programs: what a serving step pays per decode step, lengths copied included).

Times one plan per decode step for the batches of the serving issue: ragged batches of 1 to 1024
sequences, the partial-wave cases and a skewed batch, on an H200's 132 slots. Median and 90th
percentile of many calls after warm-up, in µs of this host's CPU.

    python bench/plan_time.py
    python bench/plan_time.py --slots 264 --block-size 64 --calls 500
    python bench/plan_time.py --runtime          # needs a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from splitkv.work_units import choose_kv_splits


def cases(rng):
    """(label, lengths, K/V heads) of the batches timed."""
    yield "B=1, L=6096, 7 K/V heads", [6096], 7
    yield "B=3, L=4k, 8 K/V heads", [4096] * 3, 8
    yield "64k + 63 x 512, 8 K/V heads", [65536] + [512] * 63, 8
    for batch in (16, 64, 256, 1024):
        yield f"B={batch} ragged (1..32k), 8 K/V heads", rng.integers(1, 32768, batch).tolist(), 8
    yield "B=256 ragged (1..32k), 1 K/V head", rng.integers(1, 32768, 256).tolist(), 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=132, help="resident CTAs (SMs x CTAs per SM)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per K/V block (page)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--runtime", action="store_true",
                        help="time DecodeAttention.plan on this host's GPU instead of the units planner alone")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"{'batch':40s} {'median µs':>10s} {'p90 µs':>8s}  plan")
    for label, lens, heads in cases(rng):
        if args.runtime:
            from splitkv import DecodeAttention

            attn = DecodeAttention(4 * heads, heads, 128, tuned=False)

            def plan(lens=lens):
                attn.plan(lens)  # what a decode step pays; the description is built after the timing

            def describe():
                return attn.plan_info
        else:
            def plan(lens=lens, heads=heads):
                return choose_kv_splits(lens, heads, block_size=args.block_size, slots=args.slots)

            def describe(plan=plan):
                units = plan()
                return f"{len(units.units)} units, {len(units.merges)} split rows"
        for _ in range(5):  # warm-up (and, with --runtime, the programs' compile and load)
            plan()
        info = describe()
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            plan()
            times.append((time.perf_counter() - start) * 1e6)
        times.sort()
        p90 = times[int(0.9 * (len(times) - 1))]
        print(f"{label:40s} {statistics.median(times):10.0f} {p90:8.0f}  {info}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
