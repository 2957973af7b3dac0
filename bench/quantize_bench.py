"""Time the K/V quantizer under the benchmark's protocol: a whole cache, and one decode step's append.

Per case the median µs over calls with the L2 flushed before each, the bytes read and written per
second, and that against the device copy bandwidth measured in the same run. ``check=False`` with
a status array, as inside a decode step (no host wait). Needs a GPU and CuPy.

    python bench/quantize_bench.py [--iters 100]
"""

from __future__ import annotations

import argparse

import numpy as np

from splitkv import kv_formats, quantize_kv
from splitkv.timing import DeviceCopy, Harness, gbps, summarize

#: (label, batch, tokens, num_kv_heads, head_dim, cache rows, append): a whole cache, then appends.
CASES = [
    ("cache 1 x 64k x 8 x 128", 1, 65536, 8, 128, 65536, False),
    ("cache 16 x 4k x 8 x 128", 16, 4096, 8, 128, 4096, False),
    ("append 64 seqs x 1 token x 8 x 128", 64, 1, 8, 128, 4096, True),
    ("append 256 seqs x 1 token x 8 x 128", 256, 1, 8, 128, 1024, True),
]


def main(argv=None) -> None:
    import cupy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args(argv)
    harness = Harness(args.iters, 10, 256 << 20)  # the benchmark's default flush (--flush-mb 256)
    with harness.active():
        harness.flush_us = harness.flush_time_us()
        copier = DeviceCopy(1 << 30)
        copy_us = summarize(harness.time(copier))["median_us"]
        copy_gbps = gbps(copier.bytes_moved, copy_us)
        print(f"copy bandwidth {copy_gbps:.0f} GB/s (read + written)")
        print(f"{'case':38} {'format':9} {'µs':>9} {'GB/s':>7} {'% copy':>7}")
        status = cupy.zeros(1, cupy.int32)
        for label, batch, tokens, heads, head_dim, rows, append in CASES:
            gen = cupy.random.default_rng(0)
            x = gen.standard_normal((batch, tokens, heads, head_dim), dtype=cupy.float32).astype(cupy.float16)
            for kv_format in kv_formats.QUANTIZE_FORMATS:
                if append:
                    cache = quantize_kv(cupy.ones((batch, rows, heads, head_dim), cupy.float16), kv_format)
                    positions = cupy.asarray(np.arange(batch, dtype=np.int32) % (rows - tokens))
                    call = (lambda x=x, f=kv_format, c=cache, p=positions:
                            quantize_kv(x, f, out=c, positions=p, check=False, status=status))
                else:
                    scale = cupy.asarray([0.01], cupy.float32)
                    call = lambda x=x, f=kv_format, s=scale: quantize_kv(x, f, scale=s, check=False, status=status)
                stats = summarize(harness.time(call))
                written = x.size * kv_formats.format_bytes_per_element(kv_format)
                moved = x.nbytes + written
                rate = gbps(moved, stats["median_us"])
                print(f"{label:38} {kv_format:9} {stats['median_us']:9.2f} {rate:7.0f} {100 * rate / copy_gbps:7.1f}")
        if int(status.get()[0]):
            raise SystemExit(f"quantizer status {int(status.get()[0])}: the inputs or positions were wrong")


if __name__ == "__main__":
    main()
