"""The decode programs request their first K/V tiles before anything waits for a global load: Q's
and the length's loads are issued first and land while the tiles stream. A value computed from
them too early (Q's halves packed, the length clamped) makes the scheduler wait for DRAM before
the first copy, which costs every CTA a load's latency (the restructure's FP8 4k regression)."""

from __future__ import annotations

import importlib.util

import pytest

from sass import instructions
from splitkv.codegen import compile_cubin
from splitkv.heuristics import default_spec

pytestmark = pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                                reason="CuPy is not installed (pip install -e '.[cu13,test]')")

#: Instructions that start a K/V copy: a tensor-map box, or a lane's cp.async piece.
_COPIES = ("UTMALDG", "LDGSTS")

#: Contiguous caches only: a paged program's first copy needs its page from the block table, and a
#: units program's its unit from the table, so those wait by necessity.
_PROGRAMS = [
    ("sm_90", 128, 4, "bf16", "split"),
    ("sm_90", 128, 4, "fp8_e4m3", "split"),
    ("sm_90", 128, 4, "nvfp4", "split"),
    ("sm_90", 128, 8, "bf16", "dense"),
    ("sm_90", 256, 1, "bf16", "split"),
    ("sm_90", 64, 1, "fp8_e4m3", "dense"),  # per-lane cp.async copies
    ("sm_80", 128, 4, "bf16", "split"),
]


def waits_before_first_copy(cubin: bytes) -> list[str]:
    """The instructions before the first K/V copy that wait on a scoreboard a global load set."""
    loaded, waits = 0, []
    for ins in instructions(cubin):
        if any(copy in ins.text for copy in _COPIES):
            return waits
        if ins.wait_mask & loaded:
            waits.append(f"{ins.address:04x} {ins.text}")
        if "LDG" in ins.text and ins.write_barrier != 7:
            loaded |= 1 << ins.write_barrier
    raise AssertionError("no K/V copy instruction found")


@pytest.mark.parametrize("arch,head_dim,group,kv_dtype,variant", _PROGRAMS)
def test_first_tiles_are_requested_before_any_wait_for_a_load(arch, head_dim, group, kv_dtype, variant):
    spec = default_spec(arch, head_dim, group, "bf16", kv_dtype, variant=variant)
    clusters = (1, 8) if variant == "split" and arch == "sm_90" else (spec.cluster,)  # clusters: sm_90 on
    for cluster in clusters:
        program = spec.replace(cluster=cluster)
        waits = waits_before_first_copy(compile_cubin(program).cubin)
        assert not waits, f"{program.name}: waits for a global load before its first K/V copy: {waits}"
