"""The GPU objective: a candidate planned as the runtime plans it, checked against a float64
reference on random inputs, then timed with the benchmark's protocol.

Per bucket, once: random inputs (normal values, never zeros; quantized on the GPU for FP8 and
NVFP4 keys, laid out in pages of a random order for paged keys), the float64 reference over the
values the program reads (the dequantized ones for quantized keys), and the output poisoned with
NaN before every checked call. Per candidate: the check (max |out - ref| within
``TOLERANCE`` x max |ref|), then CUDA events around each call, the L2 flushed before each, the
median of ``iters`` calls (`splitkv.bench.Harness`). Bandwidth is given as a share of the
device-to-device copy bandwidth measured in the same process.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..spec import QUANTIZED_KV_DTYPES, KernelSpec, MergeSpec
from . import lookup
from .keys import REFERENCE_KV_HEADS, Bucket, TuneKey
from .objective import Measurement, Objective, TrialFailed

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

        from ..bench import Harness

        self.key, self.bucket = key, bucket
        device = cupy.cuda.Device()
        self.arch = "sm_" + device.compute_capability
        self.jobs = jobs
        self.iters = iters
        self.harness = Harness(iters, warmup, FLUSH_BYTES)
        with self.harness.active():
            self.harness.flush_us = self.harness.flush_time_us()
            self.copy_gbps = copy_gbps or copy_bandwidth_gbps(self.harness)
            self.inputs = BucketInputs(key, bucket, seed)
        self.builtin_split, self.builtin_dense, _ = lookup.programs(None, self.arch, key)

    # ---- compile ------------------------------------------------------------------------------
    def prepare(self, specs) -> dict:
        """Compile each candidate with the cluster sizes its plans may take and the programs it
        is planned with, ``jobs`` at a time (NVRTC releases the GIL); {name: reason} of failures."""
        from ..codegen import compile_cubin

        needed = {spec.name: [spec, *_companions(spec, self.builtin_split, self.builtin_dense)] for spec in specs}
        every = {s.name: s for group in needed.values() for s in group}
        with ThreadPoolExecutor(max_workers=max(1, self.jobs)) as pool:
            futures = {name: pool.submit(compile_cubin, s) for name, s in every.items()}
        errors = {}
        for name, fut in futures.items():
            try:
                fut.result()
            except Exception as e:  # CompileError and its kin: the trial fails with the reason
                errors[name] = f"compile {name}: {type(e).__name__}: {_first_lines(e)}"
        failures = {}
        for name, group in needed.items():
            reasons = [errors[s.name] for s in group if s.name in errors]
            if reasons:
                failures[name] = reasons[0]
        return failures

    # ---- measure ------------------------------------------------------------------------------
    def measure(self, spec: KernelSpec | None, iters: int | None = None) -> Measurement:
        from .. import DecodeAttention

        k, inp = self.key, self.inputs
        try:
            with self.harness.active():
                paging = dict(page_size=k.page_size or None, kv_layout=k.kv_layout)
                heads = (k.group_size * REFERENCE_KV_HEADS, REFERENCE_KV_HEADS, k.head_dim)
                if spec is None:
                    attn = DecodeAttention(*heads, q_dtype=k.q_dtype, kv_dtype=k.kv_dtype, tuned=False, **paging)
                    variant = None
                else:
                    split, dense, dense_only = lookup.programs(spec, self.arch, k)
                    attn = DecodeAttention(*heads, q_dtype=k.q_dtype, kv_dtype=k.kv_dtype, spec=split,
                                           dense_spec=dense, **paging)
                    variant = "dense" if dense_only else None
                attn.plan(inp.seq_lens, block_table=inp.block_table, variant=variant)
                inp.poison_output()

                def call():
                    attn.run(inp.q, inp.k, inp.v, out=inp.out)

                call()
                self.harness.synchronize()
                error = inp.error()
                if not error <= TOLERANCE:
                    raise TrialFailed(f"wrong result: max error {error:.3g} of max |ref| (tolerance {TOLERANCE})")
                times = self.harness.time(call, iters or self.iters)
        except TrialFailed:
            raise
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run is a failed trial
            raise TrialFailed(f"{type(e).__name__}: {_first_lines(e)}") from e
        us = float(np.median(times))
        pct = 100.0 * inp.bytes_moved / (us * 1e-6) / 1e9 / self.copy_gbps
        return Measurement(us, pct, dict(plan=attn.plan_info))


def _companions(spec: KernelSpec, builtin_split: KernelSpec, builtin_dense: KernelSpec) -> list:
    """The other programs a candidate's plans load: the built-in program of the other variant, the
    cluster sizes the planner may fit (powers of two), and the merge program."""
    out = [builtin_split if spec.variant == "dense" else builtin_dense]
    if spec.variant == "split":
        size = 2
        while size <= spec.cluster:
            out.append(spec.replace(cluster=size))
            size *= 2
        out.append(spec.replace(cluster=1))
    out.append(MergeSpec(arch=spec.arch, head_dim=spec.head_dim, out_dtype=spec.q_dtype))
    return out


def copy_bandwidth_gbps(harness) -> float:
    """Device-to-device copy bandwidth (read + written bytes), median of 20 copies of 1 GiB."""
    from ..floor import DeviceCopy

    copy = DeviceCopy(COPY_BYTES)
    times = harness.time(copy, 20)
    return copy.bytes_moved / (float(np.median(times)) * 1e-6) / 1e9


class BucketInputs:
    """The bucket's inputs on the current device, its reference, and the output buffer."""

    def __init__(self, key: TuneKey, bucket: Bucket, seed: int):
        import cupy

        import splitkv

        rng = cupy.random.default_rng(seed)
        hkv, g, d = REFERENCE_KV_HEADS, key.group_size, key.head_dim
        batch, length = bucket.batch, bucket.seq_len
        self.seq_lens = [length] * batch
        q = _random(rng, (batch, hkv * g, d), key.q_dtype)
        quantized = key.kv_dtype in QUANTIZED_KV_DTYPES
        k16 = _random(rng, (batch, length, hkv, d), "bf16" if quantized else key.kv_dtype)
        v16 = _random(rng, (batch, length, hkv, d), "bf16" if quantized else key.kv_dtype)
        if quantized:
            k, v = splitkv.quantize_kv(k16, key.kv_dtype), splitkv.quantize_kv(v16, key.kv_dtype)
            k64 = cupy.asarray(k.dequantize_reference())
            v64 = cupy.asarray(v.dequantize_reference())
            kv_bytes = sum(_nbytes(x) for x in (k.values, k.block_scales, v.values, v.block_scales))
        else:
            k, v = k16, v16
            k64, v64 = _as_f64(k16, key.kv_dtype), _as_f64(v16, key.kv_dtype)
            kv_bytes = _nbytes(k) + _nbytes(v)
        self.block_table = None
        if key.page_size:
            k, v, self.block_table = _paged(k, v, key, batch, length, seed)
        self.q, self.k, self.v = q, k, v
        self.out = cupy.empty_like(q)
        self.bytes_moved = kv_bytes + 2 * _nbytes(q)
        self.ref = _reference(_as_f64(q, key.q_dtype), k64, v64, 1.0 / math.sqrt(d))
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
    """Normal values in bf16 (uint16 bits, round to nearest even) or fp16."""
    import cupy

    x = rng.standard_normal(shape, dtype=cupy.float32)
    if dtype == "fp16":
        return x.astype(cupy.float16)
    bits = x.view(cupy.uint32)
    return ((bits + cupy.uint32(0x7FFF) + ((bits >> 16) & cupy.uint32(1))) >> 16).astype(cupy.uint16)


def _as_f64(x, dtype: str):
    import cupy

    if dtype == "bf16":
        return (x.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)
    return x.astype(cupy.float64)


def _nbytes(x) -> int:
    return 0 if x is None else int(x.nbytes)


def _reference(q, k, v, scale):
    """float64 attention, every sequence of the same length: q [B, Hq, D], k/v [B, L, Hkv, D]."""
    import cupy

    batch, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(batch, hkv, hq // hkv, d)
    logits = cupy.einsum("bhgd,blhd->bhgl", qg, k) * scale
    logits -= logits.max(axis=-1, keepdims=True)
    p = cupy.exp(logits)
    out = cupy.einsum("bhgl,blhd->bhgd", p, v) / p.sum(axis=-1)[..., None]
    return out.reshape(batch, hq, d)


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


def _first_lines(exc: BaseException, lines: int = 6) -> str:
    return "\n".join(str(exc).strip().splitlines()[:lines])
