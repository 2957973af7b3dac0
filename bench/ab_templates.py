"""A/B of two versions of the decode templates: the package's against an older copy, same plan.

Each version is compiled the way the package compiles (`load_kernel` with its NVRTC options and
headers); the old one from the templates in OLD_DIR (decode.cu.j2 and the *.cuh headers, e.g.
written there with `git show REV:splitkv/templates/FILE`). Quantized shapes (``:fp8``, ``:nvfp4``)
read caches quantized on the GPU, as the benchmark's do. Both run the plan the package makes for
the shape, in rounds of alternating order (old new, new old, ...), each round the median of
``--iters`` calls under the benchmark's protocol; the table gives the median of the rounds, their
range, and the largest difference between the two outputs (the old one's as reference).

    python bench/ab_templates.py OLD_DIR --shapes 1:8:1:128:64k 1:16:2:256:16k 1:32:8:128:16k:fp8 [--rounds 4]

The old program must take the same kernel parameters as the new. Needs a GPU and CuPy.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jinja2

sys.path.insert(0, str(Path(__file__).resolve().parent))

from variants import round_order  # noqa: E402

HEADERS = ("primitives.cuh", "merge.cuh")  # required; any other *.cuh in OLD_DIR is passed along too


def old_source(spec, old_dir: Path) -> tuple[str, dict[str, str]]:
    """The decode program of ``spec`` rendered from the templates in ``old_dir``, and the helper
    headers found there (what `splitkv.codegen.render` gives for the package's own templates)."""
    from splitkv.codegen.render import template_parameters

    for name in ("decode.cu.j2",) + HEADERS:
        path = Path(old_dir) / name
        if not path.is_file() or path.stat().st_size == 0:
            raise SystemExit(f"ab_templates: {path} is missing or empty (the old templates go in {old_dir})")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(old_dir)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    source = env.get_template("decode.cu.j2").render(**template_parameters(spec))
    return source, {path.relative_to(old_dir).as_posix(): path.read_text() for path in Path(old_dir).rglob("*.cuh")}


def old_kernel(spec, old_dir: Path):
    """The decode function of ``spec`` compiled from the templates in ``old_dir``, as the package compiles."""
    from splitkv.codegen.load import load_kernel

    source, headers = old_source(spec, old_dir)
    return load_kernel(spec, source=source, headers=headers)[0]


def main(argv=None) -> int:
    import cupy

    from splitkv import DecodeAttention
    from splitkv.bench.inputs import random_qkv
    from splitkv.bench.shapes import parse_shapes
    from splitkv.timing import Harness

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_dir", type=Path, help="directory with the old decode.cu.j2 and *.cuh headers")
    parser.add_argument("--shapes", nargs="+", required=True, help="B:Hq:Hkv:D:L[:fp8|:nvfp4] (L may be written 4k)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    harness = Harness(args.iters, 5, 256 << 20)
    harness.flush_us = harness.flush_time_us()  # enough flushes a call to keep the queue ahead of the GPU
    for shape in parse_shapes(args.shapes):
        q, k, v, out = random_qkv(shape)
        attn = DecodeAttention(shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, kv_dtype=shape.kv_dtype)
        attn.plan([shape.seq_len] * shape.batch, stream=harness.stream)
        launch = attn._launch
        fns = {"old": old_kernel(launch.spec, args.old_dir), "new": launch.decode_fn}
        times = {name: [] for name in fns}
        outs = {}
        with harness.active():
            for r in range(args.rounds):
                for name in (list(fns)[i] for i in round_order(len(fns), r)):
                    attn._launch = launch.with_decode_fn(fns[name])
                    times[name].append(statistics.median(harness.time(lambda: attn.run(q, k, v, out=out))))
                    if r == 0:  # the output of one call, over a NaN-poisoned buffer
                        bits = out.view(cupy.uint16)
                        bits.fill(0x7FC0)
                        attn.run(q, k, v, out=out)
                        harness.synchronize()
                        outs[name] = (bits.astype(cupy.uint32) << 16).view(cupy.float32)
            attn._launch = launch
        diff = float(cupy.nan_to_num(cupy.abs(outs["new"] - outs["old"]), nan=cupy.inf).max())
        nans = int(cupy.isnan(outs["new"]).sum())
        cells = [f"{name} {statistics.median(t):7.2f} µs [{min(t):.2f}-{max(t):.2f}]" for name, t in times.items()]
        print(f"{shape.label}: " + " | ".join(cells) + f" | max |new - old| {diff:.1e}, NaN in new {nans}"
              f"   ({attn.plan_info.split(';')[0]})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
