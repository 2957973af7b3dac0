"""The GPU objective: a candidate planned as the runtime plans it, checked against a float64
reference on random inputs, then timed with the benchmark's protocol.

Per bucket, once: random inputs (normal values, never zeros; quantized on the GPU for FP8 and
NVFP4 keys, laid out in pages of a random order for paged keys), the float64 reference over the
values the program reads (the dequantized ones for quantized keys), and the output poisoned with
NaN before every checked call. Per candidate: the check (max |out - ref| within
``TOLERANCE`` x max |ref|), then CUDA events around each call, the L2 flushed before each, the
median of ``iters`` calls (`splitkv.timing.Harness`). Bandwidth is given as a share of the
device-to-device copy bandwidth measured in the same process.
"""

from __future__ import annotations

import math
import numpy as np

from ..choices import QUANTIZED_KV_DTYPES
from ..spec import KernelSpec, MergeSpec
from ..tuned import lookup
from ..tuned.keys import REFERENCE_KV_HEADS, Bucket, TuneKey
from .compiling import first_lines as _first_lines
from .objective import ContextLost, Measurement, Objective, TrialFailed

#: Largest error a candidate may show, relative to the largest reference value (outputs are
#: rounded to 16 bits: 2^-8 relative per element).
TOLERANCE = 1e-2
FLUSH_BYTES = 256 << 20
COPY_BYTES = 1 << 30
_BF16_NAN = 0x7FC0  # bf16 outputs are uint16 bit patterns


class GpuObjective(Objective):
    name = "GPU (median µs, CUDA events, cold L2)"

    def __init__(self, key: TuneKey, bucket: Bucket, *, iters: int = 30, warmup: int = 5, jobs: int = 8,
                 seed: int = 0, copy_gbps: float | None = None):
        import cupy

        from ..timing import Harness

        self.key, self.bucket = key, bucket
        device = cupy.cuda.Device()
        self.arch = "sm_" + device.compute_capability
        self.num_sms = device.attributes["MultiProcessorCount"]
        self.jobs = jobs
        self.iters = iters
        self.harness = Harness(iters, warmup, FLUSH_BYTES)
        self.seed = seed
        with self.harness.active():
            self.harness.flush_us = self.harness.flush_time_us()
            self.copy_gbps = copy_gbps or process_copy_gbps(device.id, self.harness)
            self.inputs = BucketInputs(key, [bucket.seq_len] * bucket.batch, seed)
        self.builtin_split, self.builtin_dense, _ = lookup.programs(None, self.arch, key)

    def close(self) -> None:
        """Free the bucket's inputs and the flush buffer, and hand CuPy's pooled blocks back."""
        import cupy

        self.inputs = self.harness = None
        cupy.get_default_memory_pool().free_all_blocks()

    # ---- compile ------------------------------------------------------------------------------
    def programs(self, spec) -> list:
        """The candidate, the cluster sizes its plans may take and the programs it is planned with."""
        return [spec, *_companions(spec, self.builtin_split, self.builtin_dense)]

    def compile(self, program) -> None:
        from ..codegen import compile_cubin

        compile_cubin(program)

    def failure_is_final(self, error: BaseException) -> bool:
        """NVRTC's refusal is; a cache folder that cannot be written, say, may not be."""
        from ..codegen import CompileError

        return isinstance(error, CompileError)

    # ---- measure ------------------------------------------------------------------------------
    def measure(self, spec: KernelSpec | None, iters: int | None = None) -> Measurement:
        inp = self.inputs
        with self.harness.active():
            attn, call = self._checked(spec, inp, variant=None)
            try:
                times = self.harness.time(call, iters or self.iters)
            except Exception as e:  # noqa: BLE001 - a candidate that cannot run is a failed trial
                raise _failure(e) from e
        us = float(np.median(times))
        pct = 100.0 * inp.bytes_moved / (us * 1e-6) / 1e9 / self.copy_gbps
        return Measurement(us, pct, dict(plan=attn.plan_info))

    def verify(self, spec: KernelSpec) -> str | None:
        """A winner checked once more on a ragged batch of lengths no chunk, tile or page divides: a
        split program planned as the runtime plans it and as its units program (which the runtime
        takes for ragged batches), a dense program forced dense; the reason it fails, or None."""
        n = self.bucket.seq_len
        lens = [max(n - 37, 1), n // 3 + 5]
        # A dense winner is forced where it serves (two sequences alone would be split); a split one
        # also runs as the units program the runtime takes for ragged batches, where it takes one
        # (not for rows of several row blocks per K/V head: see DecodeAttention.plan).
        if spec.variant == "dense":
            variants = ["dense"]
        else:
            variants = [None, "units"] if spec.rows_fit_units else [None]
        variant = variants[0]
        try:
            with self.harness.active():
                try:
                    inputs = BucketInputs(self.key, lens, self.seed + 1)
                except Exception as e:  # noqa: BLE001 - out of memory, or the context gone
                    raise _failure(e) from e
                for variant in variants:
                    self._checked(spec, inputs, variant)
        except ContextLost:
            raise
        except TrialFailed as e:
            return f"lengths {lens}" + (f" ({variant} program)" if variant else "") + f": {e}"
        return None

    def runs(self, spec: KernelSpec | None) -> str:
        """The plan the runtime makes for ``spec`` on the bucket, programs named (nothing launched)."""
        try:
            with self.harness.active():
                return self._planned(spec, self.inputs, None).plan_info
        except Exception as e:  # noqa: BLE001 - a candidate that cannot be planned is a failed trial
            raise _failure(e) from e

    def _planned(self, spec: KernelSpec | None, inp: "BucketInputs", variant: str | None):
        """DecodeAttention planned for ``inp`` as the runtime plans ``spec`` (None: the built-in
        choice); ``variant`` 'units' forces the units program."""
        from .. import DecodeAttention

        k = self.key
        paging = dict(page_size=k.page_size or None, kv_layout=k.kv_layout)
        heads = (k.group_size * REFERENCE_KV_HEADS, REFERENCE_KV_HEADS, k.head_dim)
        if spec is None:
            attn = DecodeAttention(*heads, q_dtype=k.q_dtype, kv_dtype=k.kv_dtype, tuned=False, **paging)
        else:
            if variant is None:  # as the runtime takes a tuned entry for these rows
                split, dense, forced = lookup.programs_for(spec, self.arch, k, len(inp.seq_lens) * REFERENCE_KV_HEADS,
                                                           self.num_sms)
                variant = "dense" if forced else None
            else:  # the candidate's own programs, forced
                split, dense, _ = lookup.programs(spec, self.arch, k)
            attn = DecodeAttention(*heads, q_dtype=k.q_dtype, kv_dtype=k.kv_dtype, spec=split, dense_spec=dense,
                                   **paging)
            if self.served is not None and self.served.spec == spec:  # by its entry's rules, as served
                attn.tuned_entry = self.served
        attn.plan(inp.seq_lens, block_table=inp.block_table, variant=variant, query_tokens=k.query_tokens)
        return attn

    def _checked(self, spec: KernelSpec | None, inp: "BucketInputs", variant: str | None):
        """`checked_call` of DecodeAttention planned for ``inp`` as the runtime plans ``spec``
        (``variant`` 'units' forces the units program)."""
        return checked_call(lambda: self._planned(spec, inp, variant), inp, self.harness)


def checked_call(planned, inp: "BucketInputs", harness):
    """(``planned()``, a DecodeAttention planned for ``inp``, and its call on ``inp``), after one call
    checked against the reference into a poisoned output; raises TrialFailed (ContextLost when the
    GPU is gone)."""
    try:
        attn = planned()
        inp.poison_output()

        def call():
            attn.run(inp.q, inp.k, inp.v, out=inp.out)

        call()
        harness.synchronize()
        error = inp.error()
    except Exception as e:  # noqa: BLE001 - a candidate that cannot run is a failed trial
        raise _failure(e) from e
    if not error <= TOLERANCE:
        raise TrialFailed(f"wrong result: max error {error:.3g} of max |ref| (tolerance {TOLERANCE})")
    return attn, call


def _failure(e: BaseException) -> TrialFailed:
    """The failed trial for an exception: ContextLost when the GPU can no longer synchronise (a
    sticky error such as an illegal address poisons the context for everything after it)."""
    import cupy

    reason = f"{type(e).__name__}: {_first_lines(e)}"
    try:
        cupy.cuda.runtime.deviceSynchronize()
    except Exception as lost:  # noqa: BLE001 - whatever the driver says, nothing more can run
        return ContextLost(f"{reason} (then: {type(lost).__name__}: {_first_lines(lost)})")
    return TrialFailed(reason)


def _companions(spec: KernelSpec, builtin_split: KernelSpec, builtin_dense: KernelSpec) -> list:
    """The other programs a candidate's plans load, compiled with it in parallel: the built-in
    program of the other variant, the power-of-two cluster sizes the planner fits first (a size in
    between, which its whole-row search may ask for after those, compiles when asked), and the merge
    program."""
    out = [builtin_split if spec.variant == "dense" else builtin_dense]
    if spec.variant == "split":
        size = 2
        while size <= spec.cluster:
            out.append(spec.replace(cluster=size))
            size *= 2
        out.append(spec.replace(cluster=1))
    out.append(MergeSpec(arch=spec.arch, head_dim=spec.head_dim, out_dtype=spec.q_dtype))
    return out


_COPY_GBPS: dict = {}


def process_copy_gbps(device: int, harness) -> float:
    """`copy_bandwidth_gbps`, measured once per device and process: every entry of a run is a share
    of the same figure."""
    if device not in _COPY_GBPS:
        _COPY_GBPS[device] = copy_bandwidth_gbps(harness)
    return _COPY_GBPS[device]


def copy_bandwidth_gbps(harness) -> float:
    """Device-to-device copy bandwidth (read + written bytes), median of 20 copies of 1 GiB."""
    from ..timing import copy_bandwidth

    return copy_bandwidth(harness, COPY_BYTES, 20)["gbps"]


class BucketInputs:
    """Inputs of ``seq_lens`` sequences (8 K/V heads) for a key on the current device, the float64
    reference, and the output buffer. The cache holds the longest length for every sequence; the
    reference reads each sequence's own, one sequence at a time (so a 32 x 4k bucket at head_dim
    256 never holds its whole cache in float64)."""

    def __init__(self, key: TuneKey, seq_lens, seed: int):
        import cupy

        import splitkv

        rng = cupy.random.default_rng(seed)
        hkv, g, d = REFERENCE_KV_HEADS, key.group_size, key.head_dim
        self.seq_lens = [int(n) for n in seq_lens]
        batch, length = len(self.seq_lens), max(self.seq_lens)
        tokens = key.query_tokens
        q = _random(rng, (batch, tokens, hkv * g, d) if tokens > 1 else (batch, hkv * g, d), key.q_dtype)
        quantized = key.kv_dtype in QUANTIZED_KV_DTYPES
        k16 = _random(rng, (batch, length, hkv, d), "bf16" if quantized else key.kv_dtype)
        v16 = _random(rng, (batch, length, hkv, d), "bf16" if quantized else key.kv_dtype)
        if quantized:
            k, v = splitkv.quantize_kv(k16, key.kv_dtype), splitkv.quantize_kv(v16, key.kv_dtype)
            k64, v64 = k.dequantize_reference(on_device=True), v.dequantize_reference(on_device=True)

            def values(b, n):
                return k64[b, :n], v64[b, :n]
            kv_bytes = sum(_nbytes(x) for x in (k.values, k.block_scales, v.values, v.block_scales))
        else:
            k, v = k16, v16

            def values(b, n):
                return _as_f64(k16[b, :n], key.kv_dtype), _as_f64(v16[b, :n], key.kv_dtype)
            kv_bytes = _nbytes(k) + _nbytes(v)
        # What the programs read: every sequence's own tokens (the cache past them is never read).
        kv_bytes = kv_bytes * sum(self.seq_lens) // (batch * length)
        q64 = _as_f64(q, key.q_dtype)
        q64 = q64.reshape(batch, tokens, hkv * g, d)
        self.ref = cupy.stack([_reference(q64[b], *values(b, n), 1.0 / math.sqrt(d))
                               for b, n in enumerate(self.seq_lens)]).reshape(q.shape)
        self.block_table = None
        if key.page_size:
            k, v, self.block_table = _paged(k, v, key, batch, length, seed)
        self.q, self.k, self.v = q, k, v
        self.out = cupy.empty_like(q)
        self.bytes_moved = kv_bytes + 2 * _nbytes(q)
        self._out_dtype = key.q_dtype

    def poison_output(self) -> None:
        """NaN in every output element: a program that writes nothing cannot pass the check."""
        import cupy

        self.out.fill(_BF16_NAN if self.out.dtype == cupy.uint16 else cupy.nan)

    def error(self) -> float:
        """max |out - ref| / max |ref| (inf when the output holds a NaN)."""
        import cupy

        out = _as_f64(self.out, self._out_dtype)
        if not bool(cupy.isfinite(out).all()):
            return math.inf
        return float(cupy.abs(out - self.ref).max() / cupy.abs(self.ref).max())


def _random(rng, shape, dtype: str):
    """Normal values in bf16 (uint16 bits, as the benchmark draws them) or fp16."""
    import cupy

    from ..timing import random_bf16

    if dtype == "fp16":
        return rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
    return random_bf16(rng, shape)


def _as_f64(x, dtype: str):
    import cupy

    if dtype == "bf16":
        return (x.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)
    return x.astype(cupy.float64)


def _nbytes(x) -> int:
    return 0 if x is None else int(x.nbytes)


def _reference(q, k, v, scale):
    """float64 attention of one sequence: q [T, Hq, D] (its last T tokens, each attending to the
    positions up to its own), k and v [n, Hkv, D] -> [T, Hq, D]."""
    import cupy

    tokens, hq, d = q.shape
    n, hkv = k.shape[:2]
    qg = q.reshape(tokens, hkv, hq // hkv, d)
    logits = cupy.einsum("thgd,nhd->thgn", qg, k) * scale
    position = n - tokens + cupy.arange(tokens)
    attended = cupy.arange(n)[None, :] <= position[:, None]  # [T, n]: causal among the new tokens
    logits = cupy.where(attended[:, None, None, :], logits, -cupy.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    p = cupy.exp(logits)
    out = cupy.einsum("thgn,nhd->thgd", p, v) / p.sum(axis=-1)[..., None]
    return out.reshape(tokens, hq, d)


def _paged(k, v, key: TuneKey, batch: int, length: int, seed: int):
    """K and V (16-bit arrays or QuantizedKV) in pages of a random order, and their block table."""
    import cupy

    from ..paged import paginate
    from ..quantize import QuantizedKV

    pages = batch * -(-length // key.page_size)
    order = np.random.default_rng(seed).permutation(pages)

    def lay_out(x):
        if x is None:
            return None
        paged, table = paginate(cupy.asnumpy(x), key.page_size, key.kv_layout, order=order)
        return cupy.asarray(paged), table

    if isinstance(k, QuantizedKV):
        out = []
        for t in (k, v):
            values, table = lay_out(t.values)
            scales = lay_out(t.block_scales)
            out.append(QuantizedKV(t.kv_dtype, values, None if scales is None else scales[0], t.scale))
        return out[0], out[1], table
    (kp, table), (vp, _) = lay_out(k), lay_out(v)
    return kp, vp, table


