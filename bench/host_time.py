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
    python bench/host_time.py --baseline ../older-checkout      # run() and plan() of both, alternating
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
    """name -> (description, builder): each builder takes a splitkv package (this tree's or a
    baseline checkout's) and returns (attn, run_call, plan_call, decode_call or None)."""
    return {
        "bf16-cupy": ("contiguous BF16, CuPy, 1 x 4k, 32/8 x 128 (split)", lambda sk: _contiguous(sk, "cupy")),
        "bf16-torch": ("contiguous BF16, torch, 1 x 4k, 32/8 x 128 (split)", lambda sk: _contiguous(sk, "torch")),
        "bf16-dense-torch": ("contiguous BF16, torch, 64 x 256, 32/8 x 128 (dense)",
                             lambda sk: _contiguous(sk, "torch", batch=64, length=256)),
        "bf16-lse-torch": ("contiguous BF16, torch, 1 x 4k, with lse", lambda sk: _contiguous(sk, "torch", lse=True)),
        "paged-cupy": ("paged BF16 NHD pages of 16, CuPy, 4 x 2k", lambda sk: _paged(sk, "cupy")),
        "paged-torch": ("paged BF16 NHD pages of 16, torch, 4 x 2k", lambda sk: _paged(sk, "torch")),
        "fp8-torch": ("FP8 E4M3 cache, torch, 1 x 4k", lambda sk: _quantized(sk, "fp8_e4m3")),
        "nvfp4-torch": ("NVFP4 cache, torch, 1 x 4k", lambda sk: _quantized(sk, "nvfp4")),
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


def _contiguous(sk, kind: str, *, batch: int = 1, length: int = 4096, lse: bool = False):
    rng = np.random.default_rng(0)
    hq, hkv, d = 32, 8, 128
    q = _bf16(kind, (batch, hq, d), rng)
    k = _bf16(kind, (batch, length, hkv, d), rng)
    v = _bf16(kind, (batch, length, hkv, d), rng)
    attn = sk.DecodeAttention(hq, hkv, d)
    lens = [length] * batch
    attn.plan(lens)
    out = _empty_like(kind, q)
    lse_buf = _lse_for(kind, q) if lse else None
    decode_call = None if lse else (lambda: sk.decode(q, k, v, lens, out=out))
    return (attn, (lambda: attn.run(q, k, v, out=out, lse=lse_buf, return_lse=lse)), (lambda: attn.plan(lens)),
            decode_call)


def _paged(sk, kind: str, *, batch: int = 4, length: int = 2048, page: int = 16):
    rng = np.random.default_rng(0)
    hq, hkv, d = 32, 8, 128
    pages = batch * length // page
    q = _bf16(kind, (batch, hq, d), rng)
    k = _bf16(kind, (pages, page, hkv, d), rng)
    v = _bf16(kind, (pages, page, hkv, d), rng)
    table = rng.permutation(pages).astype(np.int32).reshape(batch, length // page)
    attn = sk.DecodeAttention(hq, hkv, d, page_size=page)
    lens = [length] * batch
    attn.plan(lens, block_table=table)
    out = _empty_like(kind, q)
    return (attn, (lambda: attn.run(q, k, v, out=out)), (lambda: attn.plan(lens, block_table=table)),
            (lambda: sk.decode(q, k, v, lens, block_table=table, out=out)))


def _quantized(sk, kv_dtype: str, *, length: int = 4096):
    rng = np.random.default_rng(0)
    hq, hkv, d = 32, 8, 128
    q = _bf16("torch", (1, hq, d), rng)
    k = sk.quantize_kv(_bf16("torch", (1, length, hkv, d), rng), kv_dtype)
    v = sk.quantize_kv(_bf16("torch", (1, length, hkv, d), rng), kv_dtype)
    attn = sk.DecodeAttention(hq, hkv, d, kv_dtype=kv_dtype)
    attn.plan([length])
    out = _empty_like("torch", q)
    return attn, (lambda: attn.run(q, k, v, out=out)), (lambda: attn.plan([length])), None


def _units(sk):
    rng = np.random.default_rng(0)
    hq, hkv, d = 32, 8, 128
    lens = [8192] + [256] * 7
    q = _bf16("torch", (len(lens), hq, d), rng)
    k = _bf16("torch", (len(lens), max(lens), hkv, d), rng)
    v = _bf16("torch", (len(lens), max(lens), hkv, d), rng)
    attn = sk.DecodeAttention(hq, hkv, d)
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
    return time_alternating([call], calls)[0]


def time_alternating(calls_by_side: list, calls: int, block: int = _BLOCK) -> list[list[float]]:
    """`time_calls` of each side's call, ``calls`` each, in blocks of ``block`` calls taken in
    alternating order (ABBA), so that the host's drift falls on every side alike."""
    times = [[] for _ in calls_by_side]
    for i, start in enumerate(range(0, calls, block)):
        order = range(len(calls_by_side)) if i % 2 == 0 else reversed(range(len(calls_by_side)))
        for side in order:
            call, side_times = calls_by_side[side], times[side]
            _drain()
            for _ in range(min(block, calls - start)):
                t0 = time.perf_counter_ns()
                call()
                side_times.append((time.perf_counter_ns() - t0) / 1e3)
    _drain()
    return times


def host_yardstick(calls: int) -> dict:
    """What this host charges any caller, timed as run() is: one driver launch of an empty kernel
    (CuPy's binding of cuLaunchKernel, as run() launches) and, where torch is installed, one
    ``torch.add(a, b, out=c)`` of 16 floats (a framework's own kernel call). run() pays the first
    once per program it launches."""
    import cupy
    from cupy_backends.cuda.api import driver

    function = cupy.RawKernel('extern "C" __global__ void empty(long long unused) {}', "empty").kernel
    value = np.zeros(1, np.int64)
    argument = np.array([value.ctypes.data], np.uint64)
    stream = cupy.cuda.get_current_stream().ptr
    figures = {"empty_launch_us": statistics.median(time_calls(
        lambda: driver.launchKernel(function.ptr, 1, 1, 1, 32, 1, 1, 0, stream, argument.ctypes.data, 0), calls))}
    try:
        import torch
    except ImportError:
        return figures
    a, b, c = (torch.zeros(16, device="cuda") for _ in range(3))
    figures["torch_add_us"] = statistics.median(time_calls(lambda: torch.add(a, b, out=c), calls))
    return figures


def _figures(prefix: str, times: list[float]) -> dict:
    return {f"{prefix}_us_median": statistics.median(times), f"{prefix}_us_p90": float(np.percentile(times, 90))}


def measure(name: str, builder, calls: int, plan_calls: int, baseline=None) -> dict:
    """The case's figures; with ``baseline`` (a `Checkout`) its run() and plan() too, timed in
    alternating blocks with this tree's."""
    import splitkv

    sides = [builder(splitkv)]
    if baseline is not None:
        with baseline.active():  # its programs compile from its own templates
            sides.append(builder(baseline.module))
    for attn, run_call, _, _ in sides:
        for _ in range(20):  # warm-up: the first run validates the layout in full
            run_call()
    _drain()
    run_times = time_alternating([side[1] for side in sides], calls)
    plan_times = time_alternating([side[2] for side in sides], plan_calls)
    for _, run_call, _, _ in sides:
        run_call()  # the plan after the last timed plan() still runs
    _drain()
    attn, run_call, plan_call, decode_call = sides[0]
    result = {"case": name, "plan_info": attn.plan_info, **_figures("run", run_times[0]),
              **_figures("plan", plan_times[0])}
    if baseline is not None:
        result.update(_figures("baseline_run", run_times[1]), **_figures("baseline_plan", plan_times[1]))
        result["baseline_plan_info"] = sides[1][0].plan_info
    if decode_call is not None:
        def plan_and_run():
            plan_call()
            run_call()
        for _ in range(20):  # warm-up: its instance compiles and validates once
            decode_call()
            plan_and_run()
        decode_times, pair_times = time_alternating([decode_call, plan_and_run], plan_calls, block=20)
        result["decode_us_median"] = statistics.median(decode_times)
        result["plan_run_us_median"] = statistics.median(pair_times)
        result["decode_beyond_us"] = result["decode_us_median"] - result["plan_run_us_median"]
    return result


def markdown(result: dict) -> str:
    """The table BENCHMARKS.md shows of one results file (with a baseline's run() where it has one)."""
    baseline = result.get("baseline")
    extra = f" {baseline['commit']} run() µs | new/old |" if baseline else ""
    lines = ["| case | run() µs | p90 |" + extra + " plan() µs | p90 | decode() µs | beyond plan() + run() |",
             "|---|---:|---:|" + ("---:|---:|" if baseline else "") + "---:|---:|---:|---:|"]
    for r in result["results"]:
        decode = (f"{r['decode_us_median']:.0f} | {r['decode_beyond_us']:+.0f}" if "decode_us_median" in r
                  else "– | –")
        old = (f" {r['baseline_run_us_median']:.1f} | {r['run_us_median'] / r['baseline_run_us_median']:.2f} |"
               if baseline else "")
        lines.append(f"| {r['description']} | {r['run_us_median']:.1f} | {r['run_us_p90']:.1f} |{old} "
                     f"{r['plan_us_median']:.0f} | {r['plan_us_p90']:.0f} | {decode} |")
    yardstick = result.get("host_yardstick")
    if yardstick:
        torch_add = (f"; `torch.add(a, b, out=c)` of 16 floats {yardstick['torch_add_us']:.1f} µs"
                     if "torch_add_us" in yardstick else "")
        lines += ["", f"The same host, timed alike: one driver launch of an empty kernel "
                      f"{yardstick['empty_launch_us']:.1f} µs{torch_add}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    table = _case_table()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000, help="run() calls timed per case")
    parser.add_argument("--plan-calls", type=int, default=200, help="plan() calls timed per case")
    parser.add_argument("--cases", default=",".join(table), help=f"comma-separated, of {', '.join(table)}")
    parser.add_argument("--baseline", metavar="DIR", help="another checkout of the project (a git worktree, or "
                        "a git archive with a COMMIT file) whose run() and plan() are timed in alternating "
                        "blocks with this tree's")
    parser.add_argument("--baseline-commit", help="the baseline's commit, where its directory cannot say")
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
    baseline = None
    if args.baseline:
        from splitkv.bench.checkout import Checkout, CheckoutError

        try:
            baseline = Checkout(args.baseline, "splitkv_baseline", args.baseline_commit)
        except CheckoutError as e:
            parser.error(f"--baseline: {e}")
    yardstick = host_yardstick(args.calls)
    print("this host: " + ", ".join(f"{k} {v:.1f}" for k, v in yardstick.items()))
    results = []
    old = f" {'baseline':>9s}" if baseline else ""
    print(f"{'case':18s} {'run() µs':>9s} {'p90':>6s}{old} {'plan() µs':>10s} {'p90':>7s} {'decode()':>9s} "
          f"{'beyond':>7s}  plan")
    for name in names:
        description, builder = table[name]
        try:
            r = measure(name, builder, args.calls, args.plan_calls, baseline)
        except ImportError as e:  # torch missing: the torch cases are skipped, the CuPy ones still run
            print(f"{name:18s} skipped: {e}")
            continue
        r["description"] = description
        results.append(r)
        decode = (f"{r['decode_us_median']:9.1f} {r['decode_beyond_us']:+7.1f}" if "decode_us_median" in r
                  else f"{'-':>9s} {'-':>7s}")
        old = f" {r['baseline_run_us_median']:9.1f}" if baseline else ""
        print(f"{name:18s} {r['run_us_median']:9.1f} {r['run_us_p90']:6.1f}{old} {r['plan_us_median']:10.1f} "
              f"{r['plan_us_p90']:7.1f} {decode}  {r['plan_info']}", flush=True)
    if args.json:
        record = {"calls": args.calls, "plan_calls": args.plan_calls, "python": sys.version.split()[0],
                  "host_yardstick": yardstick, "results": results}
        if baseline is not None:
            record["baseline"] = baseline.describe()
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
