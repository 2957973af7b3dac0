"""Probe: does the timing protocol itself move the short figures?

The peers' anchors were timed with `triton.testing.do_bench` on torch's default (legacy) stream;
`splitkv.bench` times on a stream it creates. Both flush the L2 with a 256 MiB memset and put
CUDA events around the call. This times the same calls (an empty kernel, plain reads of 4, 16 and
256 MiB, splitkv and cuDNN SDPA at a few shapes) three ways in one process, each protocol twice in
the order A B C C B A, so that an order effect shows up as a difference between the two passes:

  A  `splitkv.bench.Harness` as the benchmark uses it (a stream created by torch);
  B  the same harness on torch's default stream;
  C  `triton.testing.do_bench(..., return_mode="median")` on torch's default stream.

    python bench/protocol_probe.py [--iters 100]
"""
import argparse
import statistics

import torch
import triton.testing

from splitkv import timing
from splitkv.bench import cases, inputs, peers, shapes

SHAPES = ["1:32:8:128:1k", "1:32:8:128:4k", "1:32:8:128:64k"]
FLUSH_BYTES = 256 << 20


def calls(torch_mod):
    """(label, no-argument launch) for everything the probe times; all on the current stream."""
    reads = floor.ReadFloor(256 << 20)
    out = [("empty kernel", reads.empty())]
    for mib in (4, 16, 256):
        out.append((f"read {mib} MiB", reads.reader(mib << 20)))
    keep = []
    for token in SHAPES:
        shape = bench.parse_shape(token)
        inputs = bench.Inputs(shape, seed=1, torch_mod=torch_mod)
        keep.append(inputs)
        case = bench.splitkv_case(inputs)
        out.append((f"splitkv {shape.label}", case.fn))
        sdpa = bench.sdpa_case(inputs, "CUDNN_ATTENTION")

        def cudnn(fn=sdpa.fn, ctx=sdpa.context):
            with ctx():
                fn()

        out.append((f"cuDNN {shape.label}", cudnn))
    return out, keep


def harness_on(stream_kind: str, iters: int) -> bench.Harness:
    harness = bench.Harness(iters=iters, warmup=10, flush_bytes=FLUSH_BYTES, torch_mod=torch)
    if stream_kind == "default":
        harness.torch_stream = torch.cuda.default_stream()
        harness.stream = bench._cupy_view_of(harness.cupy, harness.torch_stream)
    harness.flush_us = harness.flush_time_us()
    return harness


def time_harness(harness, fn) -> float:
    with harness.active():
        return statistics.median(harness.time(fn))


def time_do_bench(fn) -> float:
    with torch.cuda.stream(torch.cuda.default_stream()):
        return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    items, _keep = calls(torch)
    for _, fn in items:  # compile and JIT-build outside timing
        fn()
    torch.cuda.synchronize()
    created = harness_on("created", args.iters)
    default = harness_on("default", args.iters)
    order = ["A", "B", "C", "C", "B", "A"]
    rows = {label: {} for label, _ in items}
    for n, proto in enumerate(order):
        key = f"{proto}{1 if n < 3 else 2}"
        for label, fn in items:
            if proto == "A":
                rows[label][key] = time_harness(created, fn)
            elif proto == "B":
                rows[label][key] = time_harness(default, fn)
            else:
                rows[label][key] = time_do_bench(fn)
    keys = ["A1", "A2", "B1", "B2", "C1", "C2"]
    print(f"{'call':32s}" + "".join(f"{k:>9s}" for k in keys) + "   (µs, median)")
    for label, _ in items:
        print(f"{label:32s}" + "".join(f"{rows[label][k]:9.2f}" for k in keys))


if __name__ == "__main__":
    main()
