"""Code generation: render KernelSpecs with Jinja2 and compile them with NVRTC.

``render`` and ``compile_cubin`` need no GPU; ``load_kernel`` loads a compiled program onto the
current device.
"""

from __future__ import annotations

from ..arch import arch_number, parse_arch
from ..choices import HEAD_DIMS, KV_DTYPES, Q_DTYPES, QUANTIZE_FORMATS, QUANTIZED_KV_DTYPES
from ..heuristics import default_spec
from ..spec import KernelSpec, MergeSpec, QuantizeSpec
from .compile import CompileError, CompileResult, compile_cubin
from .render import helper_headers, render

#: Group sizes built ahead of time by ``splitkv-gen``; any other group in 1..16 compiles on first use.
DEFAULT_GROUP_SIZES = (1, 2, 4, 8, 16)


def default_specs(arch, *, head_dims=None, group_sizes=None, kv_dtypes=None, page_sizes=(0,),
                  kv_layout: str = "NHD") -> list:
    """The kernel set ``splitkv-gen --arch ARCH`` builds: for every head_dim, group size and K/V
    dtype, the dense, split and units decode programs in their built-in CTA shape (the dense one
    also with a warp per K/V head, which the planner takes for batches of many rows), with queries
    in the K/V dtype (bf16 and fp16 queries for the quantized formats), for contiguous caches and
    for pages of each of ``page_sizes`` (0: contiguous) in ``kv_layout``; the merge programs (of
    splits, and of a unit plan's merge table) per head_dim and output dtype; and the K/V quantizer
    per head_dim, input dtype and quantized format. Head dims a format does not take (NVFP4 needs
    a multiple of 64) are left out of its programs."""
    arch = parse_arch(arch)
    head_dims = tuple(head_dims or HEAD_DIMS)
    group_sizes = tuple(group_sizes or DEFAULT_GROUP_SIZES)
    # The quantized formats need sm_89's E4M3 conversion: below it they are left out of the default
    # set (asked for by name, they fail in KernelSpec with the reason).
    kv_dtypes = tuple(kv_dtypes or (d for d in KV_DTYPES if d not in QUANTIZED_KV_DTYPES or arch_number(arch) >= 89))
    specs: list = []
    for kv_dtype in kv_dtypes:
        for q_dtype in _query_dtypes(kv_dtype):
            for head_dim in head_dims:
                if kv_dtype == "nvfp4" and head_dim % 64:
                    continue
                for group in group_sizes:
                    for page_size in page_sizes:
                        paging = dict(page_size=page_size, kv_layout=kv_layout if page_size else "NHD")
                        dense = default_spec(arch, head_dim, group, q_dtype, kv_dtype, "dense", **paging)
                        specs.append(dense)
                        if dense.warps > 1:  # plan.pack_heads
                            specs.append(dense.replace(warp_heads=True))
                        split = default_spec(arch, head_dim, group, q_dtype, kv_dtype, "split", **paging)
                        specs += [split, split.as_units()]
    # Merge outputs and quantizer inputs: every query dtype the decode programs above take.
    for dtype in dict.fromkeys(q for d in kv_dtypes for q in _query_dtypes(d)):
        for head_dim in head_dims:
            specs += [MergeSpec(arch=arch, head_dim=head_dim, out_dtype=dtype, tables=tables) for tables in (False, True)]
            specs += [QuantizeSpec(arch=arch, head_dim=head_dim, in_dtype=dtype, kv_format=f) for f in QUANTIZE_FORMATS]
    return specs


def _query_dtypes(kv_dtype: str) -> tuple:
    """The query dtypes built for a K/V dtype: its own for 16-bit K/V, both for quantized ones."""
    return (kv_dtype,) if kv_dtype in Q_DTYPES else Q_DTYPES


def load_kernel(spec):
    """(CuPy function, CompileResult) for ``spec`` on the current GPU."""
    from .load import load_kernel as _load

    return _load(spec)


__all__ = ["CompileError", "CompileResult", "DEFAULT_GROUP_SIZES", "KernelSpec", "MergeSpec", "QuantizeSpec", "compile_cubin",
           "default_specs", "helper_headers", "load_kernel", "render"]
