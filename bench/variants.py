"""Time variants of splitkv's program and plan side by side, per shape, under the benchmark's protocol.

Each variant is a comma list of KernelSpec fields replaced in the built-in spec (as the
benchmark's ``--specs``), plus plan keys: ``splits=N`` forces the split variant with N splits
(the planner still picks the cluster size), ``splits=0`` forces the dense program, and
``warp_heads=1`` or ``0`` forces a dense plan's warp per K/V head on or off. An empty
variant ("") is splitkv as shipped. No peers, no correctness check: this is for choosing among
variants; the benchmark and the GPU tests vouch for what ships.

    python bench/variants.py --shapes 1:8:1:128:64k --variants "" cluster=1 "cluster=1,splits=32"
    python bench/variants.py --shapes 64:32:8:128:1k --variants "" "tile_tokens=32,chunk_size=128,stages=2,splits=0"
    python bench/variants.py --shapes 64:32:8:128:1k --variants "splits=0,warp_heads=0" "splits=0,warp_heads=1"
    python bench/variants.py --shapes 1:32:8:128:4k --variants "" cluster=1 --rounds 4   # differences under 1 µs

Needs a GPU and CuPy.
"""

from __future__ import annotations

import argparse
import statistics

from splitkv import DecodeAttention
from splitkv.bench.inputs import random_qkv
from splitkv.bench.overrides import parse_spec_override
from splitkv.bench.shapes import parse_shapes
from splitkv.timing import Harness, ReadFloor
from splitkv.heuristics import default_spec


def parse_variant(text: str) -> tuple[dict, dict]:
    """'cluster=1,splits=32,warp_heads=0' -> ({'cluster': 1}, {'splits': 32, 'warp_heads': False}); the
    spec fields are checked as --specs checks them."""
    pairs = [p for p in text.split(",") if p.strip()]
    plan_keys: dict = {}
    rest = []
    for pair in pairs:
        key, _, value = (part.strip() for part in pair.partition("="))
        if key == "splits":
            plan_keys["splits"] = int(value)
            if plan_keys["splits"] < 0:
                raise ValueError(f"variant {text!r}: splits must be >= 0 (0: dense)")
        elif key == "warp_heads":
            if value not in ("0", "1"):
                raise ValueError(f"variant {text!r}: warp_heads must be 0 or 1")
            plan_keys["warp_heads"] = value == "1"
        else:
            rest.append(pair)
    if plan_keys.get("warp_heads") and plan_keys.get("splits") != 0:
        raise ValueError(f"variant {text!r}: warp_heads=1 is a dense layout; add splits=0")
    return (parse_spec_override(",".join(rest)) if rest else {}), plan_keys


def planned_attention(shape, changes: dict, plan_keys: dict, stream):
    """A DecodeAttention for ``shape`` (a bench Shape) with the variant's spec fields and plan keys
    (see parse_variant), planned for its lengths on ``stream``."""
    import cupy

    hq, hkv, d = shape.num_qo_heads, shape.num_kv_heads, shape.head_dim
    spec = default_spec("sm_" + cupy.cuda.Device().compute_capability, d, hq // hkv,
                        kv_dtype=shape.kv_dtype).replace(**changes) if changes else None
    attn = DecodeAttention(hq, hkv, d, kv_dtype=shape.kv_dtype, spec=spec)
    splits = plan_keys.get("splits")
    variant = None if splits is None else ("dense" if splits == 0 else "split")
    attn.plan([shape.seq_len] * shape.batch, variant=variant, num_splits=splits or None,
              warp_heads=plan_keys.get("warp_heads"), stream=stream)
    return attn


def round_order(count: int, round_index: int) -> list[int]:
    """The order in which round ``round_index`` times ``count`` variants: rotated by one each round,
    so that over ``count`` rounds (or any multiple) every variant takes every position once.

    Where a call stands in a sequence of calls moves its time, consistently from round to round
    (docs/experiments.md: "Call order moves a figure"); one fixed order would charge that to the
    variants.
    """
    return [(i + round_index) % count for i in range(count)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", required=True, help="B:Hq:Hkv:D:L[:fp8|:nvfp4] (L may be written 4k)")
    parser.add_argument("--variants", nargs="+", default=[""], help='field=value,...[,splits=N][,warp_heads=0|1]; "" = as shipped')
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every variant this many times, in a rotating order (see round_order; "
                             "a multiple of the number of variants puts each in every position); the "
                             "figure is the median of the rounds' medians")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds: expected a positive int")
    variants = [(text, *parse_variant(text)) for text in args.variants]

    harness = Harness(args.iters, 5, 256 << 20)
    harness.flush_us = harness.flush_time_us()  # enough flushes a call to keep the queue ahead of the GPU
    shapes = parse_shapes(args.shapes)
    floor = ReadFloor(max(s.total_bytes for s in shapes))
    for shape in shapes:
        q, k, v, out = random_qkv(shape)
        with harness.active():
            floor_us = statistics.median(harness.time(floor.reader(shape.total_bytes)))
        print(f"{shape.label}: read floor {floor_us:.1f} µs", flush=True)
        # every variant compiled and planned before any is timed
        planned = [planned_attention(shape, changes, plan_keys, harness.stream) for _, changes, plan_keys in variants]
        medians = [[] for _ in planned]
        for r in range(args.rounds):
            for i in round_order(len(planned), r):
                attn = planned[i]
                with harness.active():
                    medians[i].append(statistics.median(harness.time(lambda: attn.run(q, k, v, out=out))))
        for (text, _, _), attn, times in zip(variants, planned, medians):
            spread = f" [{min(times):.2f}-{max(times):.2f}]" if len(times) > 1 else ""
            print(f"  {statistics.median(times):8.2f} µs{spread}  {text or '(as shipped)':40s} {attn.plan_info}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
