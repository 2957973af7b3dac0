"""The report's bandwidth sweep: one sequence at each context length, timed with the tuned
programs, the built-in ones and the peers that are installed, in one process and one harness
(the benchmark's flush protocol: CUDA events, L2 flushed before each call, median), each checked
first against the benchmark's float64 reference over the values the programs read (for quantized
keys the dequantized cache, so the format's rounding does not count against anyone). Needs a GPU
and torch (the benchmark's inputs and peers).
"""

from __future__ import annotations

from ..tuned.keys import REFERENCE_KV_HEADS, TuneKey

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
#: Peers for one sequence (FlashInfer's tensor-core decode; with several, the faster is kept).
PEERS = {"FlashInfer": ("flashinfer-tc",)}


def sweepable(key: TuneKey) -> bool:
    """The benchmark's inputs are bf16 queries over bf16, FP8 or NVFP4 caches, contiguous."""
    return key.q_dtype == "bf16" and key.kv_dtype in ("bf16", "fp8_e4m3", "nvfp4") and not key.page_size


def sweep(key: TuneKey, lengths=LENGTHS, iters: int = 50, seed: int = 0) -> dict:
    """{'lengths': [...], 'tuned': [...], 'built-in': [...], peer: [...]}: % of the copy bandwidth
    (None where a program failed its check or could not run)."""
    import cupy
    import torch

    import splitkv

    from ..bench.cases import splitkv_case
    from ..bench.inputs import Layers
    from ..bench.peers import PEER_SETUPS
    from ..bench.protocols import Settings, prepare
    from ..bench.shapes import Shape
    from ..timing import Harness, gbps, median
    from .measure import FLUSH_BYTES, process_copy_gbps

    device = cupy.cuda.Device().id
    torch.cuda.set_device(device)  # torch's stream, tensors and CuPy's device must be one GPU
    harness = Harness(iters, 10, FLUSH_BYTES, torch)
    settings = Settings(rounds=1, iters=iters, protocols=("flush",))
    with harness.active():
        harness.flush_us = harness.flush_time_us()
        copy_gbps = process_copy_gbps(device, harness)  # the denominator of the table's figures too
        result = {"lengths": list(lengths), "tuned": [], "built-in": [], **{name: [] for name in PEERS}}
        for length in lengths:
            shape = Shape(1, key.group_size * REFERENCE_KV_HEADS, REFERENCE_KV_HEADS, key.head_dim, length,
                          key.kv_dtype)
            layers = Layers(shape, 1, seed, torch)

            def percent(make):
                _, ready = prepare("sweep", make, layers, harness, settings)
                if ready is None:
                    return None  # failed, or its output is off: no figure
                times = harness.time(ready.case.calls[0], iters, context=ready.case.context)
                return 100.0 * gbps(shape.total_bytes, median(times)) / copy_gbps

            result["tuned"].append(percent(lambda layers: splitkv_case(splitkv, layers)))
            result["built-in"].append(percent(lambda layers: splitkv_case(splitkv, layers, tuned=False)))
            for name, peers in PEERS.items():
                figures = [percent(PEER_SETUPS[p]) for p in peers]
                figures = [f for f in figures if f is not None]
                result[name].append(max(figures) if figures else None)
    return result
