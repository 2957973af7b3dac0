"""What the GPU decode tests share: random inputs as the kernel stores them with float64 copies of
their exact values, outputs poisoned with NaN, the float64 reference (on the GPU, in CuPy) and the
bounds an output and its LSE are held to.

It needs CuPy: a test module importing it without CuPy is skipped at import, as with its own
importorskip (an error under SPLITKV_REQUIRE_GPU=1, see tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

import seeds

cupy = pytest.importorskip("cupy")

#: bf16: 8 significant bits in P and in the output; fp16: 11.
REL_TOL = {"bf16": 1e-2, "fp16": 3e-3}
#: A generator per key, from the run's seed (tests/seeds.py; SPLITKV_TEST_SEED replays a run).
_rng = seeds.rng


def fresh_seed(n: int) -> int:
    """Seed ``n`` of this run: a test's numbered inputs are a new draw every run (as `_rng`'s are;
    SPLITKV_TEST_SEED replays a run)."""
    return int(_rng("numbered seed", n).integers(2**31))


# ---- random inputs as the kernel sees them ---------------------------------------------------------
def random_values(shape, dtype: str, seed: int, scale: float = 1.0):
    """(device array in the kernel's storage type, float64 device copy of the exact values)."""
    gen = cupy.random.default_rng(seed)
    x = gen.standard_normal(shape, dtype=cupy.float32) * scale
    if dtype == "fp16":
        stored = x.astype(cupy.float16)
        return stored, stored.astype(cupy.float64)
    bits = x.view(cupy.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    stored = rounded.astype(cupy.uint16)
    return stored, (stored.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)


def to_float64(stored, dtype: str):
    if dtype == "fp16":
        return stored.astype(cupy.float64)
    return (stored.astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)


def poisoned(shape, dtype: str):
    """An output buffer full of NaN (bf16 NaN bits in CuPy's uint16 storage)."""
    if dtype == "bf16":
        return cupy.full(shape, 0x7FC0, dtype=cupy.uint16)
    return cupy.full(shape, cupy.nan, dtype=cupy.float16)


def reference(q64, k64, v64, lens, sm_scale):
    """float64 attention per sequence: out [B, Hq, D], natural-log lse [B, Hq]."""
    batch, num_qo, dim = q64.shape
    num_kv = k64.shape[2]
    group = num_qo // num_kv
    out = cupy.zeros((batch, num_qo, dim), cupy.float64)
    lse = cupy.full((batch, num_qo), -cupy.inf, cupy.float64)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        qg = q64[b].reshape(num_kv, group, dim)
        scores = cupy.einsum("hgd,lhd->hgl", qg, k64[b, :n]) * sm_scale
        m = scores.max(axis=2, keepdims=True)
        p = cupy.exp(scores - m)
        total = p.sum(axis=2, keepdims=True)
        out[b] = (cupy.einsum("hgl,lhd->hgd", p, v64[b, :n]) / total).reshape(num_qo, dim)
        lse[b] = (m + cupy.log(total)).reshape(num_qo)
    return out, lse


def check_close(out, lse, ref_out, ref_lse, lens, dtype, label, tol_dtype=None):
    out_dtype, dtype = dtype, tol_dtype or dtype  # the bound follows the type the products are taken in
    out64 = to_float64(out, out_dtype)
    assert bool(cupy.isfinite(out64).all()), f"{label}: non-finite output (unwritten or NaN)"
    err = out64 - ref_out
    rel = float(cupy.linalg.norm(err) / max(float(cupy.linalg.norm(ref_out)), 1e-30))
    # Element-wise: within the format's rounding of the element plus a share of its row's scale.
    row_scale = cupy.abs(ref_out).max(axis=2, keepdims=True)
    bound = REL_TOL[dtype] * (cupy.abs(ref_out) + row_scale)
    worst = float((cupy.abs(err) - bound).max())
    print(f"{label}: rel err {rel:.2e}")
    assert rel < REL_TOL[dtype], f"{label}: relative error {rel:.3e}"
    assert worst <= 0, f"{label}: an element is off by {worst:.3e} beyond its bound"
    empty = np.flatnonzero(np.asarray(lens) == 0)
    if empty.size:
        assert bool((out64[empty] == 0).all()), f"{label}: empty sequence must give zeros"
    if lse is not None:
        lse_h, ref_h = cupy.asnumpy(lse).astype(np.float64), cupy.asnumpy(ref_lse)
        finite = np.isfinite(ref_h)
        assert np.array_equal(np.isneginf(lse_h), ~finite), f"{label}: lse -inf exactly for empty rows"
        # Absolute, per row, so that a lost tile breaks it (at 131072 random tokens a 32-token
        # tile moves the LSE by about 2.4e-4, twice the bound there): the float32 sums of up
        # to 2^17 exponentials and the approximate exp2 and log2 (2e-5), and the float32
        # roundings of the scaled logits, which grow with them (2^-17 of |lse|: the dot's
        # accumulation over head_dim products, the scale, the max, the merges). Where Q is
        # converted to another type for the MMAs (``tol_dtype``) the logits carry its rounding
        # (bf16: 2^-9 of each product), so the bound follows their magnitude as before.
        magnitude = np.abs(ref_h[finite])
        if tol_dtype is not None and tol_dtype != out_dtype:
            lse_bound = 1e-3 * np.maximum(1.0, magnitude.max(initial=1.0))
        else:
            lse_bound = 2e-5 + 2.0 ** -17 * magnitude
        lse_err = np.abs(lse_h[finite] - ref_h[finite])
        over = np.flatnonzero(lse_err > lse_bound)
        if finite.any():
            print(f"{label}: lse err {lse_err.max():.2e} ({(lse_err / lse_bound).max():.2f} of its bound)")
        assert over.size == 0, (f"{label}: lse off by {lse_err[over[0]]:.3e} at |lse| {magnitude[over[0]]:.3g}, bound "
                                f"{np.broadcast_to(lse_bound, lse_err.shape)[over[0]]:.2e} ({over.size} rows over)")
