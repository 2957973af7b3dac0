"""Rendering and GPU-free compilation of every program in the default kernel set."""

from __future__ import annotations

import re

import jinja2
import pytest

from splitkv.codegen import CompileError, compile_cubin, default_specs, render
from splitkv.codegen.compile import parse_ptxas_log
from splitkv.codegen.render import _environment, template_parameters
from splitkv.heuristics import default_spec, resident_ctas_per_sm
from splitkv.spec import KernelSpec, MergeSpec

pytest.importorskip("cupy")

DEFAULT_SET = default_specs("sm90")


def test_default_set_covers_the_vocabulary():
    decode = [s for s in DEFAULT_SET if isinstance(s, KernelSpec)]
    assert {s.head_dim for s in decode} == {64, 96, 128, 256}
    assert {s.group_size for s in decode} == {1, 2, 4, 8, 16}
    assert {s.variant for s in decode} == {"dense", "split"}
    assert {s.kv_dtype for s in decode} == {"bf16", "fp16"}
    assert len({s.name for s in DEFAULT_SET}) == len(DEFAULT_SET), "names must be unique"
    assert sum(isinstance(s, MergeSpec) for s in DEFAULT_SET) == 8


@pytest.mark.parametrize("spec", DEFAULT_SET, ids=lambda s: s.name)
def test_every_default_kernel_compiles_for_sm90(spec):
    result = compile_cubin(spec, use_disk_cache=False)
    assert result.cubin[:4] == b"\x7fELF", "NVRTC must return a cubin (ELF), not PTX"
    assert result.registers is not None and 0 < result.registers <= 255
    assert result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
    assert "{{" not in result.source and "{%" not in result.source


@pytest.mark.parametrize("changes", [
    {"kv_copy": "bulk"}, {"kv_copy": "bulk", "variant": "dense", "cluster": 1},
    {"kv_copy": "bulk", "head_dim": 256, "group_size": 16, "tile_tokens": 16, "chunk_size": 64, "cluster": 16},
    {"kv_copy": "bulk", "head_dim": 96, "group_size": 1, "warps": 8, "tile_tokens": 16, "stages": 3},
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_bulk_copy_kernels_compile_for_sm90(changes):
    spec = KernelSpec(arch="sm_90", chunk_size=128, cluster=8).replace(**changes)
    result = compile_cubin(spec, use_disk_cache=False)
    assert result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
    assert "cp.async.bulk" in result.source or "bulk_copy_to_smem" in result.source


@pytest.mark.parametrize("changes", [
    {}, {"variant": "dense", "cluster": 1}, {"mma_m": "tokens"},
    {"head_dim": 256, "group_size": 16, "tile_tokens": 16, "chunk_size": 64, "cluster": 16},
    {"head_dim": 64, "group_size": 1, "warps": 8, "tile_tokens": 16, "stages": 3, "cluster": 1},
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "default")
def test_tensor_copy_kernels_compile_for_sm90(changes):
    spec = KernelSpec(arch="sm_90", chunk_size=128, cluster=8, kv_copy="tma").replace(**changes)
    result = compile_cubin(spec, use_disk_cache=False)
    assert result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
    assert "tensor_copy_2d_to_smem" in result.source and "__grid_constant__" in result.source
    assert "cp_async_16(" not in result.source.split("splitkv_decode(")[1]  # no per-lane copies left


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("variant", ["dense", "split"])
def test_tokens_on_the_mma_rows_compile_for_sm90(head_dim, variant):
    tile = 16 if head_dim > 128 else 32
    for group in (1, 8):
        spec = KernelSpec(arch="sm_90", head_dim=head_dim, group_size=group, variant=variant, mma_m="tokens",
                          tile_tokens=tile, chunk_size=4 * tile, cluster=8 if variant == "split" else 1)
        result = compile_cubin(spec, use_disk_cache=False)
        assert result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
        assert "movmatrix_trans" in result.source


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_row_spanning_kernels_compile_for_sm90_without_spills(head_dim):
    for group in (1, 4, 16):
        spec = default_spec("sm_90", head_dim, group).replace(cluster=1, span_rows=True, kv_copy="cp_async")
        result = compile_cubin(spec, use_disk_cache=False)
        assert result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
        assert "cross_row" in result.source and "row_tiles" in result.source


def test_rendered_source_carries_the_parameters():
    spec = KernelSpec(head_dim=96, group_size=3, warps=2, tile_tokens=16, stages=3, chunk_size=64)
    source = render(spec)
    assert "constexpr int HEAD_DIM = 96;" in source
    assert "constexpr int GROUP = 3;" in source
    assert "constexpr int STAGES = 3;" in source
    assert "constexpr bool SPLIT = true;" in source
    assert spec.name in source
    dense = render(spec.replace(variant="dense", q_dtype="fp16"))
    assert "constexpr bool SPLIT = false;" in dense and "using q_t = __half;" in dense


def test_missing_template_parameter_is_an_error():
    params = template_parameters(KernelSpec())
    del params["head_dim"]
    with pytest.raises(jinja2.UndefinedError):
        _environment().get_template("decode.cu.j2").render(**params)


def test_compile_failure_reports_log_and_source(monkeypatch, tmp_path):
    import splitkv.codegen.compile as compile_module

    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_module, "render", lambda spec: "this is not CUDA;\n")
    with pytest.raises(CompileError) as info:
        compile_module.compile_cubin(KernelSpec(group_size=5), use_disk_cache=False)
    assert "error" in info.value.log
    assert info.value.source_path is not None and info.value.source_path.exists()
    assert info.value.source_path.read_text() == "this is not CUDA;\n"


def test_disk_cache_round_trip(monkeypatch, tmp_path):
    import splitkv.codegen.compile as compile_module

    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))
    spec = KernelSpec(group_size=3, head_dim=64)
    first = compile_module.compile_cubin(spec, use_disk_cache=False)
    compile_module._memory_cache.clear()
    again = compile_module.compile_cubin(spec)
    assert again.cubin == first.cubin and again.registers == first.registers
    assert list(tmp_path.glob("*.cubin"))


def test_a_patched_source_compiles_beside_the_rendered_one(monkeypatch, tmp_path):
    # The benchmark tools compile patched programs through the same path: same options and
    # headers, their own cache entry, and their own source file (the rendered one's stays intact).
    import splitkv.codegen.compile as compile_module

    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))
    spec = KernelSpec(group_size=2, head_dim=64)
    rendered = compile_module.compile_cubin(spec, use_disk_cache=False)
    patched_text = render(spec).replace("extern __shared__", "// patched\n    extern __shared__", 1)
    patched = compile_module.compile_cubin(spec, use_disk_cache=False, source=patched_text)
    assert patched.source == patched_text and patched.cubin[:4] == b"\x7fELF"
    assert patched.source_path != rendered.source_path
    assert rendered.source_path.read_text() == render(spec)
    assert patched.source_path.read_text() == patched_text
    compile_module._memory_cache.clear()
    assert compile_module.compile_cubin(spec).source_path == rendered.source_path  # from the disk cache


def test_sm100a_compiles():
    result = compile_cubin(KernelSpec(arch="sm_100a"), use_disk_cache=False)
    assert result.cubin[:4] == b"\x7fELF"


def test_ptxas_log_parsing():
    log = ("ptxas info    : Used 174 registers, used 1 barriers, 16 bytes smem\n"
           "ptxas         .     8 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads\n")
    assert parse_ptxas_log(log) == (174, 16)
    assert parse_ptxas_log("") == (None, None)


def test_occupancy_arithmetic():
    spec = default_spec("sm_90", 128, 4).replace(kv_copy="cp_async")  # padded rows
    # 139 KB of shared memory: one CTA per SM whatever the registers.
    assert spec.smem_bytes > 114 * 1024
    assert resident_ctas_per_sm(spec, 128) == 1
    small = spec.replace(warps=2, tile_tokens=16, chunk_size=32)
    # 35 KB of smem, 64 threads: registers bind at 255 (65536 / (256*32) / 2 = 4 CTAs).
    assert resident_ctas_per_sm(small, 255) == 4
    # Then shared memory binds: 228 KB over (34 KB ring + 3 KB cluster inbox + 16 B static + 1 KB
    # the driver reserves) per CTA is 5.997, so 5.
    assert small.smem_bytes + small.static_smem_bytes + 1024 == 38928
    assert resident_ctas_per_sm(small, 64) == 5


def test_name_is_stable_and_readable():
    spec = KernelSpec()
    assert spec.name == "sm_90-d128-g4-bf16-bf16-split-c256-w4t32s2-fm"
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", spec.name)
    assert KernelSpec.from_dict(spec.to_dict()) == spec
