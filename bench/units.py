"""Work-unit plans against fixed splits and FlashInfer, on partial-wave and balanced batches.

For every case (lengths, heads, page size) in one run: splitkv with the work-unit planner
(plan(variant='units')), splitkv's default planner, the dense program alone, a uniform split (every row cut into
ceil(SMs / rows) splits, one CTA per SM as flash-decoding does), the best fixed split found by
brute force over split counts, and FlashInfer's paged decode on the same pages. Medians under the
benchmark's protocol (CUDA events, cold L2); the host time of planning is shown too.

    python bench/units.py
    python bench/units.py --cases "6096x1:28:7:128:16" --iters 50
    python bench/units.py --builtin --cases "4096x32:8:8:64:0"   # the planner alone, no tuned table

A case is ``LENS:HQ:HKV:D:PAGE``, LENS a comma list of ``length`` or ``lengthxcount`` (PAGE 0:
a contiguous cache). Needs a GPU, CuPy and torch; FlashInfer is optional.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import numpy as np

from paged import flashinfer_paged  # bench/paged.py: the same FlashInfer call on the same pages
from splitkv import DecodeAttention
from splitkv.timing import Harness

#: The issue's partial-wave cases, balanced ones, and page sizes 1, 16 and 64.
DEFAULT_CASES = ["6096x1:28:7:128:0", "4096x3:32:8:128:0", "65536,512x63:32:8:128:16", "6096x1:28:7:128:16",
                 "4096x3:32:8:128:1", "4096x3:32:8:128:64", "4096x16:32:8:128:16", "1024x64:32:8:128:16"]
#: Split counts the brute force tries.
FIXED_SPLITS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64)


@dataclass(frozen=True)
class Case:
    lens: tuple
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int

    @classmethod
    def parse(cls, text: str) -> "Case":
        lens_text, hq, hkv, d, page = text.split(":")
        lens = []
        for piece in lens_text.split(","):
            length, _, count = piece.partition("x")
            lens += [int(length)] * int(count or 1)
        return cls(tuple(lens), int(hq), int(hkv), int(d), int(page))

    @property
    def label(self) -> str:
        lens = np.asarray(self.lens)
        shown = f"B={lens.size} L={lens.max()}" if lens.min() == lens.max() else f"B={lens.size} L={lens.max()}..{lens.min()}"
        return f"{shown} {self.num_qo_heads}/{self.num_kv_heads} D={self.head_dim} " + \
            (f"page {self.page_size}" if self.page_size else "contiguous")


def random_bf16(shape, rng):
    import cupy

    return (rng.standard_normal(shape, dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)


def build(case: Case, rng):
    """q, K and V (contiguous, or pages in a random order), the block table (or None), and the
    pages and table FlashInfer reads (pages of 16 over a contiguous cache)."""
    b, hkv, d = len(case.lens), case.num_kv_heads, case.head_dim
    q = random_bf16((b, case.num_qo_heads, d), rng)
    page = case.page_size or 16
    per_seq = [-(-n // page) for n in case.lens]
    if not case.page_size:
        length = -(-max(case.lens) // page) * page
        k, v = (random_bf16((b, length, hkv, d), rng) for _ in range(2))
        pages = (k.reshape(-1, page, hkv, d), v.reshape(-1, page, hkv, d))
        table = np.stack([np.arange(length // page) + i * (length // page) for i in range(b)]).astype(np.int32)
        return q, k, v, None, pages, table
    total = sum(per_seq)
    order = np.random.default_rng(0).permutation(total).astype(np.int32)
    k, v = (random_bf16((total, page, hkv, d), rng) for _ in range(2))
    table = np.zeros((b, max(per_seq)), dtype=np.int32)
    start = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = order[start:start + n]
        start += n
    return q, k, v, table, (k, v), table


def main(argv=None) -> int:
    import cupy
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--builtin", action="store_true",
                        help="the built-in programs only (tuned=False): how the planner itself chooses, "
                             "without a tuned table's programs or routing")
    args = parser.parse_args(argv)

    harness = Harness(args.iters, 5, 256 << 20, torch_mod=torch)
    harness.flush_us = harness.flush_time_us()
    rng = cupy.random.default_rng(0)
    num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    header = ("| case | units µs (plan host µs) | default µs | dense µs | uniform split µs | "
              "best fixed split µs (splits) | units / best fixed | uniform / units | FlashInfer µs |")
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print(header, flush=True)
    rows = []
    for case in map(Case.parse, args.cases):
        q, k, v, table, pages, fi_table = build(case, rng)
        heads = (case.num_qo_heads, case.num_kv_heads, case.head_dim)
        paged = dict(page_size=case.page_size, kv_layout="NHD") if case.page_size else {}
        plan_args = {"block_table": table} if case.page_size else {}
        lens = list(case.lens)
        out = cupy.empty_like(q)

        def timed(**plan_keys):
            attn = DecodeAttention(*heads, **paged, tuned=not args.builtin)
            attn.plan(lens, stream=harness.stream, **plan_args, **plan_keys)
            return statistics.median(harness.time(lambda: attn.run(q, k, v, out=out))), attn

        with harness.active():
            units_us, units_attn = timed(variant="units")
            host = []
            for _ in range(20):
                t0 = time.perf_counter()
                units_attn.plan(lens, variant="units", stream=harness.stream, **plan_args)
                host.append((time.perf_counter() - t0) * 1e6)
            default_us, default_attn = timed()
            dense_us, _ = timed(variant="dense")
            rows_total = len(lens) * case.num_kv_heads
            uniform = max(1, -(-num_sms // rows_total))
            uniform_us, _ = timed(variant="split", num_splits=uniform)
            fixed, fixed_plans = {}, {}
            for s in FIXED_SPLITS:
                fixed[s], attn = timed(variant="split", num_splits=s)
                fixed_plans[s] = attn.plan_info
            best_splits = min(fixed, key=fixed.get)
            fi_us = None
            try:
                for tensor_cores in (False, True):  # FlashInfer's two decode paths: the faster one counts
                    run, _, keep = flashinfer_paged(torch, heads, q, *pages, fi_table, lens, case.page_size or 16,
                                                    "NHD", tensor_cores)
                    t = statistics.median(harness.time(run))
                    fi_us = t if fi_us is None else min(fi_us, t)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                print(f"  FlashInfer n/a: {type(exc).__name__}: {exc}", flush=True)
        best = fixed[best_splits]
        row = {"case": case.label, "units_us": units_us, "plan_host_us": statistics.median(host),
               "default_us": default_us, "dense_us": dense_us, "uniform_splits": uniform, "uniform_us": uniform_us,
               "fixed_us": fixed, "fixed_plans": fixed_plans, "best_fixed_splits": best_splits, "best_fixed_us": best,
               "flashinfer_us": fi_us, "units_plan": units_attn.plan_info, "default_plan": default_attn.plan_info}
        rows.append(row)
        line = (f"| {case.label} | {units_us:.1f} ({row['plan_host_us']:.0f}) | {default_us:.1f} | {dense_us:.1f} | "
                f"{uniform_us:.1f} ({uniform}) | {best:.1f} ({best_splits}) | {units_us / best:.3f} | {uniform_us / units_us:.2f}x | "
                + (f"{fi_us:.1f}" if fi_us else "n/a") + " |")
        lines.append(line)
        print(line + f"  [units: {units_attn.plan_info}] [default: {default_attn.plan_info}]", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
