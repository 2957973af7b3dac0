"""Random decode cases against the float64 reference, on a GPU: ``python tests/gpu/fuzz.py --cases 2000``.

The programs are a fixed set (`PROGRAMS`: head_dim, group, dtypes, cache layout), so that a run
compiles a few dozen of them; everything that is not compile-time is drawn per case: the batch, the
K/V heads, lengths (0, 1, tile and page boundaries, long rows), the plan (the planner's own, dense,
split into any count, work units), ``return_lse``, the softmax scale and the logits' size, and for
paged caches the page order, spare pages and stale block-table entries past each length. Caches
hold NaN past every length and outputs are poisoned with NaN first; each case is checked as the GPU
suite checks (`decode_checks.check_close`: every element within its bound, no NaN where the
reference is finite, lse exact to its bound). A failing case is reported with everything needed to
replay it (its seed) and the run goes on; the exit status is 1 if any case failed.

``--workers N`` runs N processes, each with its share of the programs (their compiles then run in
parallel too). The GPU suite runs a slice of this (tests/gpu/test_fuzz_gpu.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import sys
import time
import traceback
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for folder in (_HERE, _HERE.parent, _HERE.parent.parent):  # decode_checks, seeds, splitkv
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import numpy as np  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Program:
    """The compile-time half of a case."""

    head_dim: int
    group: int
    kv_dtype: str = "bf16"
    q_dtype: str = "bf16"
    page_size: int | None = None
    kv_layout: str = "NHD"

    @property
    def name(self) -> str:
        cache = f"p{self.page_size}-{self.kv_layout}" if self.page_size else "contiguous"
        return f"d{self.head_dim}-g{self.group}-{self.q_dtype}-{self.kv_dtype}-{cache}"


#: Every group 1-16 appears, every head_dim, K/V dtype, both page layouts and page sizes 1-256.
PROGRAMS = (
    Program(64, 1), Program(64, 8), Program(96, 4), Program(96, 7), Program(128, 1), Program(128, 3),
    Program(128, 4), Program(128, 8), Program(128, 16), Program(256, 2), Program(256, 8), Program(128, 5),
    Program(64, 6, q_dtype="fp16", kv_dtype="fp16"), Program(128, 4, q_dtype="fp16", kv_dtype="fp16"),
    Program(128, 4, kv_dtype="fp8_e4m3"), Program(128, 8, kv_dtype="fp8_e4m3"), Program(96, 2, kv_dtype="fp8_e4m3"),
    Program(256, 1, kv_dtype="fp8_e4m3"), Program(128, 4, kv_dtype="nvfp4"), Program(64, 16, kv_dtype="nvfp4"),
    Program(256, 8, kv_dtype="nvfp4"), Program(128, 12),
    Program(128, 4, page_size=16), Program(128, 8, page_size=1, kv_layout="HND"), Program(64, 2, page_size=256),
    Program(256, 4, page_size=64, kv_layout="HND"), Program(96, 6, page_size=32), Program(128, 10, page_size=128),
    Program(128, 8, kv_dtype="fp8_e4m3", page_size=16, kv_layout="HND"),
    Program(128, 4, kv_dtype="nvfp4", page_size=64), Program(64, 14, page_size=8, kv_layout="HND"),
    Program(128, 2, page_size=2), Program(256, 1, page_size=4), Program(64, 9), Program(128, 11),
    Program(128, 13), Program(64, 15),
)

#: Lengths a case draws from besides uniform ones: empty, one token, around tiles (16-128 tokens),
#: pages, chunks and splits.
EDGE_LENGTHS = (0, 1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 1023,
                1024, 1025, 2047, 2048, 4095, 4096, 4097)
#: K/V elements a case's cache holds at most (batch x longest length x K/V heads x head_dim), so that
#: the caches and their float64 copies (about 2.6 GB at this bound) leave room for every worker.
MAX_CACHE_ELEMENTS = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class Case:
    """The run-time half, drawn from ``seed``."""

    program: Program
    seed: int
    num_kv_heads: int
    lens: tuple[int, ...]
    plan: dict
    return_lse: bool
    sm_scale: float | None
    q_scale: float

    def describe(self) -> str:
        lens = list(self.lens[:6]) + (["..."] if len(self.lens) > 6 else [])
        return (f"{self.program.name} Hkv={self.num_kv_heads} lens={lens} (B={len(self.lens)}) plan={self.plan} "
                f"lse={self.return_lse} sm_scale={self.sm_scale} q_scale={self.q_scale} seed={self.seed}")


def draw_case(program: Program, seed: int) -> Case:
    rng = np.random.default_rng(seed)
    num_kv = int(rng.choice([1, 1, 2, 3, 4, 8]))
    batch = int(rng.choice([1, 1, 2, 3, 5, 8, 13, 24, 64]))
    kind = rng.random()
    if kind < 0.4:
        lens = rng.choice(EDGE_LENGTHS, size=batch)
    elif kind < 0.8:
        lens = rng.integers(0, int(rng.choice([300, 3000, 20000])), size=batch)
    else:  # long rows beside short ones
        lens = np.where(rng.random(batch) < 0.3, rng.integers(20000, 70000, size=batch), rng.integers(0, 600, size=batch))
    lens = [int(n) for n in lens]
    while batch * (max(lens) + 37) * num_kv * program.head_dim > MAX_CACHE_ELEMENTS and max(lens) > 1:
        i = int(np.argmax(lens))  # the memory bound: shorten the longest
        lens[i] //= 2
    which = rng.random()
    if which < 0.45:
        plan = {}
    elif which < 0.6:
        plan = {"variant": "dense"}
    elif which < 0.8:
        plan = {"variant": "split", "num_splits": int(rng.choice([2, 3, 4, 7, 8, 16, 33]))}
    else:
        plan = {"variant": "units"}
    sm_scale = None if rng.random() < 0.7 else float(rng.uniform(0.01, 0.3))
    q_scale = float(rng.choice([1.0, 1.0, 4.0, 30.0]))
    return Case(program, seed, num_kv, tuple(lens), plan, bool(rng.random() < 0.5), sm_scale, q_scale)


class Runner:
    """Runs cases, one DecodeAttention per (program, K/V heads, scale) kept for the run."""

    def __init__(self):
        self._instances: dict = {}

    def _attention(self, case: Case):
        from splitkv import DecodeAttention

        p = case.program
        key = (p, case.num_kv_heads, case.sm_scale)
        if key not in self._instances:
            self._instances[key] = DecodeAttention(
                p.group * case.num_kv_heads, case.num_kv_heads, p.head_dim, q_dtype=p.q_dtype, kv_dtype=p.kv_dtype,
                sm_scale=case.sm_scale, page_size=p.page_size, kv_layout=p.kv_layout, tuned=False)
        return self._instances[key]

    def run(self, case: Case) -> None:
        """Raises AssertionError (or the library's error) when the case fails."""
        import cupy
        import splitkv
        from decode_checks import check_close, poisoned, random_values, reference
        from test_paged_decode_gpu import NAN_CODE, paged_pair

        p, lens = case.program, list(case.lens)
        batch, num_qo, dim = len(lens), p.group * case.num_kv_heads, p.head_dim
        max_len = max(max(lens), 1) + int(case.seed % 37)  # cache rows past every length
        q, q64 = random_values((batch, num_qo, dim), p.q_dtype, case.seed, case.q_scale)
        kv_store = "fp16" if p.kv_dtype == "fp16" else "bf16"
        k, k64 = random_values((batch, max_len, case.num_kv_heads, dim), kv_store, case.seed + 1)
        v, v64 = random_values((batch, max_len, case.num_kv_heads, dim), kv_store, case.seed + 2)
        if p.kv_dtype in ("fp8_e4m3", "nvfp4"):
            k, v = splitkv.quantize_kv(k, p.kv_dtype), splitkv.quantize_kv(v, p.kv_dtype)
            k64, v64 = cupy.asarray(k.dequantize_reference()), cupy.asarray(v.dequantize_reference())
        elif p.page_size is None:  # NaN past every length (paged caches: paged_pair puts it there)
            nan_bits = NAN_CODE["bf16"] if kv_store == "bf16" else int(np.float16(np.nan).view(np.uint16))
            for b, n in enumerate(lens):
                k.view(cupy.uint16)[b, n:] = nan_bits
                v.view(cupy.uint16)[b, n:] = nan_bits
        block_table = None
        if p.page_size is not None:
            rng = np.random.default_rng(case.seed + 3)
            k, v, table = paged_pair(k, v, lens, p.page_size, p.kv_layout, rng, p.kv_dtype)
            block_table = cupy.asarray(table) if rng.random() < 0.5 else table
        attn = self._attention(case)
        attn.plan(lens, block_table=block_table, **case.plan)
        out = poisoned((batch, num_qo, dim), p.q_dtype)
        lse = cupy.full((batch, num_qo), cupy.nan, dtype=cupy.float32) if case.return_lse else None
        result = attn.run(q, k, v, out=out, lse=lse, return_lse=case.return_lse)
        if case.return_lse:
            assert result[0] is out and result[1] is lse
        sm_scale = case.sm_scale if case.sm_scale is not None else 1.0 / math.sqrt(dim)
        ref_out, ref_lse = reference(q64, k64, v64, lens, sm_scale)
        check_close(out, lse, ref_out, ref_lse if case.return_lse else None, lens, p.q_dtype,
                    f"{case.describe()} {attn.plan_info}")


def run_cases(programs, count: int, seed: int, *, progress=None) -> dict:
    """``count`` cases over ``programs`` from ``seed``: a summary with every failure described."""
    import contextlib
    import io

    runner, failures, per_program = Runner(), [], {}
    draw = np.random.default_rng(seed)
    start = time.perf_counter()
    for i in range(count):
        program = programs[int(draw.integers(len(programs)))]
        case = draw_case(program, int(draw.integers(2**31)))
        per_program[program.name] = per_program.get(program.name, 0) + 1
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # check_close prints each case's errors
                runner.run(case)
        except Exception as e:  # noqa: BLE001 - every failure is recorded, and the run goes on
            failures.append({"case": case.describe(), "error": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc(limit=4)})
        _release_memory()  # the case's arrays: workers share the GPU's memory
        if progress is not None and (i + 1) % max(count // 10, 1) == 0:
            progress(f"{i + 1}/{count} cases, {len(failures)} failed, {time.perf_counter() - start:.0f} s")
    return {"cases": count, "failed": len(failures), "failures": failures, "per_program": per_program,
            "seconds": round(time.perf_counter() - start, 1)}


def _release_memory() -> None:
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()


def _worker(args) -> dict:
    index, workers, count, seed = args
    programs = PROGRAMS[index::workers]
    label = f"worker {index}"
    return run_cases(programs, count, seed + index, progress=lambda line: print(f"{label}: {line}", flush=True))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="cases in all (default 2000)")
    parser.add_argument("--seed", type=int, default=None, help="the run's seed (default: a fresh one, printed)")
    parser.add_argument("--workers", type=int, default=8, help="processes, each with its share of the programs "
                                                                "(default 8)")
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args(argv)
    if args.cases < 1 or args.workers < 1:
        parser.error("--cases and --workers: expected positive counts")
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    workers = min(args.workers, len(PROGRAMS))
    shares = [args.cases // workers + (i < args.cases % workers) for i in range(workers)]
    print(f"fuzz: {args.cases} cases over {len(PROGRAMS)} programs, {workers} workers, seed {seed}", flush=True)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.map(_worker, [(i, workers, shares[i], seed) for i in range(workers)])
    summary = {"seed": seed, "cases": sum(r["cases"] for r in results), "failed": sum(r["failed"] for r in results),
               "programs": len(PROGRAMS), "seconds": max(r["seconds"] for r in results),
               "failures": [f for r in results for f in r["failures"]],
               "per_program": {k: n for r in results for k, n in r["per_program"].items()}}
    for failure in summary["failures"][:20]:
        print(f"FAILED {failure['case']}\n  {failure['error'][:2000]}", flush=True)
    print(f"fuzz: {summary['cases']} cases, {summary['failed']} failed, {summary['seconds']} s (seed {seed})")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
