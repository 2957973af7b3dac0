"""Where each warp's tile loop spends its cycles: waiting for tiles, or computing on them.

The rendered decode program is patched to read the SM's cycle counter (clock64) around each
tile's waits and math; every warp adds its phases up over its tiles, and lane 0 writes the sums
into a device array after the loop. One launch per sample after an L2 flush, as in the benchmark.
Per shape and variant: how long a warp's loop lasts (the median warp and the slowest), how much of
it the warp waits, and per tile the cycles of the wait for K, of S and the softmax, of the wait
for V and of P V. A loop that mostly computes is not hurried by more bytes in flight; its last
tile's math comes after the stream (see the "last tile's math skipped" ablation, bench/ablate.py).
The timeline (bench/timeline.py) says when each CTA reaches each phase; this, what its warps do
in between.

    python bench/warp_phases.py --shapes 1:32:8:128:16k:fp8 1:32:8:128:64k:nvfp4
    python bench/warp_phases.py --shapes 1:32:8:128:16k:fp8 --variants "" "warps=8,tile_tokens=32,stages=2"

Needs a GPU and CuPy. The counters add a few instructions per tile.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ablate import STREAM_END, TILE_WAIT  # noqa: E402
from variants import parse_variant, planned_attention  # noqa: E402

#: Per warp, the sums the patched program writes (cycles, but the tile count).
SLOTS = ("loop", "K wait", "S + softmax", "V wait", "P V", "first wait", "tiles")

_LOOP = "    for (int t = 0; t < my_tiles; ++t) {\n"
_WAIT_V = "        if constexpr (WAIT_V_LATER) {\n            wait_tile(t, 1);\n"
_TILE_END = "        stream_sync();  // every lane of the ring's warps has read this stage before it is refilled\n    }\n"

# `phase_mark` is the cycle count at the end of the last phase counted; each stamp adds the cycles
# since then to a phase. The V wait's stamps sit inside `if constexpr (WAIT_V_LATER)`: a program
# that awaits whole tiles counts its V with K, and its S + softmax runs on into P V's count.
_COUNTERS = "    long long phase_sum[{n}] = {{}}, phase_mark = 0;\n    const long long loop_start = clock64();\n"
_STAMP = "{{ const long long now = clock64(); phase_sum[{slot}] += now - phase_mark; phase_mark = now; }}\n"


def _stamp(slot: str, indent: str) -> str:
    return indent + _STAMP.format(slot=SLOTS.index(slot))


def patched_source(source: str, num_ctas: int, warps: int) -> str:
    """The rendered decode program with per-warp phase counters (see the module notes)."""
    head, sep, body = source.partition('#include "merge.cuh"\n')
    if not sep:
        raise ValueError("warp_phases: the decode program's include anchor moved")
    out = head + sep + f"__device__ long long splitkv_phases[{num_ctas}][{warps}][{len(SLOTS)}];\n" + body
    for anchor in (_LOOP, TILE_WAIT, _WAIT_V, _TILE_END, STREAM_END):
        if out.count(anchor) != 1:
            raise ValueError(f"warp_phases: anchor not found once in the rendered program: {anchor!r}")
    first_wait = SLOTS.index("first wait")
    out = out.replace(_LOOP, _COUNTERS.format(n=len(SLOTS)) + _LOOP
                      + "        phase_mark = clock64();\n        const long long wait_start = phase_mark;\n")
    out = out.replace(TILE_WAIT, TILE_WAIT + _stamp("K wait", "        ")
                      + f"        if (t == 0) phase_sum[{first_wait}] = phase_mark - wait_start;\n")
    out = out.replace(_WAIT_V, _stamp("S + softmax", "        ") + _WAIT_V + _stamp("V wait", "            "))
    out = out.replace(_TILE_END, "        stream_sync();  // every lane of the ring's warps has read this stage before it is refilled\n"
                      + _stamp("P V", "        ") + "    }\n")
    write = ("    if (lane == 0) {  // warp_phases: this warp's sums\n"
             "        long long* mine = splitkv_phases[blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)][warp];\n"
             f"        for (int i = 0; i < {len(SLOTS) - 1}; ++i) mine[i] = phase_sum[i];\n"
             f"        mine[{SLOTS.index('loop')}] = clock64() - loop_start;\n"
             f"        mine[{SLOTS.index('tiles')}] = my_tiles;\n    }}\n")
    return out.replace(STREAM_END, write + STREAM_END)


def summarise(sums: np.ndarray, mhz: float) -> list[str]:
    """Rows of the table from the sums [samples, ctas, warps, slots] (cycles; warps with no tile,
    past a length, left out) at an SM clock of ``mhz``."""
    sums = sums.reshape(-1, len(SLOTS)).astype(np.float64)
    sums = sums[sums[:, SLOTS.index("tiles")] > 0]
    if not len(sums):
        return ["  no warp streamed a tile"]
    col = {name: sums[:, i] for i, name in enumerate(SLOTS)}
    loop_us = col["loop"] / mhz
    waited = col["K wait"] + col["V wait"]
    per_tile = "  ".join(f"{name} {np.median(col[name] / col['tiles']):.0f}"
                         for name in ("K wait", "S + softmax", "V wait", "P V"))
    return [f"  loop per warp: median {np.median(loop_us):.2f} µs, slowest {loop_us.max():.2f}; "
            f"{np.median(col['tiles']):.0f} tiles; waiting {np.median(waited / col['loop']) * 100:.0f}% "
            f"(first tile {np.median(col['first wait']) / mhz:.2f} µs)",
            f"  per tile, cycles: {per_tile}"]


def main(argv=None) -> int:
    import cupy

    from splitkv.bench.inputs import random_qkv
    from splitkv.bench.shapes import parse_shapes
    from splitkv.timing import Harness
    from splitkv.codegen.load import load_module
    from splitkv.codegen.render import flat_source

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1:32:8:128:16k:fp8", "1:32:8:128:16k"])
    parser.add_argument("--variants", nargs="+", default=[""],
                        help='field=value,...[,splits=N] as bench/variants.py takes them; "" = as shipped')
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args(argv)

    harness = Harness(args.samples, 5, 256 << 20)
    mhz = cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrClockRate, cupy.cuda.Device().id) / 1e3
    print(f"µs at the SM clock the device reports, {mhz:.0f} MHz")
    for shape in parse_shapes(args.shapes):
        q, k, v, out = random_qkv(shape)
        for text in args.variants:
            attn = planned_attention(shape, *parse_variant(text), harness.stream)
            launch = attn._launch
            num_ctas = int(np.prod(launch.grid))
            # Compiled as splitkv compiles the program, so that the counters are the only difference.
            module, function, _ = load_module(launch.spec,
                                              source=patched_source(flat_source(launch.spec), num_ctas, launch.spec.warps))
            attn._launch = launch.with_decode_fn(function)
            sums = cupy.ndarray((num_ctas, launch.spec.warps, len(SLOTS)), cupy.int64,
                                module.get_global("splitkv_phases"))
            samples = []
            with harness.active():
                for _ in range(args.samples):
                    sums.fill(0)  # warps past a length write nothing
                    harness.flush_l2()
                    attn.run(q, k, v, out=out)
                    harness.synchronize()
                    samples.append(sums.get())
            print(f"{shape.label} [{text or 'as shipped'}] {attn.plan_info}")
            print("\n".join(summarise(np.stack(samples), mhz)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
