"""Random measuring inputs on the GPU: normal values rounded to bf16, never zeros.

Zeros would let a memory system or a kernel take shortcuts that real activations never allow;
the benchmark, its tools and the tuner all draw their inputs here.
"""

from __future__ import annotations


def random_bf16(rng, shape):
    """Random normal values from a CuPy generator ``rng``, rounded to bf16 (round to nearest
    even), stored as uint16 bits (CuPy has no bf16 type)."""
    import cupy

    bits = rng.standard_normal(shape, dtype=cupy.float32).view(cupy.uint32)
    bits = (bits + cupy.uint32(0x7FFF) + ((bits >> 16) & cupy.uint32(1))) >> 16
    return bits.astype(cupy.uint16)
