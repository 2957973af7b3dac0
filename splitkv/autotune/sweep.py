"""The report's bandwidth sweep: one sequence at each context length, timed with the tuned
programs, the built-in ones and the peers that are installed, in one process and one harness
(the benchmark's: CUDA events, L2 flushed before each call, median), each checked against the
fp32 reference of `splitkv.bench` over the values the programs read (for quantized keys the
dequantized cache, so the format's rounding does not count against anyone). Needs a GPU and torch
(the benchmark's inputs and peers).
"""

from __future__ import annotations

from .keys import REFERENCE_KV_HEADS, TuneKey

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
#: Peers for one sequence (FlashInfer's single-request decode, both of its paths; the faster is kept).
PEERS = {"FlashInfer": ("flashinfer-single", "flashinfer-single-tc")}


def sweepable(key: TuneKey) -> bool:
    """The benchmark's inputs are bf16 queries over bf16, FP8 or NVFP4 caches, contiguous."""
    return key.q_dtype == "bf16" and key.kv_dtype in ("bf16", "fp8_e4m3", "nvfp4") and not key.page_size


def sweep(key: TuneKey, lengths=LENGTHS, iters: int = 50, seed: int = 0) -> dict:
    """{'lengths': [...], 'tuned': [...], 'built-in': [...], peer: [...]}: % of the copy bandwidth
    (None where a program failed its check or could not run)."""
    import cupy
    import torch

    from .. import bench
    from .measure import FLUSH_BYTES, _copy_bandwidth

    device = cupy.cuda.Device().id
    torch.cuda.set_device(device)  # torch's stream, tensors and CuPy's device must be one GPU
    harness = bench.Harness(iters, 10, FLUSH_BYTES, torch)
    with harness.active():
        harness.flush_us = harness.flush_time_us()
        copy_gbps = _copy_bandwidth(device, harness)  # the denominator of the table's figures too
        result = {"lengths": list(lengths), "tuned": [], "built-in": [], **{name: [] for name in PEERS}}
        for length in lengths:
            shape = bench.Shape(1, key.group_size * REFERENCE_KV_HEADS, REFERENCE_KV_HEADS, key.head_dim, length,
                                key.kv_dtype)
            inputs = bench.Inputs(shape, seed, torch)
            # The values the programs read: the format's own rounding is no error of theirs.
            ref = bench.kernel_reference(inputs) if shape.quantized else bench.reference_output(inputs)

            def percent(setup):
                entry, _ = bench.measure_case(harness, setup, ref)
                if not bench._ok(entry) or entry.get("rel_diff") is None or entry["rel_diff"] > bench.DIFF_FLAG_REL:
                    return None  # failed, or its output is off: no figure
                return bench.derived_figures(shape, entry["median_us"], None, copy_gbps)["pct_copy_bw"]

            result["tuned"].append(percent(lambda: bench.splitkv_case(inputs)))
            result["built-in"].append(percent(lambda: bench.splitkv_case(inputs, tuned=False)))
            for name, peers in PEERS.items():
                figures = [percent(lambda p=p: bench.PEER_SETUPS[p](inputs)) for p in peers]
                figures = [f for f in figures if f is not None]
                result[name].append(max(figures) if figures else None)
    return result
