"""Ablations of the decode program: where does the time go inside one launch?

Times the decode program as rendered, then with one part removed at a time (the rendered source
is patched before compiling), under the benchmark's protocol. The difference between two rows is
the time that part costs on the critical path. The patched programs compute wrong results by
design; they are only timed, never used.

    python bench/ablate.py                      # B=1, 32/8, D=128 at 1k, 4k and 64k
    python bench/ablate.py --shapes 1:32:8:128:16k --splits 16
    python bench/ablate.py --shapes 1:32:8:128:64k:fp8 1:32:8:128:64k:nvfp4   # the dequantization

"last tile's math skipped" awaits each warp's last tile without computing it: the math that
follows the end of the stream, where nothing hides it.

Needs a GPU and CuPy; results print as a table (see BENCHMARKS.md for a run).
"""

from __future__ import annotations

import argparse
import statistics

from splitkv import DecodeAttention
from splitkv.bench.inputs import random_qkv
from splitkv.bench.shapes import parse_shapes
from splitkv.codegen.load import load_kernel
from splitkv.codegen.render import flat_source
from splitkv.timing import Harness, ReadFloor


def _cut(source: str, start: str, stop: str) -> str:
    """The source without [start, the first stop after it)."""
    a = source.index(start)
    b = source.index(stop, a)
    return source[:a] + source[b:]


def _stream_only(source: str) -> str:
    """The loop without S, the softmax and P V, but still waiting for every tile's V: a CTA must
    not refill a stage, or exit, while the copy engine still writes into it."""
    source = _cut(source, "        // S = Q K^T", "        if constexpr (WAIT_V_LATER) {")
    pv = "        // O^T += V^T P^T" if "        // O^T += V^T P^T" in source else "        // O += P V"
    return _cut(source, pv, "        stream_sync();  // every lane of the ring's warps has read this stage")


#: A tile's first wait in the loop (its K, or the whole tile), once per program.
TILE_WAIT = "        wait_tile(t, WAIT_V_LATER ? 0 : 1);\n"
#: The line after the loop over a warp's tiles, once per program.
STREAM_END = "    drain(prefetched);  // the rings are reused below: nothing may still be landing in them\n"


def _last_tile_math_skipped(source: str) -> str:
    """The last tile of each warp awaited but not computed: what its math adds after the stream
    ends (no tile follows to hide it behind)."""
    return _swap(TILE_WAIT, TILE_WAIT + "        if (t == my_tiles - 1) {  // ablation: awaited, not computed\n"
                 "            wait_tile(t, 1);\n            stream_sync();\n            break;\n        }\n")(source)


def _swap(old: str, new: str):
    def patch(source: str) -> str:
        if old not in source:
            raise ValueError(f"ablation anchor not found in the rendered source: {old!r}")
        return source.replace(old, new)
    return patch


#: The E2M1 decode with integer ops alone, in place of E4M3 bit patterns and the hardware E4M3
#: conversion: nibble j's bits moved into an fp16's, the same pairs in units of 2^-14 (timed only:
#: the program's unit stays 2^-6).
_E2M1_INTEGER_ONLY = """#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 x = w << (12 - 4 * j);  // nibbles j and j + 4 at bits 12..15 and 28..31
            out[j] = (x & 0x80008000u) | ((x >> 3) & 0x0e000e00u);
        }"""

#: Quantized K/V only, per format: the dequantization's parts.
QUANTIZED_ABLATIONS = {
    "fp8_e4m3": {
        "no dequantization (raw words)": lambda source: _swap(
            "        splitkv::unpack_e4m3x4(w, out);\n", "        out[0] = out[1] = w;\n")(_swap(
            "        splitkv::unpack_e4m3x4(__byte_perm(w, 0u, 0x3120), out);", "        out[0] = out[1] = w;")(source)),
    },
    "nvfp4": {
        "E2M1 with integer ops only": _swap("        splitkv::unpack_e2m1x8(w, out);\n", _E2M1_INTEGER_ONLY + "\n"),
        "no block-scale multiply": _swap(
            "        for (int j = 0; j < N; ++j) out[j] = splitkv::hmul2_bits(out[j], scale);\n", ""),
        "no dequantization (raw words)": _swap("        splitkv::unpack_e2m1x8(w, out);\n",
                                               "        out[0] = out[1] = out[2] = out[3] = w;\n"),
    },
}

#: The tile loop's math, for every K/V format.
LOOP_ABLATIONS = {
    "stream-only (no math)": _stream_only,
    "last tile's math skipped": _last_tile_math_skipped,
}

#: name -> source patch. Each removes one part of the program from the critical path.
ABLATIONS = {
    "no length read (length = L)": _swap("const int loaded_len = __ldg(seq_lens + batch_idx);",
                                         "const int loaded_len = max_len;"),
    "no Q loads": _swap("            if (!q_row_valid(row)) return 0u;\n", "            return 0x3f803f80u;\n"),
    "no global merge tail": _swap("    if (!FUSED_MERGE) return;\n", "    return;\n"),
    **LOOP_ABLATIONS,
    "no cluster merge (each CTA exits)": _swap("        splitkv::cluster_wait();  // every member's inbox",
                                               "        return;\n        splitkv::cluster_wait();  // every member's inbox"),
    "no epilogue (exit after the stream)": _swap(STREAM_END, STREAM_END + "    if (len >= 0) return;\n"),
    "nothing (exit at once)": _swap("    __shared__ unsigned long long inbox_full;",
                                    "    __shared__ unsigned long long inbox_full; if (max_len > 0) return;"),
}


def patched_kernel(spec, patch):
    """The program of ``spec`` with ``patch`` applied, compiled exactly as splitkv compiles it."""
    return load_kernel(spec, source=patch(flat_source(spec)))[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1:32:8:128:1k", "1:32:8:128:4k", "1:32:8:128:64k"])
    parser.add_argument("--splits", type=int, default=None, help="force this split count (default: the planner's)")
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args(argv)

    harness = Harness(args.iters, 5, 256 << 20)
    harness.flush_us = harness.flush_time_us()  # enough flushes a call to keep the queue ahead of the GPU
    shapes = parse_shapes(args.shapes)
    floor = ReadFloor(max(s.total_bytes for s in shapes))  # the largest shape's bytes, however large
    rows = []
    for shape in shapes:
        b, hq, hkv, d, n = shape.batch, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.seq_len
        q, k, v, out = random_qkv(shape)
        ablations = dict(ABLATIONS)
        if shape.quantized:
            ablations = {**QUANTIZED_ABLATIONS[shape.kv_dtype], **LOOP_ABLATIONS}
        attn = DecodeAttention(hq, hkv, d, kv_dtype=shape.kv_dtype)
        variant = "split" if args.splits else None
        attn.plan([n] * b, variant=variant, num_splits=args.splits, stream=harness.stream)
        launch = attn._launch
        with harness.active():
            timings = {"as rendered": harness.time(lambda: attn.run(q, k, v, out=out))}
            for name, patch in ablations.items():
                try:
                    attn._launch = launch.with_decode_fn(patched_kernel(launch.spec, patch))
                    timings[name] = harness.time(lambda: attn.run(q, k, v, out=out))
                except ValueError as exc:  # the part is not in this program (e.g. no global merge)
                    timings[name] = exc
            attn._launch = launch
            timings["read floor (same bytes)"] = harness.time(floor.reader(shape.total_bytes))
        for name, t in timings.items():
            figure = f"{statistics.median(t):8.1f}" if isinstance(t, list) else "     n/a"
            rows.append(f"{shape.label:22s} {name:32s} {figure} µs   {attn.plan_info}")
        print("\n".join(rows[-len(timings):]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
