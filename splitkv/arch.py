"""What splitkv knows of each compute capability: the per-SM limits of the archs it compiles for,
how an arch is spelled ('sm_90', 'sm_90a'), and what an arch converts in hardware.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ArchLimits:
    """What one SM of a compute capability holds (CUDA C++ Programming Guide, technical
    specifications per compute capability): the occupancy arithmetic and the shared-memory check
    of a CTA shape use these."""

    smem_per_sm: int      # bytes, shared by the resident CTAs
    smem_per_cta: int     # bytes a CTA may opt in to (the SM's less the 1 KB the driver reserves)
    threads_per_sm: int
    ctas_per_sm: int


#: The compute capabilities splitkv compiles for ('sm_90a' and the like share their base's limits).
#: Anything else is refused by name rather than compiled against a guessed limit.
ARCHS = {
    80: ArchLimits(164 * 1024, 163 * 1024, 2048, 32),   # A100
    86: ArchLimits(100 * 1024, 99 * 1024, 1536, 16),    # A10, A40, RTX 30
    87: ArchLimits(164 * 1024, 163 * 1024, 1536, 16),   # Jetson Orin
    89: ArchLimits(100 * 1024, 99 * 1024, 1536, 24),    # L4, L40, RTX 40
    90: ArchLimits(228 * 1024, 227 * 1024, 2048, 32),   # H100, H200
    100: ArchLimits(228 * 1024, 227 * 1024, 2048, 32),  # B200
    103: ArchLimits(228 * 1024, 227 * 1024, 2048, 32),  # B300
    120: ArchLimits(100 * 1024, 99 * 1024, 1536, 32),   # RTX 50, RTX PRO 6000
    121: ArchLimits(100 * 1024, 99 * 1024, 1536, 32),   # DGX Spark
}

_ARCH_RE = re.compile(r"^sm_?(\d+)(a?)$")


def parse_arch(arch: str | int) -> str:
    """Normalise 'sm90', 'sm_90', '90' or 90 to 'sm_90' (keeping an 'a' suffix: 'sm_90a')."""
    text = str(arch).strip().lower()
    if text.isdigit():
        text = "sm_" + text
    m = _ARCH_RE.match(text)
    if not m:
        raise ValueError(f"arch: expected something like 'sm_90' or 'sm90', got {arch!r}")
    major_minor = int(m.group(1))
    if major_minor < 80:
        raise ValueError(f"arch: splitkv needs sm_80 or newer (bf16 tensor cores, cp.async); got {arch!r}")
    if major_minor not in ARCHS:
        known = ", ".join(f"sm_{n}" for n in ARCHS)
        raise ValueError(f"arch: {arch!r} is not a compute capability splitkv knows ({known})")
    if m.group(2) and major_minor < 90:
        raise ValueError(f"arch: arch-specific ('a') targets start at sm_90a; got {arch!r}")
    return f"sm_{major_minor}{m.group(2)}"


def arch_number(arch: str) -> int:
    """'sm_90a' -> 90."""
    return int(_ARCH_RE.match(parse_arch(arch)).group(1))


def hardware_e2m1(arch: str) -> bool:
    """Whether ``arch`` converts E2M1 to fp16 in hardware (``cvt.rn.f16x2.e2m1x2``: the
    arch-specific targets from sm_100a on); elsewhere the NVFP4 programs decode it with integer ops."""
    arch = parse_arch(arch)
    return arch.endswith("a") and arch_number(arch) >= 100
