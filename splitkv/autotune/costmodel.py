"""A cost-model objective: predicted µs without a GPU.

Not a measurement: it exists so that the search, its storage, resuming and the tables can be run
and tested where there is no GPU (CI, a laptop), and it is named as such wherever its figures
appear. The model: the bucket's K/V bytes at a bandwidth that grows with the bytes in flight
(CTAs x warps x stages x tile bytes, saturating), one launch, the waves of CTAs the planner's
split count needs, and a merge per split row; plus small per-field preferences, so the search has a
landscape with a known best point to find.
"""

from __future__ import annotations

import math

from ..spec import KernelSpec
from ..tuned import lookup
from ..tuned.keys import REFERENCE_KV_HEADS, Bucket, TuneKey
from .objective import Measurement, Objective

#: Model constants (H200-like): µs and bytes per µs.
LAUNCH_US = 4.0
PEAK_BYTES_PER_US = 4.2e6
SATURATING_BYTES_IN_FLIGHT = 12 * 1024 * 1024
MERGE_US = 2.0
NUM_SMS = 132


class CostModelObjective(Objective):
    name = "cost model (predicted µs, not measured)"

    def __init__(self, key: TuneKey, bucket: Bucket, arch: str = "sm_90"):
        self.key, self.bucket, self.arch = key, bucket, arch

    def runs(self, spec: KernelSpec | None) -> str:
        return launched(spec, self.key, self.bucket, self.arch).name

    def measure(self, spec: KernelSpec | None, iters: int | None = None) -> Measurement:
        return Measurement(predict_us(launched(spec, self.key, self.bucket, self.arch), self.bucket))


def launched(spec: KernelSpec | None, key: TuneKey, bucket: Bucket, arch: str) -> KernelSpec:
    """The program the runtime launches for a candidate (None: the built-in choice) on the bucket,
    in this model's planner: dense where the rows fill the SMs (or a tuned dense program forces
    it), else split (see `lookup.programs_for`)."""
    rows = bucket.batch * REFERENCE_KV_HEADS
    split, dense, forced = lookup.programs_for(spec, arch, key, rows, NUM_SMS)
    return dense if rows >= NUM_SMS or forced else split


def predict_us(spec: KernelSpec, bucket: Bucket) -> float:
    rows = bucket.batch * REFERENCE_KV_HEADS
    kv_bytes = rows * bucket.seq_len * spec.kv_bytes_per_token
    splits = 1
    if spec.variant == "split":
        splits = max(1, min(NUM_SMS // rows, math.ceil(bucket.seq_len / spec.chunk_size)))
    ctas = rows * splits
    in_flight = min(ctas, NUM_SMS * 2) * spec.ring_bytes
    bandwidth = PEAK_BYTES_PER_US * (1 - math.exp(-in_flight / SATURATING_BYTES_IN_FLIGHT))
    waves = math.ceil(ctas / (NUM_SMS * 2))
    stream = kv_bytes / bandwidth * (1 + 0.1 * (waves - 1))
    merge = 0.0 if splits == 1 else MERGE_US * (0.5 if spec.cluster > 1 else 1.0)
    prefs = (0.3 * (spec.kv_copy != "tma") + 0.2 * (spec.mma_m != "tokens") + 0.1 * (spec.stages == 4)
             + 0.05 * spec.chunk_size / 256)
    return LAUNCH_US + stream + merge + prefs
