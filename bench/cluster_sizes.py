"""Whole-row thread-block clusters of a given size against the planner's own plan.

For each shape, the planner's plan is timed beside plans whose rows are each one cluster of the
given sizes (one split per member, merged in shared memory), under the benchmark's protocol, every
variant in every position of the call order. Each variant's output is compared with the planner's
(and checked for NaN). Without sizes, the largest cluster every row fits into at once, 8 and 4 are
tried. This is how `plan.WHOLE_ROW_SHARE` was measured (docs/experiments.md: "Whole-row clusters",
"Clusters of 8, not 9").

    python bench/cluster_sizes.py 1:32:8:128:64k@8,9 2:32:8:128:4k@4,5 1:32:32:128:64k
    python bench/cluster_sizes.py 1:32:8:128:16k:fp8@8,9 --rounds 6   # quantized caches as the benchmark's
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from variants import round_order  # noqa: E402


@contextlib.contextmanager
def whole_row_clusters(planner, size: int):
    """Within the block, every split plan runs as one cluster of ``size`` per row (the forced split
    count must come out as ``size`` after chunk rounding)."""
    chosen = planner.fit_clusters

    def fit(plan, *args, **kwargs):
        if plan.num_splits != size:
            raise ValueError(f"{plan.num_splits} splits after chunk rounding, not {size}")
        return plan, size

    planner.fit_clusters = fit
    try:
        yield
    finally:
        planner.fit_clusters = chosen


def largest_resident(attn, rows: int):
    """The largest cluster size whose clusters are all resident for ``rows`` rows of ``attn``'s
    split program (None: none)."""
    for size in range(16, 1, -1):
        if (attn._max_active_clusters(size) or 0) >= rows:
            return size
    return None


def main(argv=None) -> int:
    import cupy

    from splitkv import DecodeAttention, planning
    from splitkv.bench.inputs import random_qkv
    from splitkv.bench.shapes import parse_shapes
    from splitkv.timing import Harness, ReadFloor
    from splitkv.heuristics import default_spec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help="B:Hq:Hkv:D:L[:fp8|:nvfp4], optionally @size,size,...")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=0,
                        help="timing rounds, each variant's order rotated by one a round (default: one per variant)")
    args = parser.parse_args(argv)
    if args.rounds < 0:
        parser.error("--rounds: expected 0 (one round per variant) or a positive int")
    sizes = [[int(s) for s in text.partition("@")[2].split(",") if s] for text in args.shapes]
    shapes = parse_shapes([text.partition("@")[0] for text in args.shapes])
    arch = "sm_" + cupy.cuda.Device().compute_capability
    harness = Harness(args.iters, 5, 256 << 20)
    floor = ReadFloor(max(shape.total_bytes for shape in shapes))
    as_float = lambda bits: (bits.astype(cupy.uint32) << 16).view(cupy.float32)  # noqa: E731 (bf16 bits)

    for shape, wanted in zip(shapes, sizes):
        batch, hq, hkv, dim, length = (shape.batch, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim,
                                       shape.seq_len)
        q, k, v, out = random_qkv(shape)  # K/V quantized on the GPU for :fp8 and :nvfp4 shapes
        with harness.active():
            floor_us = statistics.median(harness.time(floor.reader(shape.total_bytes)))
        print(f"{shape.label}: read floor {floor_us:.2f} µs", flush=True)
        kv_dtype = shape.kv_dtype
        spec = default_spec(arch, dim, hq // hkv, kv_dtype=kv_dtype)
        if not wanted:
            top = largest_resident(DecodeAttention(hq, hkv, dim, kv_dtype=kv_dtype), batch * hkv)
            wanted = sorted({s for s in (top, 8, 4) if top is not None and s <= top}, reverse=True)
        variants = []
        for size in [None, *wanted]:
            if size is None:
                attn = DecodeAttention(hq, hkv, dim, kv_dtype=kv_dtype)
                attn.plan([length] * batch, stream=harness.stream)
            else:
                # Chunks of one tile, so that the split count can match the cluster size.
                attn = DecodeAttention(hq, hkv, dim, kv_dtype=kv_dtype,
                                       spec=spec.replace(cluster=16, chunk_size=spec.tile_tokens))
                try:
                    with whole_row_clusters(planning, size):
                        attn.plan([length] * batch, variant="split", num_splits=size, stream=harness.stream)
                except ValueError as exc:
                    print(f"  clusters of {size}: skipped ({exc})")
                    continue
            result = cupy.full(out.shape, 0x7FC0, dtype=out.dtype)  # bf16 NaN until written
            with harness.active():
                attn.run(q, k, v, out=result)
                harness.synchronize()
            variants.append(("planner" if size is None else f"clusters of {size}", attn, result))
        times = [[] for _ in variants]
        for round_index in range(args.rounds or len(variants)):
            for i in round_order(len(variants), round_index):
                attn = variants[i][1]
                with harness.active():
                    times[i].append(statistics.median(harness.time(lambda: attn.run(q, k, v, out=out))))
        reference = as_float(variants[0][2])
        for (name, attn, result), samples in zip(variants, times):
            values = as_float(result)
            print(f"  {statistics.median(samples):8.2f} µs [{min(samples):.2f}-{max(samples):.2f}]  {name:16s} "
                  f"max |diff| {float(cupy.abs(values - reference).max()):.1e}  "
                  f"NaN {bool(cupy.isnan(values).any())}  {attn.plan_info}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
