"""Render KernelSpecs into CUDA source with Jinja2.

Jinja renders only a program's configuration: its constants, types and (decode) the ``Params``
struct of splitkv/params.py. The kernels themselves are plain CUDA headers (``*.cuh``; the decode
kernel's under ``decode/``) that the rendered config ``#include``s and that choose among their
variants in C++; the compiler hands them to NVRTC by name (see ``helper_headers``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re

import jinja2

from ..arch import hardware_e2m1
from ..choices import TMA_BOX_BYTES
from ..params import DECODE, MERGE, QUANTIZE
from ..work_units import BUFFER_HEADER, MERGE_FIELDS, UNIT_FIELDS
from ..spec import KernelSpec, MergeSpec, QuantizeSpec

#: C++ element type for each dtype name of the spec vocabulary.
CUDA_TYPES = {"bf16": "__nv_bfloat16", "fp16": "__half"}

DECODE_KERNEL = "splitkv_decode"
MERGE_KERNEL = "splitkv_merge"
QUANTIZE_KERNEL = "splitkv_quantize"
#: Template and kernel name of each program kind.
_PROGRAMS = {KernelSpec: ("decode.cu.j2", DECODE_KERNEL), MergeSpec: ("merge.cu.j2", MERGE_KERNEL),
             QuantizeSpec: ("quantize.cu.j2", QUANTIZE_KERNEL)}

AnySpec = KernelSpec | MergeSpec | QuantizeSpec


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("splitkv", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def helper_headers() -> dict[str, str]:
    """The ``.cuh`` helpers by include name, as NVRTC receives them."""
    return dict(sorted(_helper_headers().items()))


@functools.lru_cache(maxsize=1)
def _helper_headers() -> dict[str, str]:
    """Every ``.cuh`` under the templates, by its path there (``decode/kernel.cuh``): the name the
    programs include it by."""
    headers = {}

    def walk(folder, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(".cuh"):
                headers[prefix + entry.name] = entry.read_text()

    walk(importlib.resources.files("splitkv") / "templates", "")
    return headers


_INCLUDE_RE = re.compile(r'^#include "([^"]+)"\n', re.MULTILINE)


def flat_source(spec: AnySpec) -> str:
    """The rendered program with the kernel's own headers (``decode/*.cuh``, ``merge/*.cuh``: those
    in a folder of the templates) written out in place of their includes (each once, as ``#pragma once`` would have it): the whole kernel as one text, for
    the tools that patch it at anchors and compile it with `compile_cubin(spec, source=...)`."""
    headers, seen = _helper_headers(), set()

    def expand(text: str) -> str:
        def include(match: re.Match) -> str:
            name = match.group(1)
            if "/" not in name or name not in headers:
                return match.group(0)  # the shared helpers stay includes
            if name in seen:
                return ""
            seen.add(name)
            return expand(headers[name].replace("#pragma once\n", "", 1))
        return _INCLUDE_RE.sub(include, text)

    return expand(render(spec))


def kernel_name(spec: AnySpec) -> str:
    return _PROGRAMS[type(spec)][1]


def template_parameters(spec: AnySpec) -> dict:
    """The values a template sees: the spec's fields plus the C++ spellings derived from them."""
    params = dataclasses.asdict(spec)
    params.update(name=spec.name, kernel_name=kernel_name(spec))
    if isinstance(spec, MergeSpec):
        params.update(out_type=CUDA_TYPES[spec.out_dtype], unit_header=len(BUFFER_HEADER), unit_fields=len(UNIT_FIELDS),
                      merge_fields=len(MERGE_FIELDS), params_fields=MERGE.config_fields(), params_size=MERGE.size)
    elif isinstance(spec, QuantizeSpec):
        params.update(in_type=CUDA_TYPES[spec.in_dtype], params_fields=QUANTIZE.config_fields(),
                      params_size=QUANTIZE.size)
    else:
        params.update(q_type=CUDA_TYPES[spec.q_dtype], mma_type=CUDA_TYPES[spec.mma_dtype],
                      mma_ptx="bf16" if spec.mma_dtype == "bf16" else "f16",
                      kv_bits=spec.kv_bits, hardware_e2m1=hardware_e2m1(spec.arch), smem_pad=spec.smem_pad,
                      tma_box_bytes=spec.tma_box_bytes if spec.kv_copy == "tma" else TMA_BOX_BYTES,
                      tma_box_rows=spec.tma_box_rows, tile_bytes=spec.tile_bytes, kv_elem_bytes=spec.kv_elem_bytes,
                      unit_header=len(BUFFER_HEADER), unit_fields=len(UNIT_FIELDS),
                      cluster_slice=spec.cluster_slice, inbox_offset=spec.inbox_offset,
                      row_blocks=spec.row_blocks, cta_rows=spec.cta_rows, row_slices=spec.row_slices,
                      params_fields=DECODE.config_fields(), params_size=DECODE.size)
    return params


def render(spec: AnySpec) -> str:
    """CUDA source of the program that ``spec`` names."""
    return _environment().get_template(_PROGRAMS[type(spec)][0]).render(**template_parameters(spec))
