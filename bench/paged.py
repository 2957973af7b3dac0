"""Paged K/V caches: splitkv on pages (random page order) beside splitkv on the contiguous cache and
FlashInfer's paged decode on the very same pages and block table, in one run.

For every shape and page size the cache is laid out as pages in a random order (the block table
says where each sequence's pages went); splitkv must read it as fast as the contiguous cache
(within 5% from 4k tokens on, issue target) and faster than FlashInfer's paged decode. Outputs are
checked too: where both take the same plan, splitkv's paged output must equal its contiguous one
bit for bit (the exit status says so); FlashInfer's must lie close to it. Times are medians under the benchmark's protocol (CUDA events, cold L2), with the
copy bandwidth of the same run.

    python bench/paged.py                                    # the default shapes, pages of 1, 16, 64
    python bench/paged.py --shapes 1:32:8:128:64k:fp8 --page-sizes 16 --layout HND
    python bench/paged.py --json results.json --markdown table.md

Needs a GPU, CuPy and torch; FlashInfer is optional (its column reads n/a without it).
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from splitkv import DecodeAttention, quantize_kv
from splitkv.bench.inputs import random_bf16_qkv
from splitkv.bench.shapes import parse_shapes
from splitkv.timing import DeviceCopy, Harness
from splitkv.quantize import QuantizedKV

DEFAULT_SHAPES = ["1:32:8:128:4k", "1:32:8:128:16k", "1:32:8:128:64k", "16:32:8:128:4k", "64:32:8:128:1k",
                  "1:32:8:128:64k:fp8", "16:32:8:128:4k:fp8", "1:32:8:128:64k:nvfp4"]
DEFAULT_PAGE_SIZES = [1, 16, 64]


def as_pages(array, page_size: int, layout: str, order):
    """A contiguous ``[B, L, Hkv, X]`` CuPy array as pages ``order`` puts where (``order[i]``: the
    page that logical page i of the batch goes to; L a multiple of the page size)."""
    import cupy

    batch, length, heads, width = array.shape
    pages = cupy.empty((order.size, page_size, heads, width), dtype=array.dtype)
    pages[cupy.asarray(order)] = array.reshape(batch * length // page_size, page_size, heads, width)
    return cupy.ascontiguousarray(pages.transpose(0, 2, 1, 3)) if layout == "HND" else pages


def paged_kv(kv, page_size, layout, order):
    if isinstance(kv, QuantizedKV):
        scales = None if kv.block_scales is None else as_pages(kv.block_scales, page_size, layout, order)
        return QuantizedKV(kv.kv_dtype, as_pages(kv.values, page_size, layout, order), scales, kv.scale)
    return as_pages(kv, page_size, layout, order)


def as_torch(torch, array, dtype):
    """A CuPy array's bytes as a torch tensor of ``dtype`` (bf16 travels as int16)."""
    import cupy

    if array.dtype == cupy.uint16:
        array = array.view(cupy.int16)
    return torch.as_tensor(array, device="cuda").view(dtype)


def flashinfer_paged(torch, heads, q, k_pages, v_pages, table, lens, page_size, layout, tensor_cores):
    """FlashInfer's paged decode on the same pages and table, for sequences of ``lens`` tokens and
    ``heads`` (Hq, Hkv, D): (run function, output getter, what must stay alive)."""
    import flashinfer

    scales = {}
    if isinstance(k_pages, QuantizedKV):
        if k_pages.kv_dtype != "fp8_e4m3":
            raise RuntimeError(f"FlashInfer has no {k_pages.kv_dtype} decode on this GPU")
        scales = {"k_scale": float(k_pages.scale[0]), "v_scale": float(v_pages.scale[0])}
        k_cache, v_cache = (as_torch(torch, c.values, torch.float8_e4m3fn) for c in (k_pages, v_pages))
    else:
        k_cache, v_cache = (as_torch(torch, c, torch.bfloat16) for c in (k_pages, v_pages))
    per_seq = [-(-n // page_size) for n in lens]  # the pages each sequence reads, in its table row
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(per_seq)]), dtype=torch.int32, device="cuda")
    indices = torch.tensor(np.concatenate([table[i, :n] for i, n in enumerate(per_seq)]), dtype=torch.int32,
                           device="cuda")
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(lens, per_seq)], dtype=torch.int32,
                        device="cuda")
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout, use_tensor_cores=tensor_cores)
    wrapper.plan(indptr, indices, last, *heads, page_size, q_data_type=torch.bfloat16, kv_data_type=k_cache.dtype)
    q_t = as_torch(torch, q, torch.bfloat16)
    out = torch.empty_like(q_t)
    keep = (workspace, indptr, indices, last, wrapper, k_cache, v_cache)

    def run():
        wrapper.run(q_t, (k_cache, v_cache), out=out, **scales)
    return run, lambda: out, keep


def main(argv=None) -> int:
    import cupy
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    parser.add_argument("--page-sizes", nargs="+", type=int, default=DEFAULT_PAGE_SIZES)
    parser.add_argument("--layout", choices=["NHD", "HND"], default="NHD")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--markdown", help="write the table here")
    args = parser.parse_args(argv)

    harness = Harness(args.iters, 5, 256 << 20, torch_mod=torch)
    harness.flush_us = harness.flush_time_us()  # flushes enough to keep the queue ahead of the GPU
    copy = DeviceCopy(1 << 30)
    with harness.active():
        copy_us = statistics.median(harness.time(copy, iters=20))
    copy_gbps = copy.bytes_moved / copy_us / 1e3
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    rng = np.random.default_rng(args.seed)
    rows = []
    header = "| shape | pages | contiguous µs | paged µs (% bw) | paged / contiguous | FlashInfer paged µs | speedup |"
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|"]
    print(header, flush=True)
    for shape in parse_shapes(args.shapes):
        q, k, v, out = random_bf16_qkv(shape, args.seed)
        if shape.quantized:
            k, v = quantize_kv(k, shape.kv_dtype), quantize_kv(v, shape.kv_dtype)
        # The inputs were made on CuPy's default stream; the benchmark stream (torch's, non-blocking)
        # is not ordered after it, so a first call could read K/V still being written (at 64k the
        # fill outlasts plan(): the contiguous output's first call then differed from later ones).
        cupy.cuda.Device().synchronize()
        heads = (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim)
        lens = [shape.seq_len] * shape.batch
        with harness.active():
            flat = DecodeAttention(*heads, kv_dtype=shape.kv_dtype)
            flat.plan(lens, stream=harness.stream)
            flat_out = flat.run(q, k, v)
            flat_us = statistics.median(harness.time(lambda: flat.run(q, k, v, out=out)))
            for page_size in args.page_sizes:
                if shape.seq_len % page_size:
                    raise SystemExit(f"{shape.label}: the length is not a whole number of pages of {page_size}")
                per_seq = shape.seq_len // page_size
                order = rng.permutation(shape.batch * per_seq)
                table = order.reshape(shape.batch, per_seq).astype(np.int32)
                k_pages, v_pages = (paged_kv(x, page_size, args.layout, order) for x in (k, v))
                attn = DecodeAttention(*heads, kv_dtype=shape.kv_dtype, page_size=page_size, kv_layout=args.layout)
                attn.plan(lens, block_table=table, stream=harness.stream)
                paged_out = attn.run(q, k_pages, v_pages)
                flat_now = flat.run(q, k, v)  # the contiguous output again, next to the paged one
                # Pages shorter than a tile may plan other splits (heuristics.takes_whole_row_clusters)
                # or other CTA shapes (per-lane copies below 8 tokens a page).
                same_plan = (attn._launch.plan == flat._launch.plan
                             and attn._launch.spec.replace(page_size=0, kv_layout="NHD") == flat._launch.spec)
                same = bool((paged_out == flat_now).all()) if same_plan else None
                flat_kept = bool((flat_now == flat_out).all())  # the contiguous program repeats itself
                paged_us = statistics.median(harness.time(lambda: attn.run(q, k_pages, v_pages, out=out)))
                fi_us, fi_note = None, ""
                for tensor_cores in (False, True):  # FlashInfer's two decode paths: the faster one counts
                    try:
                        fi_run, fi_out, keep = flashinfer_paged(torch, heads, q, k_pages, v_pages, table, lens,
                                                                page_size, args.layout, tensor_cores)
                        fi_run()
                        torch.cuda.synchronize()
                        ours = as_torch(torch, paged_out, torch.bfloat16).float()
                        diff = float((fi_out().float() - ours).norm() / ours.norm())
                        t = statistics.median(harness.time(fi_run))
                        if fi_us is None or t < fi_us:
                            fi_us = t
                        fi_note += f" FlashInfer tc={tensor_cores}: {t:.1f} µs, rel. diff to splitkv {diff:.1e};"
                        del keep
                    except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                        text = str(exc).splitlines()[0][:80] if str(exc) else ""
                        fi_note += f" FlashInfer tc={tensor_cores} n/a: {type(exc).__name__}: {text};"
                pct = 100 * shape.total_bytes / paged_us / 1e3 / copy_gbps
                row = {"shape": shape.label, "page_size": page_size, "layout": args.layout,
                       "contiguous_us": flat_us, "paged_us": paged_us, "pct_copy_bw": pct,
                       "paged_over_contiguous": paged_us / flat_us, "flashinfer_paged_us": fi_us,
                       "bitwise_equal_to_contiguous": same, "contiguous_repeats_bitwise": flat_kept,
                       "plan": attn.plan_info,
                       "contiguous_plan": flat.plan_info}
                rows.append(row)
                fi = f"{fi_us:.1f}" if fi_us else "n/a"
                speedup = f"{fi_us / paged_us:.2f}x" if fi_us else "n/a"
                line = (f"| {shape.label} | {page_size} {args.layout} | {flat_us:.1f} | {paged_us:.1f} ({pct:.0f}) | "
                        f"{paged_us / flat_us:.3f} | {fi} | {speedup} |")
                lines.append(line)
                verdict = {True: "", None: f"  (plans differ: {attn.plan_info})",
                           False: "  PAGED OUTPUT DIFFERS FROM CONTIGUOUS"}[same]
                if not flat_kept:
                    verdict += "  CONTIGUOUS OUTPUT DIFFERS FROM ITS FIRST RUN"
                print(line + verdict + fi_note, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_gbps": copy_gbps, "rows": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if any(r["bitwise_equal_to_contiguous"] is False or not r["contiguous_repeats_bitwise"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
