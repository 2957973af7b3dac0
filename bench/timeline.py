"""Timeline of one decode launch: when each CTA reaches each phase of the program.

The rendered decode program is patched to stamp the GPU's global timer (ns, shared by all SMs) at
the end of each phase, per CTA, into a device array; one launch per sample runs after an L2
flush, as in the benchmark. The table gives, per phase, when the first, median and last CTA got
there (µs after the first CTA started), and how long the last CTA to finish spent in each phase.
Ablations (bench/ablate.py) say what a part costs; this says where in the launch it happens.

    python bench/timeline.py                         # B=1, 32/8, D=128 at 1k and 64k
    python bench/timeline.py --shapes 1:32:8:128:16k --samples 50
    python bench/timeline.py --shapes 1:32:8:128:64k --placement 3   # where the clusters ran
    python bench/timeline.py --shapes 1:32:8:128:64k --placement 1 --variants "" "splits=16,cluster=1"
    python bench/timeline.py --shapes 64:32:8:128:1k --around        # the time outside the stamps
    python bench/timeline.py --shapes 1:32:8:128:16k:fp8 --spread --variants "" "splits=8,cluster=1"

Needs a GPU and CuPy. The stamps add a few instructions per phase, not per tile.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from variants import parse_variant, planned_attention  # noqa: E402

#: Phase stamps in program order; a CTA that skips a phase (no merge, not the last) leaves it 0.
#: In rows of several clusters, phases 3 and 4 are those of the second, global stage where a CTA
#: reaches it (the cluster stage's stamps are overwritten), and "done" is stamped by each slice's
#: last CTA (without clusters, by the row's last CTA).
PHASES = ("start", "all warps streamed", "warps combined", "pushed / partials written", "merge inputs ready",
          "done")
_SLOTS = 8
#: The slot that holds 1 + the SM a CTA ran on (stamped with phase 0).
_SM_SLOT = _SLOTS - 1
_PROBE = r'''
__device__ unsigned long long splitkv_probe[{ctas}][{slots}];
__device__ __forceinline__ void splitkv_stamp(int phase) {{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (threadIdx.x == 0) splitkv_probe[cta][phase] = t;
    if (threadIdx.x == 0 && phase == 0) {{
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        splitkv_probe[cta][{sm_slot}] = sm + 1;
    }}
}}
'''

#: (anchor in the rendered source, phase stamped right after it). Anchors that a program lacks
#: (the cluster merge in a global-merge program, say) are skipped.
_AFTER = (
    ("    __shared__ unsigned long long inbox_full;  // cluster: every member has pushed into the inbox\n", 0),
    ("    softmax.sum_lanes();\n    __syncthreads();\n", 1),
    ("    combine_warps(combined);\n    __syncthreads();\n", 2),
    ("        __syncthreads();  // the CTA's partials are written before thread 0 counts it\n", 3),
    ("        splitkv::mbarrier_wait_cluster_acquire(&inbox_full, 0);  // every member's pushes have landed\n", 4),
)
#: (anchor, code inserted right before it). Thread 0 stamps phase 3 as soon as it has issued its own pushes (a CTA barrier there would
#: change what is timed); a cluster merge that writes the output ends with its own barrier.
_BARRIER = "    __syncthreads();\n"
_BEFORE = (
    ("        splitkv::mbarrier_wait_cluster_acquire(&inbox_full, 0);", "    splitkv_stamp(3);\n"),
    ("        if (whole_row) return;\n        // Several clusters per row",
     _BARRIER + "    if (whole_row) splitkv_stamp(5);\n"),
    ("        return is_last != 0;\n", "        if (is_last) splitkv_stamp(4);\n"),  # the row's (or slice's) last CTA
)
#: The ends of the global merges (a row's, a cluster rank's slice), followed by the "done" stamp.
_TAILS = ("rows_per_slot, num_splits, slots_used, lane, MergedRow{at, row});\n        }\n",
          "rank * SLICE, slice_end, rank, CLUSTER, warp, lane);\n")


def patched_source(source: str, num_ctas: int) -> str:
    """The rendered decode program with phase stamps (see the module notes)."""
    head, sep, body = source.partition('#include "merge.cuh"\n')
    if not sep:
        raise ValueError("timeline: the decode program's include anchor moved")
    out = head + sep + _PROBE.format(ctas=num_ctas, slots=_SLOTS, sm_slot=_SM_SLOT) + body
    for anchor, phase in _AFTER:
        out = out.replace(anchor, anchor + f"    splitkv_stamp({phase});\n", 1)
    for anchor, code in _BEFORE:
        out = out.replace(anchor, code + anchor, 1)
    for tail in _TAILS:
        out = out.replace(tail, tail + _BARRIER + "    splitkv_stamp(5);\n", 1)
    if "splitkv_stamp(0)" not in out or "splitkv_stamp(1)" not in out:
        raise ValueError("timeline: the decode program's phase anchors moved")
    return out


def first_start(stamps: np.ndarray) -> np.ndarray:
    """Per sample, when the first CTA started (ns), from stamps [samples, ctas, slots]."""
    return np.where(stamps[:, :, 0] > 0, stamps[:, :, 0], np.iinfo(np.int64).max).min(axis=1)


def summarise(stamps: np.ndarray) -> list[str]:
    """Rows of the table from stamps [samples, ctas, slots] (ns, 0 = phase not reached)."""
    rows = []
    stamps = stamps[:, :, :len(PHASES)]
    start = first_start(stamps)
    rel = (stamps - start[:, None, None]) / 1e3
    rel[stamps == 0] = np.nan
    for phase, name in enumerate(PHASES):
        per_sample = rel[:, :, phase]
        if np.isnan(per_sample).all():
            continue
        first = np.nanmedian(np.nanmin(per_sample, axis=1))
        mid = np.nanmedian(np.nanmedian(per_sample, axis=1))
        last = np.nanmedian(np.nanmax(per_sample, axis=1))
        rows.append(f"  {name:28s} first {first:7.2f}  median {mid:7.2f}  last {last:7.2f} µs")
    return rows


def _group_of_sm(groups: list[list[int]]) -> dict[int, int]:
    """SM -> the index of its group in ``groups``."""
    return {sm: index for index, group in enumerate(groups) for sm in group}


def placement(stamps: np.ndarray, cluster: int, groups: list[list[int]]) -> list[str]:
    """Per sample, where each cluster (``cluster`` consecutive CTAs) ran, as the index of its SM
    group (`splitkv.cluster_layout`), and when its last CTA finished streaming (µs after the first
    CTA started; '-' where none of its CTAs streamed), then how many clusters each group held."""
    group_of = _group_of_sm(groups)
    rows = []
    for index, (sample, start) in enumerate(zip(stamps, first_start(stamps))):
        held: dict[int, int] = {}
        cells = []
        for first in range(0, len(sample), cluster):
            members = sample[first:first + cluster]
            where = sorted({group_of.get(int(sm) - 1, -1) for sm in members[:, _SM_SLOT] if sm > 0})
            for group in where:
                held[group] = held.get(group, 0) + 1
            streamed = members[:, 1].max()
            cells.append(f"{'/'.join(map(str, where))}@" + (f"{(streamed - start) / 1e3:.1f}" if streamed else "-"))
        rows.append(f"  sample {index}: group@streamed " + " ".join(cells))
        rows.append("    clusters per group: " + ", ".join(f"{g}: {n}" for g, n in sorted(held.items())))
    return rows


def group_ends(stamps: np.ndarray, groups: list[list[int]]) -> str:
    """One line: per SM group (`splitkv.cluster_layout`), how many CTAs ran there (at most) and when the last
    of them finished streaming (µs after the first CTA started; median over samples). Equal work
    ending at different times per group is what balancing across the GPU would recover."""
    group_of = _group_of_sm(groups)
    start = first_start(stamps)
    ends: dict[int, list[float]] = {}
    counts: dict[int, list[int]] = {}
    for sample, t0 in zip(stamps, start):
        per_group: dict[int, list[int]] = {}
        for cta in sample:
            if cta[_SM_SLOT] > 0 and cta[1] > 0:
                per_group.setdefault(group_of.get(int(cta[_SM_SLOT]) - 1, -1), []).append(int(cta[1]))
        for group, streamed in per_group.items():
            ends.setdefault(group, []).append((max(streamed) - t0) / 1e3)
            counts.setdefault(group, []).append(len(streamed))
    cells = [f"{g}: {max(counts[g])}@{np.median(ends[g]):.1f}" for g in sorted(ends)]
    return "  streamed by SM group (CTAs@last end, µs): " + ", ".join(cells)


def stream_spread(stamps: np.ndarray) -> list[str]:
    """Lines that say whether the CTAs' stream ends (phase 1) spread by chance or by where the CTAs
    ran: the spread within a launch; the ends of CTAs whose TPC partner SM ran a CTA of the same
    launch against those whose partner was idle (SMs 2k and 2k + 1 share a TPC on sm_90, as the
    cluster layout's SM groups show); and each SM's mean offset from its launch's median end over
    the samples (the part of the spread that follows the SM, not the launch). CTAs that never
    streamed are left out."""
    start = first_start(stamps)
    ended = (stamps[:, :, 1] > 0) & (stamps[:, :, _SM_SLOT] > 0)
    ends = np.where(ended, (stamps[:, :, 1] - start[:, None]) / 1e3, np.nan)
    sms = stamps[:, :, _SM_SLOT].astype(np.int64) - 1
    spread = np.nanmax(ends, axis=1) - np.nanmin(ends, axis=1)
    rows = [f"  stream ends within a launch: median spread (last - first) {np.median(spread):.2f} µs"]
    partner_busy = np.zeros(ends.shape, dtype=bool)
    for i, (sample_sms, sample_ended) in enumerate(zip(sms, ended)):
        streaming = set(sample_sms[sample_ended].tolist())
        partner_busy[i] = [int(sm) ^ 1 in streaming for sm in sample_sms]
    busy, idle = ended & partner_busy, ended & ~partner_busy
    line = f"  TPC partner SM busy for {busy.sum() / max(ended.sum(), 1):.0%} of the CTAs"
    if busy.any() and idle.any():
        line += f"; median stream end {np.median(ends[busy]):.2f} µs with, {np.median(ends[idle]):.2f} without"
    rows.append(line)
    if ended.any():
        offset = (ends - np.nanmedian(ends, axis=1, keepdims=True))[ended]  # from the CTA's launch's median
        sm_ids, which = np.unique(sms[ended], return_inverse=True)
        means = np.bincount(which, offset) / np.bincount(which)  # per SM, over the samples
        order = np.argsort(means, kind="stable")

        def listed(picks):
            return " ".join(f"{sm_ids[i]}:{means[i]:+.2f}" for i in picks)

        rows.append(f"  per SM mean offset from the launch's median end: std {np.std(means):.2f} µs against "
                    f"{np.std(offset):.2f} for single CTAs; earliest {listed(order[:3])}, latest {listed(order[-3:])}")
    return rows


#: A one-thread kernel that stamps the global timer: launched right before and right after the
#: decode with --around, it shows the time outside the decode's own stamps (its launch, and after
#: the last stamp its CTAs' remaining work, their exit and the next launch).
_STAMP_SOURCE = r'''
extern "C" __global__ void splitkv_stamp_kernel(unsigned long long* at) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    *at = t;
}
'''


def around(stamps: np.ndarray, before: np.ndarray, after: np.ndarray) -> str:
    """One line, medians over samples (µs): from the stamp before the decode to its first CTA's
    start, from there to the last stamp of any CTA, from that to the stamp after, and stamp to
    stamp. ``stamps`` [samples, ctas, slots]; ``before``/``after`` [samples] (ns)."""
    first = first_start(stamps)
    last = stamps[:, :, :len(PHASES)].max(axis=(1, 2))
    parts = ((first - before, "stamp to first CTA"), (last - first, "first CTA to last stamp"),
             (after - last, "last stamp to next stamp"), (after - before, "stamp to stamp"))
    return "  around: " + "  ".join(f"{name} {np.median(ns) / 1e3:.2f}" for ns, name in parts) + " µs"


def sample_launch(attn, inputs, harness, samples: int, stamp_kernel):
    """Runs planned ``attn`` on ``inputs`` (q, k, v, out) ``samples`` times after an L2 flush each, its program patched with the
    phase stamps. Returns the stamps [samples, ctas, slots] and, with ``stamp_kernel`` (--around),
    the stamps before and after each decode [samples, 2] (else None)."""
    import cupy

    from splitkv.codegen.load import load_module
    from splitkv.codegen.render import flat_source

    q, k, v, out = inputs
    launch = attn._launch
    num_ctas = int(np.prod(launch.grid))
    # Compiled as splitkv compiles the program, so that the stamps are the only difference.
    module, function, _ = load_module(launch.spec, source=patched_source(flat_source(launch.spec), num_ctas))
    attn._launch = launch.with_decode_fn(function)
    probe = cupy.ndarray((num_ctas, _SLOTS), cupy.uint64, module.get_global("splitkv_probe"))
    stamps, outside = [], []
    with harness.active():
        times = cupy.zeros(2, cupy.uint64)  # the stamps before and after the decode (--around)
        for _ in range(samples):
            probe.fill(0)  # on the harness stream: phases a CTA skips stay 0
            harness.flush_l2()
            if stamp_kernel is not None:
                stamp_kernel((1,), (1,), (times[0:1],))
            attn.run(q, k, v, out=out)
            if stamp_kernel is not None:
                stamp_kernel((1,), (1,), (times[1:2],))
            harness.synchronize()
            stamps.append(probe.get().astype(np.int64))
            if stamp_kernel is not None:
                outside.append(times.get().astype(np.int64))
    return np.stack(stamps), (np.stack(outside) if outside else None)


def main(argv=None) -> int:
    import cupy

    from splitkv.bench.inputs import random_qkv
    from splitkv.bench.shapes import parse_shapes
    from splitkv.timing import Harness

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1:32:8:128:1k", "1:32:8:128:64k"])
    parser.add_argument("--variants", nargs="+", default=[""],
                        help='as bench/variants.py: field=value,...[,splits=N]; "" = as shipped')
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--placement", type=int, default=0, metavar="N",
                        help="also print, for the first N samples, the SM group each cluster ran on "
                             "(splitkv.cluster_layout) and when it finished streaming, and per SM group "
                             "when its CTAs finished streaming (all samples)")
    parser.add_argument("--spread", action="store_true",
                        help="also say whether the CTAs' stream ends spread by chance or by where they ran "
                             "(TPC partner busy or idle, each SM's mean offset; see stream_spread)")
    parser.add_argument("--around", action="store_true",
                        help="also stamp the timer in a kernel right before and right after the decode")
    args = parser.parse_args(argv)
    stamp_kernel = cupy.RawKernel(_STAMP_SOURCE, "splitkv_stamp_kernel") if args.around else None
    groups = None
    if args.placement:
        from splitkv import cluster_layout

        layout = cluster_layout.probe()
        groups = layout["sm_groups"]
        print(cluster_layout.describe(layout))
        for index, group in enumerate(groups):
            print(f"  group {index}: SMs {group}")

    harness = Harness(args.samples, 3, 256 << 20)
    variants = [(text, *parse_variant(text)) for text in args.variants]
    for shape in parse_shapes(args.shapes):
        inputs = random_qkv(shape)  # q, k, v (in the shape's K/V format), out: shared by its variants
        for text, changes, plan_keys in variants:
            attn = planned_attention(shape, changes, plan_keys, harness.stream)
            stamps, outside = sample_launch(attn, inputs, harness, args.samples, stamp_kernel)
            print(f"{shape.label}{' [' + text + ']' if text else ''}: {attn.plan_info}")
            print("\n".join(summarise(stamps)), flush=True)
            if stamp_kernel is not None:
                before, after = outside.T
                print(around(stamps, before, after), flush=True)
            if args.spread:
                print("\n".join(stream_spread(stamps)), flush=True)
            if groups is not None:
                print(group_ends(stamps, groups))
                print("\n".join(placement(stamps[:args.placement], attn._launch.spec.cluster, groups)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
