"""The built-in choice of CTA shape per workload key, and occupancy arithmetic.

This is the fallback that tuned tables (a later addition) improve on: one CTA shape per
(head_dim, group size, dtypes) chosen from measurements on an H200, and the resident-CTA count
the planner needs, computed from the compiled kernel's registers and shared memory.
"""

from __future__ import annotations

from .spec import KernelSpec, arch_number, rows_fit_tma_boxes

#: Per-SM resources by compute capability major (Ampere through Blackwell have the same limits
#: except shared memory): registers, threads, CTAs, shared memory per SM in bytes.
_REGISTERS_PER_SM = 65536
_THREADS_PER_SM = {80: 2048, 86: 1536, 89: 1536, 90: 2048, 100: 2048}
_CTAS_PER_SM = {80: 32, 86: 16, 89: 24, 90: 32, 100: 32}
_SMEM_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 89: 100 * 1024, 90: 228 * 1024, 100: 228 * 1024}
#: The driver reserves 1 KB of shared memory per resident CTA.
_SMEM_RESERVED_PER_CTA = 1024


def default_spec(arch: str, head_dim: int, group_size: int, q_dtype: str = "bf16", kv_dtype: str = "bf16",
                 variant: str = "split") -> KernelSpec:
    """The built-in CTA shape: four warps, each streaming its own tiles through a ring in shared memory.

    On sm_90 and newer, K/V tiles arrive through tensor maps (``kv_copy="tma"``) wherever a row is a
    whole number of 128-byte boxes: a stream of 128 CTAs then reads as fast as a plain read kernel
    (H200, 64k: 72.1 µs vs 71.4 for the read floor, 75.4 with per-lane cp.async), and the decode is
    4-8% faster from 16k up, 1-6% at 1k-4k (H200, 13ca46a; BENCHMARKS.md). Elsewhere (sm_80,
    head_dim 96) every lane copies 16-byte pieces with cp.async.

    Split: 32-token tiles two stages deep, so one split gets a whole number of 128-token chunks
    (one tile per warp), fine enough for the planner to cut short sequences into many splits.
    Dense with cp.async: 16-token tiles three stages deep, three quarters of the ring's bytes, so two
    CTAs share an SM; the dense program runs when the batch alone fills the GPU, often in several
    waves, and there a second resident CTA hides the first one's prologue and tail (H200, D=128: 4-6%
    faster at B=64 x 1k and B=128 x 512, within 1% at B=16 x 4k). Dense with tensor maps: the split
    shape, faster than 16-token tiles three deep at B=64 x 1k (76.8 vs 77.8 µs). head_dim 256 keeps
    16-token tiles two stages deep for both, to fit the ring in shared memory. Groups up to 8 put the
    tokens on the MMA's 16 rows (``mma_m="tokens"``) instead of padding the query heads to 16 rows
    (H200, D=128, G=4: 1-3% faster up to 16k tokens, equal beyond).
    """
    dense = variant == "dense"
    tma = arch_number(arch) >= 90 and rows_fit_tma_boxes(head_dim, kv_dtype)
    small_dense = dense and not tma
    tile = 16 if head_dim > 128 or small_dense else 32
    stages = 3 if small_dense and head_dim <= 128 else 2
    warps = 4
    cluster = 16 if variant == "split" and arch_number(arch) >= 90 else 1
    return KernelSpec(arch=arch, head_dim=head_dim, group_size=group_size, q_dtype=q_dtype, kv_dtype=kv_dtype,
                      variant=variant, chunk_size=warps * tile, warps=warps, tile_tokens=tile, stages=stages,
                      cluster=cluster, kv_copy="tma" if tma else "cp_async",
                      mma_m="tokens" if group_size <= 8 else "heads")


def resident_ctas_per_sm(spec: KernelSpec, registers: int | None) -> int:
    """CTAs of ``spec`` one SM holds at once, limited by registers, threads, CTAs and shared memory."""
    arch = arch_number(spec.arch)
    key = arch if arch in _THREADS_PER_SM else 90
    limits = [_THREADS_PER_SM[key] // spec.threads, _CTAS_PER_SM[key],
              _SMEM_PER_SM[key] // (spec.smem_bytes + spec.static_smem_bytes + _SMEM_RESERVED_PER_CTA)]
    if registers:
        # Registers are allocated per warp in units of 256.
        per_warp = -(-registers * 32 // 256) * 256
        limits.append(_REGISTERS_PER_SM // per_warp // spec.warps)
    return max(1, min(limits))
