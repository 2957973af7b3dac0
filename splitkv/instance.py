"""What a `DecodeAttention` is made with: its arguments checked, and the programs it plans with
before any tuned table is consulted (the built-in shapes, or the caller's specs).

Pure (no GPU): the constructor checks its arguments before it asks CuPy for the device, and
chooses the programs once it knows the device's arch.
"""

from __future__ import annotations

import numbers

from . import tensors
from .choices import KV_DTYPES, KV_LAYOUTS, PAGE_SIZES, Q_DTYPES
from .heuristics import default_spec
from .spec import KernelSpec


def check_arguments(num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, sm_scale, page_size, kv_layout,
                    device) -> tuple[int, int, int, float | None]:
    """The head counts and head dim as ints, and the checked sm_scale; TypeError or ValueError naming
    the first argument that is wrong."""
    for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {value!r}")
        if value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    num_qo_heads, num_kv_heads, head_dim = int(num_qo_heads), int(num_kv_heads), int(head_dim)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    sm_scale = tensors.check_sm_scale(sm_scale)
    for name, value, allowed in (("q_dtype", q_dtype, Q_DTYPES), ("kv_dtype", kv_dtype, KV_DTYPES)):
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")
    if page_size is not None and (isinstance(page_size, bool) or page_size not in PAGE_SIZES):
        raise ValueError(f"page_size: expected None (contiguous caches) or a power of two from 1 to "
                         f"{PAGE_SIZES[-1]}, got {page_size!r}")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {list(KV_LAYOUTS)}, got {kv_layout!r}")
    if page_size is None and kv_layout == "HND" and kv_dtype not in ("bf16", "fp16"):
        raise ValueError(f"kv_layout: contiguous 'HND' caches [B, Hkv, L, D] hold bf16 or fp16 K/V; {kv_dtype!r} "
                         f"caches are 'NHD' [B, L, Hkv, ...] or paged")
    if device is not None and (isinstance(device, bool) or not isinstance(device, numbers.Integral)):
        raise TypeError(f"device: expected a CUDA device ordinal (int) or None, got {device!r}")
    return num_qo_heads, num_kv_heads, head_dim, sm_scale


def starting_programs(arch: str, layout: tuple, paging: dict, spec: KernelSpec | None,
                      dense_spec: KernelSpec | None) -> tuple[KernelSpec, KernelSpec]:
    """The split and dense programs of an instance of ``layout`` (head_dim, group, q_dtype,
    kv_dtype) on ``arch`` with ``paging`` (page_size, kv_layout): the caller's ``spec`` (both
    programs of its CTA shape) and ``dense_spec``, else the built-in shapes. ValueError for a given
    spec of another layout, or with warp_heads (which plans choose)."""
    for name, given in (("spec", spec), ("dense_spec", dense_spec)):
        if given is not None and (given.head_dim, given.group_size, given.q_dtype, given.kv_dtype) != layout:
            head_dim, group, q_dtype, kv_dtype = layout
            raise ValueError(f"{name}: {given.name} does not match head_dim={head_dim}, group={group}, "
                             f"q_dtype={q_dtype}, kv_dtype={kv_dtype}")
        if given is not None and given.warp_heads:
            raise ValueError(f"{name}: warp_heads is chosen per plan, not per instance; "
                             "use plan(..., warp_heads=True)")
    # A given program's attention variant comes from each plan: its CTA shape is what it gives,
    # for the query tokens it gives (row slices share rings, so a shape of several tokens may
    # hold more rings than one token's would: such a shape serves plans of its own tokens).
    base = spec.with_variant(spec.query_tokens) if spec is not None else default_spec(arch, *layout, **paging)
    split = base.replace(arch=arch, variant="split", **paging)
    if dense_spec is not None:
        dense = dense_spec.with_variant(dense_spec.query_tokens).replace(arch=arch, **paging).as_dense()
    elif spec is None:  # the built-in shapes differ between the programs
        dense = default_spec(arch, *layout, "dense", **paging)
    else:
        dense = base.replace(arch=arch, **paging).as_dense()
    return split, dense
