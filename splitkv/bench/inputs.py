"""The inputs of one shape and the check every output passes before it is timed.

`Layers` holds the serving protocol's layers (each its own q, K and V, random normal, never
zeros; the caches quantized on the GPU for FP8 and NVFP4 shapes) and their float64 reference:
attention over the values the programs read (for a quantized cache, the cache dequantized; the
format's own rounding is no implementation's error). `check` compares outputs with it.

`random_bf16_qkv` and `random_qkv` give the CuPy inputs of the tools under bench/ that time
splitkv alone.
"""

from __future__ import annotations

import hashlib
import math

from ..quantize import quantize_kv
from ..timing import random_bf16
from .shapes import Shape

#: Largest error an output may show, relative to the largest reference value, to be timed: bf16
#: outputs are rounded to 2^-9 relative, and a lost or doubled tile at these lengths moves the
#: output by far more (the needle tests see a single tile; this check sees a wrong program).
TOLERANCE = 1e-2


class Layers:
    """``count`` layers of one shape, as torch tensors on the current GPU: ``q[i]`` [B, Hq, D] bf16
    ([B, T, Hq, D] for T query tokens), ``k[i]`` and ``v[i]`` [B, L, Hkv, D] (bf16, or the
    `splitkv.QuantizedKV` of that shape's format, per-tensor scale), ``sinks[i]`` float32 [Hq]
    (shapes with sinks). ``k_bf16_0``, ``v_bf16_0``: layer 0's values before quantization."""

    def __init__(self, shape: Shape, count: int, seed: int, torch_mod):
        self.shape, self.count, self.torch = shape, int(count), torch_mod
        b, hq, hkv, d, n = shape.batch, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.seq_len
        gen = torch_mod.Generator(device="cuda")
        gen.manual_seed(seed)
        opts = dict(device="cuda", dtype=torch_mod.bfloat16, generator=gen)
        self.q, self.k, self.v, self.sinks = [], [], [], []
        q_shape = (b, shape.query_tokens, hq, d) if shape.query_tokens > 1 else (b, hq, d)
        for i in range(self.count):
            self.q.append(torch_mod.randn(q_shape, **opts))
            if shape.sinks:
                # Around the log of the attended tokens, so that each sink holds a share of its
                # row's denominator like the tokens' together (~L e^0.5 at these scores' spread),
                # and a sink that is dropped fails the output check at any L.
                attended = min(n, shape.window_left + 1) if shape.window_left >= 0 else n
                self.sinks.append(torch_mod.randn((hq,), device="cuda", dtype=torch_mod.float32, generator=gen) * 2
                                  + math.log(attended))
            k, v = torch_mod.randn((b, n, hkv, d), **opts), torch_mod.randn((b, n, hkv, d), **opts)
            if i == 0:
                self.k_bf16_0, self.v_bf16_0 = k, v
            if shape.quantized:
                k, v = quantize_kv(k, shape.kv_dtype), quantize_kv(v, shape.kv_dtype)
            self.k.append(k)
            self.v.append(v)
        self._memo = {}

    def memo(self, key, make):
        """``make()`` once per key: derived inputs that several implementations share (SDPA's
        [B, Hkv, L, D] copies, say)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def kv_values(self, i: int):
        """Layer ``i``'s K and V as the programs read them, float64 torch tensors [B, L, Hkv, D]."""
        torch = self.torch
        if not self.shape.quantized:
            return self.k[i].double(), self.v[i].double()
        return tuple(torch.from_dlpack(c.dequantize_reference(on_device=True)) for c in (self.k[i], self.v[i]))

    def reference(self, queries=None, key: str = "") -> list:
        """Each layer's float64 output over the values the programs read; over ``queries`` (one per
        layer, any float dtype, named by ``key``) instead of ``q`` when an implementation reads
        another query (FA3's FP8 one). Computed once per key."""
        if queries is not None and not key:
            raise ValueError("reference: other queries need a key of their own")
        return self.memo(("reference", key), lambda: [
            attention_f64(self.q[i] if queries is None else queries[i], *self.kv_values(i), self.torch,
                          self.shape, self.sinks[i] if self.sinks else None)
            for i in range(self.count)])

    def end_to_end_reference(self):
        """Layer 0's float64 output over the values before quantization (quantized shapes): the
        error of a format and a program together."""
        return self.memo("end_to_end", lambda: attention_f64(
            self.q[0], self.k_bf16_0.double(), self.v_bf16_0.double(), self.torch, self.shape,
            self.sinks[0] if self.sinks else None))


def attention_f64(q, k, v, torch_mod, shape: Shape | None = None, sinks=None):
    """float64 attention: q [B, Hq, D] (or [B, T, Hq, D]: T query tokens, causal among them), k
    and v [B, L, Hkv, D], query head h reading K/V head h // (Hq / Hkv), scale 1/sqrt(D), with the
    ``shape``'s window and soft-cap and the ``sinks`` [Hq] (`splitkv.variants` states them); out of
    q's shape. One sequence at a time, so that a long cache in float64 is the largest temporary."""
    tokens = q.ndim == 4
    q4 = q if tokens else q.unsqueeze(1)
    b, t, hq, d = q4.shape
    length, hkv = k.shape[1], k.shape[2]
    out = torch_mod.empty((b, t, hq, d), dtype=torch_mod.float64, device=q.device)
    scale = 1.0 / math.sqrt(d)
    window = shape.window_left if shape is not None else -1
    cap = shape.soft_cap if shape is not None else 0.0
    position = torch_mod.arange(length - t, length, device=q.device)[:, None]  # [T, 1]: each query's
    token = torch_mod.arange(length, device=q.device)[None, :]
    keep = token <= position
    if window >= 0:
        keep &= token >= position - window
    for i in range(b):
        qi = q4[i].double().view(t, hkv, hq // hkv, d)
        scores = torch_mod.einsum("thgd,lhd->hgtl", qi, k[i].double()) * scale
        if cap > 0:
            scores = cap * torch_mod.tanh(scores / cap)
        scores = scores.masked_fill(~keep, -math.inf)
        if sinks is not None:  # a column of its own in the softmax, with no value
            sink = sinks.double().view(hkv, hq // hkv, 1, 1).expand(hkv, hq // hkv, t, 1)
            probs = torch_mod.softmax(torch_mod.cat([scores, sink], dim=-1), dim=-1)[..., :length]
        else:
            probs = torch_mod.softmax(scores, dim=-1)
        out[i] = torch_mod.einsum("hgtl,lhd->thgd", probs, v[i].double()).reshape(t, hq, d)
    return out if tokens else out[:, 0]


def poison(outputs) -> None:
    """NaN in every output element: an output a program never writes cannot pass `check`."""
    for out in outputs:
        out.fill_(float("nan"))


def check(outputs, references, tolerance: float = TOLERANCE) -> dict:
    """The worst layer's max |out - ref| (``max_abs_err``) and that over its max |ref|
    (``rel_err``); ``ok`` when every output is finite and ``rel_err <= tolerance``; ``digest``, a
    hash of the outputs' bytes, by which two trees' outputs of the same inputs compare bit for bit."""
    if len(outputs) != len(references):
        raise ValueError(f"check: {len(outputs)} outputs for {len(references)} references")
    worst_rel, worst_abs = 0.0, 0.0
    for out, ref in zip(outputs, references):
        o = out.double().reshape(ref.shape)
        if not bool(o.isfinite().all()):
            return {"ok": False, "rel_err": None, "max_abs_err": None, "nonfinite_output": True,
                    "layers_checked": len(outputs), "tolerance": tolerance}
        diff = (o - ref).abs().max().item()
        scale = ref.abs().max().item()
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / scale if scale > 0 else math.inf)
    return {"ok": worst_rel <= tolerance, "rel_err": worst_rel, "max_abs_err": worst_abs,
            "layers_checked": len(outputs), "tolerance": tolerance, "digest": digest(outputs)}


def digest(outputs) -> str:
    """SHA-256 of the outputs' values as float64, layer after layer (exact for bf16 and fp16, so two
    outputs hash alike exactly when they are the same bits; `check` has refused non-finite ones)."""
    h = hashlib.sha256()
    for out in outputs:
        h.update(out.double().cpu().numpy().tobytes())
    return h.hexdigest()


def relative_error(out, ref) -> float | None:
    """max |out - ref| / max |ref| of one output (None when not finite)."""
    o = out.double().reshape(ref.shape)
    if not bool(o.isfinite().all()):
        return None
    return (o - ref).abs().max().item() / max(ref.abs().max().item(), 1e-300)


def random_bf16_qkv(shape: Shape, seed: int = 0):
    """CuPy q [B, Hq, D], k and v [B, L, Hkv, D] of random bf16 values (uint16 bits), and an empty
    out like q: the inputs of the tools that time splitkv alone (bench/ablate.py and others)."""
    import cupy

    rng = cupy.random.default_rng(seed)
    b, hq, hkv, d, n = shape.batch, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.seq_len
    q = random_bf16(rng, (b, hq, d))
    k, v = random_bf16(rng, (b, n, hkv, d)), random_bf16(rng, (b, n, hkv, d))
    return q, k, v, cupy.empty_like(q)


def random_qkv(shape: Shape, seed: int = 0):
    """As random_bf16_qkv, with k and v quantized on the GPU into the shape's K/V format (as the
    benchmark does) when it is not bf16."""
    q, k, v, out = random_bf16_qkv(shape, seed)
    if shape.quantized:
        k, v = quantize_kv(k, shape.kv_dtype), quantize_kv(v, shape.kv_dtype)
    return q, k, v, out
