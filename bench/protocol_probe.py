"""Probe: does the timing harness itself move the short figures?

Figures published for other libraries are often taken with `triton.testing.do_bench` on torch's
default (legacy) stream; the benchmark's flush protocol times on a stream it creates
(`splitkv.timing.Harness`). Both flush the L2 with a 256 MiB buffer and put CUDA events around the
call. This times the same calls (an empty kernel, plain reads of 4, 16 and 256 MiB, splitkv and
cuDNN SDPA at a few shapes) three ways in one process, each harness twice in the order
A B C C B A, so that an order effect shows up as a difference between the two passes:

  A  `splitkv.timing.Harness` as the benchmark uses it (a stream created by torch);
  B  the same harness on torch's default stream;
  C  `triton.testing.do_bench(..., return_mode="median")` on torch's default stream.

What it found is in docs/experiments.md ("Three harnesses agree"). Needs a GPU, CuPy, torch and
triton.

    python bench/protocol_probe.py [--iters 100]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

SHAPES = ["1:32:8:128:1k", "1:32:8:128:4k", "1:32:8:128:64k"]
FLUSH_BYTES = 256 << 20
WARMUP = 10


def calls(torch):
    """(label, no-argument launch, context-manager factory or None) for everything the probe
    times, each on the current stream, and what the launches read (kept alive by the caller).
    splitkv's and SDPA's outputs are checked against the float64 reference before any timing."""
    import splitkv
    from splitkv import timing
    from splitkv.bench.cases import Unavailable, splitkv_case
    from splitkv.bench.inputs import Layers, check
    from splitkv.bench.peers import sdpa_case
    from splitkv.bench.shapes import parse_shape

    floor = timing.ReadFloor(256 << 20)
    items = [("empty kernel", floor.empty(), None)]
    items += [(f"read {mib} MiB", floor.reader(mib << 20), None) for mib in (4, 16, 256)]
    keep = [floor]
    for token in SHAPES:
        shape = parse_shape(token)
        layers = Layers(shape, 1, seed=1, torch_mod=torch)
        for name, make in (("splitkv", lambda: splitkv_case(splitkv, layers)),
                           ("cuDNN", lambda: sdpa_case(layers, "CUDNN_ATTENTION"))):
            try:
                case = make()
            except Unavailable as exc:
                print(f"{name} {shape.label}: not timed ({exc})", flush=True)
                continue
            call, context = case.calls[0], case.context
            with _within(context):
                call()
            torch.cuda.synchronize()
            verdict = check(case.outputs(), case.reference or layers.reference(), case.tolerance)
            if not verdict["ok"]:
                raise SystemExit(f"{name} {shape.label}: wrong output ({verdict})")
            items.append((f"{name} {shape.label}", call, context))
            keep.append(case)
        keep.append(layers)
    return items, keep


def _within(context):
    return context() if context is not None else contextlib.nullcontext()


def harness_on(stream_kind: str, iters: int, torch):
    """The benchmark's harness; on torch's default stream instead of its own when ``stream_kind``
    is 'default'."""
    import cupy

    from splitkv import timing

    harness = timing.Harness(iters, WARMUP, FLUSH_BYTES, torch)
    if stream_kind == "default":
        harness.torch_stream = torch.cuda.default_stream()
        harness.stream = timing.cupy_stream_of(cupy, harness.torch_stream)
    with harness.active():
        harness.flush_us = harness.flush_time_us()
    return harness


def time_harness(harness, fn, context) -> float:
    with harness.active():
        return statistics.median(harness.time(fn, context=context))


def time_do_bench(fn, context, torch) -> float:
    """do_bench's median in µs, on torch's default stream (CuPy's launches too)."""
    import cupy
    import triton.testing

    from splitkv import timing

    default = torch.cuda.default_stream()
    with torch.cuda.stream(default), timing.cupy_stream_of(cupy, default), _within(context):
        return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=100, help="timed calls per figure (harnesses A and B)")
    args = parser.parse_args(argv)

    import torch

    items, _keep = calls(torch)  # compiled, JIT-built and checked outside timing
    created = harness_on("created", args.iters, torch)
    default = harness_on("default", args.iters, torch)
    order = ["A", "B", "C", "C", "B", "A"]
    rows = {label: {} for label, _, _ in items}
    for n, harness in enumerate(order):
        key = f"{harness}{1 if n < 3 else 2}"
        for label, fn, context in items:
            if harness == "A":
                rows[label][key] = time_harness(created, fn, context)
            elif harness == "B":
                rows[label][key] = time_harness(default, fn, context)
            else:
                rows[label][key] = time_do_bench(fn, context, torch)
    keys = ["A1", "A2", "B1", "B2", "C1", "C2"]
    print(f"{'call':32s}" + "".join(f"{k:>9s}" for k in keys) + "   (µs, median)")
    for label, _, _ in items:
        print(f"{label:32s}" + "".join(f"{rows[label][k]:9.2f}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
