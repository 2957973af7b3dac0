"""Host time of `DecodeAttention.run()` and `plan()`, per kind of plan and input (needs a GPU).

run(): the median of ``--calls`` calls with ``out=`` given (and ``lse=`` where asked), each call
timed alone on the host with `time.perf_counter_ns`; what an eager caller pays per layer before its
kernel is enqueued. Kernels are kept short (small caches) and the queue is drained between blocks of
calls, outside the timed region, so that no call waits for the GPU's launch queue.
plan(): the median of ``--plan-calls`` calls with host lengths (a serving step's plan).
decode(): where a case has one, the median of ``--plan-calls`` one-shot calls on the same inputs
and lengths with ``out=`` given, and what it costs beyond a plan() and a run() made as one call
(timed in alternating blocks with it, so that the host's drift cancels).

    python bench/host_time.py                       # every case
    python bench/host_time.py --calls 1000 --json out.json
    python bench/host_time.py --cases bf16-cupy,fp8-torch
    python bench/host_time.py --markdown out.json   # BENCHMARKS.md's table of a results file (no GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

#: Calls between two drains of the GPU's queue (a drain is not timed).
_BLOCK = 100


def _case_table():
    """name -> (description, builder): each builder returns (attn, run_call, plan_call, decode_call
    or None)."""
    return {
        "bf16-cupy": ("contiguous BF16, CuPy, 1 x 4k, 32/8 x 128 (split)", lambda: _contiguous("cupy")),
        "bf16-torch": ("contiguous BF16, torch, 1 x 4k, 32/8 x 128 (split)", lambda: _contiguous("torch")),
        "bf16-dense-torch": ("contiguous BF16, torch, 64 x 256, 32/8 x 128 (dense)",
                             lambda: _contiguous("torch", batch=64, length=256)),
        "bf16-lse-torch": ("contiguous BF16, torch, 1 x 4k, with lse", lambda: _contiguous("torch", lse=True)),
        "paged-cupy": ("paged BF16 NHD pages of 16, CuPy, 4 x 2k", lambda: _paged("cupy")),
        "paged-torch": ("paged BF16 NHD pages of 16, torch, 4 x 2k", lambda: _paged("torch")),
        "fp8-torch": ("FP8 E4M3 cache, torch, 1 x 4k", lambda: _quantized("fp8_e4m3")),
        "nvfp4-torch": ("NVFP4 cache, torch, 1 x 4k", lambda: _quantized("nvfp4")),
        "units-torch": ("work units, torch, 8k + 7 x 256 (ragged)", _units),
    }


def _bf16(kind: str, shape, rng):
    """bf16 data of ``shape`` as ``kind`` arrays ('cupy': uint16 bits, 'torch': torch.bfloat16)."""
    import cupy

    x = rng.standard_normal(shape, dtype=np.float32)
    if kind == "torch":
        import torch

        return torch.from_numpy(x).to("cuda", torch.bfloat16)
    bits = (x.view(np.uint32) + 0x8000 >> 16).astype(np.uint16)
    return cupy.asarray(bits)


def _empty_like(kind: str, x):
    if kind == "torch":
        import torch

        return torch.empty_like(x)
    import cupy

    return cupy.empty_like(x)


def _lse_for(kind: str, q):
    if kind == "torch":
        import torch

        return torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    import cupy

    return cupy.empty(q.shape[:2], dtype=cupy.float32)


def _contiguous(kind: str, *, batch: int = 1, length: int = 4096, lse: bool = False):
    from splitkv import DecodeAttention

    rng = np.random.default_rng(0)
    hq, hkv, d = 32, 8, 128
    q = _bf16(kind, (batch, hq, d), rng)
    k = _bf16(kind, (batch, length, hkv, d), rng)
    v = _bf16(kind, (batch, length, hkv, d), rng)
    attn = DecodeAttention(hq, hkv, d)
    lens = [length] * batch
    attn.plan(lens)
    out = _empty_like(kind, q)
    lse_buf = _lse_for(kind, q) if lse else None
    from splitkv import decode

    decode_call = None if lse else (lambda: decode(q, k, v, lens, out=out))
    return (attn, (lambda: attn.run(q, k, v, out=out, lse=lse_buf, return_lse=lse)), (lambda: attn.plan(lens)),
            decode_call)


def _paged(kind: str, *, batch: int = 4, length: int = 2048, page: int = 16):
    from splitkv import DecodeAttention

    rng = np.random.default_rng(0)
    hq, hkv, d = 32, 8, 128
    pages = batch * length // page
    q = _bf16(kind, (batch, hq, d), rng)
    k = _bf16(kind, (pages, page, hkv, d), rng)
    v = _bf16(kind, (pages, page, hkv, d), rng)
    table = rng.permutation(pages).astype(np.int32).reshape(batch, length // page)
    attn = DecodeAttention(hq, hkv, d, page_size=page)
    lens = [length] * batch
    attn.plan(lens, block_table=table)
    out = _empty_like(kind, q)
    from splitkv import decode

    return (attn, (lambda: attn.run(q, k, v, out=out)), (lambda: attn.plan(lens, block_table=table)),
            (lambda: decode(q, k, v, lens, block_table=table, out=out)))


def _quantized(kv_dtype: str, *, length: int = 4096):
    import splitkv

    rng = np.random.default_rng(0)
    hq, hkv, d = 32, 8, 128
    q = _bf16("torch", (1, hq, d), rng)
    k = splitkv.quantize_kv(_bf16("torch", (1, length, hkv, d), rng), kv_dtype)
    v = splitkv.quantize_kv(_bf16("torch", (1, length, hkv, d), rng), kv_dtype)
    attn = splitkv.DecodeAttention(hq, hkv, d, kv_dtype=kv_dtype)
    attn.plan([length])
    out = _empty_like("torch", q)
    return attn, (lambda: attn.run(q, k, v, out=out)), (lambda: attn.plan([length])), None


def _units():
    from splitkv import DecodeAttention

    rng = np.random.default_rng(0)
    hq, hkv, d = 32, 8, 128
    lens = [8192] + [256] * 7
    q = _bf16("torch", (len(lens), hq, d), rng)
    k = _bf16("torch", (len(lens), max(lens), hkv, d), rng)
    v = _bf16("torch", (len(lens), max(lens), hkv, d), rng)
    attn = DecodeAttention(hq, hkv, d)
    attn.plan(lens, variant="units")
    out = _empty_like("torch", q)
    return attn, (lambda: attn.run(q, k, v, out=out)), (lambda: attn.plan(lens, variant="units")), None


def _drain():
    import cupy

    cupy.cuda.Device().synchronize()
    try:
        import torch

        torch.cuda.synchronize()
    except ImportError:
        pass


def time_calls(call, calls: int) -> list[float]:
    """Host µs of each of ``calls`` calls, the queue drained every `_BLOCK` calls outside the timing."""
    times = []
    for start in range(0, calls, _BLOCK):
        _drain()
        for _ in range(min(_BLOCK, calls - start)):
            t0 = time.perf_counter_ns()
            call()
            times.append((time.perf_counter_ns() - t0) / 1e3)
    _drain()
    return times


def measure(name: str, builder, calls: int, plan_calls: int) -> dict:
    attn, run_call, plan_call, decode_call = builder()
    for _ in range(20):  # warm-up: the first run validates the layout in full
        run_call()
    _drain()
    run_times = time_calls(run_call, calls)
    plan_times = time_calls(plan_call, plan_calls)
    run_call()  # the plan after the last timed plan() still runs
    _drain()
    result = {"case": name, "plan_info": attn.plan_info,
              "run_us_median": statistics.median(run_times), "run_us_p90": float(np.percentile(run_times, 90)),
              "plan_us_median": statistics.median(plan_times), "plan_us_p90": float(np.percentile(plan_times, 90))}
    if decode_call is not None:
        def plan_and_run():
            plan_call()
            run_call()
        for _ in range(20):  # warm-up: its instance compiles and validates once
            decode_call()
            plan_and_run()
        decode_times, pair_times = [], []
        for _ in range(max(plan_calls // 20, 1)):  # alternating blocks of 20 calls
            decode_times += time_calls(decode_call, 20)
            pair_times += time_calls(plan_and_run, 20)
        result["decode_us_median"] = statistics.median(decode_times)
        result["plan_run_us_median"] = statistics.median(pair_times)
        result["decode_beyond_us"] = result["decode_us_median"] - result["plan_run_us_median"]
    return result


def markdown(result: dict) -> str:
    """The table BENCHMARKS.md shows of one results file."""
    lines = ["| case | run() µs | p90 | plan() µs | p90 | decode() µs | beyond plan() + run() |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["results"]:
        decode = (f"{r['decode_us_median']:.0f} | {r['decode_beyond_us']:+.0f}" if "decode_us_median" in r
                  else "– | –")
        lines.append(f"| {r['description']} | {r['run_us_median']:.1f} | {r['run_us_p90']:.1f} | "
                     f"{r['plan_us_median']:.0f} | {r['plan_us_p90']:.0f} | {decode} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    table = _case_table()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000, help="run() calls timed per case")
    parser.add_argument("--plan-calls", type=int, default=200, help="plan() calls timed per case")
    parser.add_argument("--cases", default=",".join(table), help=f"comma-separated, of {', '.join(table)}")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--markdown", metavar="JSON", help="print the table of a results file and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)))
        return 0
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in table]
    if unknown or not names:
        parser.error(f"--cases: unknown {unknown}; expected some of {', '.join(table)}")
    if args.calls < 1 or args.plan_calls < 1:
        parser.error("--calls and --plan-calls: expected positive ints")
    results = []
    print(f"{'case':18s} {'run() µs':>9s} {'p90':>6s} {'plan() µs':>10s} {'p90':>7s} {'decode()':>9s} {'beyond':>7s}  plan")
    for name in names:
        description, builder = table[name]
        try:
            r = measure(name, builder, args.calls, args.plan_calls)
        except ImportError as e:  # torch missing: the torch cases are skipped, the CuPy ones still run
            print(f"{name:18s} skipped: {e}")
            continue
        r["description"] = description
        results.append(r)
        decode = (f"{r['decode_us_median']:9.1f} {r['decode_beyond_us']:+7.1f}" if "decode_us_median" in r
                  else f"{'-':>9s} {'-':>7s}")
        print(f"{name:18s} {r['run_us_median']:9.1f} {r['run_us_p90']:6.1f} {r['plan_us_median']:10.1f} "
              f"{r['plan_us_p90']:7.1f} {decode}  {r['plan_info']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calls": args.calls, "plan_calls": args.plan_calls, "python": sys.version.split()[0],
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
