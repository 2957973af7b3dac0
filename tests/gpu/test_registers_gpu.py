"""A program's registers on a GPU host (marker: gpu), where NVRTC 12.9+ could serve a repeated
compile from the driver's compute cache with no ptxas report: the planner counts resident CTAs from
the registers, and without them from shared memory alone (twice the CTAs of a 163-register
program, and plans of other splits than the tuner measured)."""

from __future__ import annotations

import dataclasses

import pytest

cupy = pytest.importorskip("cupy")

import splitkv.codegen.compile as compile_module  # noqa: E402
from splitkv.codegen import load  # noqa: E402
from splitkv.heuristics import default_spec  # noqa: E402

pytestmark = pytest.mark.gpu


def _spec():
    return default_spec("sm_" + cupy.cuda.Device().compute_capability, 128, 8, kv_dtype="fp8_e4m3",
                        query_tokens=16)


def test_a_repeated_compile_reports_its_registers(monkeypatch, tmp_path):
    """Compiled twice past splitkv's caches, with the driver's cache (of this host) in reach."""
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_module, "_memory_cache", {})
    first = compile_module.compile_cubin(_spec(), use_disk_cache=False)
    compile_module._memory_cache.clear()
    again = compile_module.compile_cubin(_spec(), use_disk_cache=False)
    assert first.registers and again.registers == first.registers


def test_a_loaded_program_without_a_ptxas_report_takes_the_drivers_count(monkeypatch):
    spec = _spec()
    compiled = compile_module.compile_cubin(spec)
    assert compiled.registers
    monkeypatch.setattr(load, "compile_cubin", lambda *a, **k: dataclasses.replace(compiled, registers=None))
    monkeypatch.setattr(load, "_loaded", {})
    function, result = load.load_kernel(spec)
    assert result.registers == compiled.registers == load.function_registers(function)
