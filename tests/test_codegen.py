"""Rendering and GPU-free compilation of every program in the default kernel set; the compile
cache's files and errors; the package data that ships the templates."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys
from pathlib import Path

import jinja2
import pytest

import splitkv.codegen.compile as compile_module
from splitkv.codegen import CompileError, compile_cubin, default_specs, helper_headers, render
from splitkv.codegen.compile import CacheDirError, CompilerUnavailableError, parse_ptxas_log
from splitkv.codegen.render import _environment, flat_source, template_parameters
from splitkv.heuristics import default_spec, resident_ctas_per_sm
from splitkv.spec import KernelSpec, MergeSpec

REPO = Path(__file__).resolve().parents[1]

#: Compiling needs CuPy's NVRTC; rendering, packaging and the error paths below do not.
needs_nvrtc = pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                                 reason="CuPy is not installed (pip install -e '.[cu13,test]')")

DEFAULT_SET = default_specs("sm90")


@pytest.fixture(autouse=True)
def _cache_outside_home(monkeypatch, tmp_path_factory):
    """Compiles land in a cache of the test run, never in the user's own; a test that looks at
    the cache's files sets its own folder."""
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder and an empty memory cache, so that results come from this test."""
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_module, "_memory_cache", {})
    return tmp_path


def test_default_set_covers_the_vocabulary():
    decode = [s for s in DEFAULT_SET if isinstance(s, KernelSpec)]
    assert {s.head_dim for s in decode} == {64, 96, 128, 256}
    assert {s.group_size for s in decode} == {1, 2, 4, 8, 16}
    assert {s.variant for s in decode} == {"dense", "split", "units"}
    assert {s.name for s in decode if s.variant == "units"} == {s.as_units().name for s in decode if s.variant == "split"}
    # The dense program in both layouts the planner picks from (a row per CTA, a row per warp).
    dense = [s for s in decode if s.variant == "dense"]
    assert {s.name for s in dense if s.warp_heads} == {s.replace(warp_heads=True).name for s in dense if not s.warp_heads}
    assert {s.kv_dtype for s in decode} == {"bf16", "fp16", "fp8_e4m3", "nvfp4"}
    assert {(s.q_dtype, s.kv_dtype) for s in decode if s.kv_dtype in ("fp8_e4m3", "nvfp4")} == {
        (q, kv) for q in ("bf16", "fp16") for kv in ("fp8_e4m3", "nvfp4")}
    assert {s.head_dim for s in decode if s.kv_dtype == "nvfp4"} == {64, 128, 256}
    assert len({s.name for s in DEFAULT_SET}) == len(DEFAULT_SET), "names must be unique"
    assert sum(isinstance(s, MergeSpec) for s in DEFAULT_SET) == 16  # of splits and of merge tables
    assert not any(getattr(s, "page_size", 0) for s in DEFAULT_SET)  # contiguous caches unless asked


def test_paged_sets_come_per_page_size_and_layout():
    specs = [s for s in default_specs("sm90", head_dims=(128,), group_sizes=(4,), kv_dtypes=("bf16",),
                                      page_sizes=(0, 1, 16), kv_layout="HND") if isinstance(s, KernelSpec)]
    assert {(s.page_size, s.kv_layout) for s in specs} == {(0, "NHD"), (1, "HND"), (16, "HND")}
    assert {s.kv_copy for s in specs if s.page_size == 1} == {"cp_async"}  # no tensor-map box of one row


#: The quantized programs that spill: head_dim 256 with more than 8 query heads per K/V head keeps
#: 16-row accumulators for 256 dims (128 registers) and Q (64) live beside the dequantized operands.
QUANTIZED_SPILLS = {(256, 16)}


def _elf_end(elf: bytes) -> int:
    """Where a 64-bit ELF's last part ends: its program and section header tables, or the last
    section's bytes (NVRTC's cubins end with the program headers)."""
    import struct

    ph_off, sh_off = struct.unpack_from("<QQ", elf, 0x20)
    ph_size, ph_num, sh_size, sh_num = struct.unpack_from("<HHHH", elf, 0x36)
    end = max(ph_off + ph_size * ph_num, sh_off + sh_size * sh_num)
    for i in range(sh_num):
        kind, = struct.unpack_from("<I", elf, sh_off + i * sh_size + 4)
        offset, size = struct.unpack_from("<QQ", elf, sh_off + i * sh_size + 0x18)
        if kind != 8:  # SHT_NOBITS holds no bytes in the file
            end = max(end, offset + size)
    return end


@needs_nvrtc
@pytest.mark.parametrize("spec", [s for s in DEFAULT_SET if getattr(s, "kv_dtype", "bf16") in ("bf16", "fp16")],
                         ids=lambda s: s.name)
def test_every_default_kernel_compiles_for_sm90(spec):
    result = compile_cubin(spec, use_disk_cache=False)
    assert result.cubin[:4] == b"\x7fELF", "NVRTC must return a cubin (ELF), not PTX"
    assert _elf_end(result.cubin) == len(result.cubin), "the cubin must be whole (its headers' tables inside it)"
    assert result.registers is not None and 0 < result.registers <= 255
    assert result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
    assert "{{" not in result.source and "{%" not in result.source


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_90", "sm_100a"])
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "nvfp4"])
def test_quantized_kernels_compile(kv_dtype, arch):
    # Every head_dim the format takes, groups on both MMA layouts, dense (both layouts), split and units;
    # sm_100a converts E2M1 in hardware, sm_90 with integer ops.
    head_dims = (64, 96, 128, 256) if kv_dtype == "fp8_e4m3" else (64, 128, 256)
    if arch == "sm_100a":
        head_dims = (128,)
    specs = [s for s in default_specs(arch, head_dims=head_dims, group_sizes=(1, 4, 16), kv_dtypes=(kv_dtype,))
             if isinstance(s, KernelSpec) and s.q_dtype == "bf16"]
    assert len(specs) == 12 * len(head_dims)
    for spec in specs:
        result = compile_cubin(spec, use_disk_cache=False)
        assert result.cubin[:4] == b"\x7fELF", spec.name
        if (spec.head_dim, spec.group_size) in QUANTIZED_SPILLS:
            assert result.spill_bytes < 256, f"{spec.name} spills {result.spill_bytes} bytes"
        else:
            assert result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
        hardware = "#define SPLITKV_HARDWARE_E2M1 1" in result.source
        assert hardware == (arch == "sm_100a"), spec.name


@pytest.mark.parametrize("arch", ["sm_89", "sm_90", "sm_100a", "sm_120"])
def test_every_quantized_default_program_renders(arch):
    # The whole quantized default set (both query dtypes, every head_dim and group) renders with
    # every parameter filled; a sample of it is compiled above.
    specs = [s for s in default_specs(arch, kv_dtypes=("fp8_e4m3", "nvfp4")) if isinstance(s, KernelSpec)]
    assert len(specs) == 2 * (4 + 3) * 5 * 4  # query dtypes x head_dims x groups x (dense twice, split, units)
    for spec in specs:
        source = render(spec)
        assert "{{" not in source and "{%" not in source
        assert f"constexpr int KV_BITS = {8 if spec.kv_dtype == 'fp8_e4m3' else 4};" in source
        assert "using mma_t = __half;" in source


def test_a_quantized_set_brings_the_merge_and_quantizer_of_both_query_dtypes():
    # Quantized K/V take bf16 and fp16 queries, so their set needs merges (outputs) and quantizers
    # (inputs) of both.
    specs = default_specs("sm90", head_dims=(128,), kv_dtypes=("fp8_e4m3",))
    assert {s.out_dtype for s in specs if isinstance(s, MergeSpec)} == {"bf16", "fp16"}
    assert {s.in_dtype for s in specs if type(s).__name__ == "QuantizeSpec"} == {"bf16", "fp16"}


@needs_nvrtc
def test_hardware_e2m1_is_refused_where_the_arch_lacks_it():
    # The hardware E2M1 conversion exists on arch-specific targets from sm_100a on only: the switch
    # that selects it must be what makes sm_90 fail, so the sm_100a compile really uses it.
    spec = default_spec("sm_90", 128, 4, "bf16", "nvfp4")
    source = render(spec).replace("#include \"primitives.cuh\"", "#define SPLITKV_HARDWARE_E2M1 1\n#include \"primitives.cuh\"")
    with pytest.raises(CompileError, match="e2m1"):
        compile_cubin(spec, use_disk_cache=False, source=source)


@needs_nvrtc
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 8, 16])
def test_a_warp_per_kv_head_compiles_without_spills(head_dim, group):
    spec = default_spec("sm_90", head_dim, group, variant="dense").replace(warp_heads=True)
    result = compile_cubin(spec, use_disk_cache=False)
    assert result.registers is not None and result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
    assert "constexpr bool WARP_HEADS = true;" in result.source


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_86", "sm_89", "sm_120"])
def test_shrunk_default_shapes_compile_for_99_kb_gpus(arch):
    # These GPUs give a CTA 99 KB of shared memory: the built-in shapes shrink their rings to fit.
    from splitkv.codegen import default_specs

    specs = [s for s in default_specs(arch, head_dims=(128, 256), group_sizes=(4, 16), kv_dtypes=("bf16",))
             if isinstance(s, KernelSpec)]
    assert {s.tile_tokens for s in specs} == {16}
    for spec in specs:
        result = compile_cubin(spec)
        assert result.cubin[:4] == b"\x7fELF" and result.spill_bytes == 0, spec.name


@needs_nvrtc
@pytest.mark.parametrize("changes", [
    {}, {"variant": "dense", "cluster": 1}, {"mma_m": "tokens"},
    {"head_dim": 256, "group_size": 16, "tile_tokens": 16, "chunk_size": 64, "cluster": 16},
    {"head_dim": 64, "group_size": 1, "warps": 8, "tile_tokens": 16, "stages": 3, "cluster": 1},
    {"cluster": 1},
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "default")
def test_tensor_copy_kernels_compile_for_sm90(changes):
    spec = KernelSpec(arch="sm_90", chunk_size=128, cluster=8, kv_copy="tma").replace(**changes)
    result = compile_cubin(spec, use_disk_cache=False)
    assert result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
    assert "tensor_copy_2d_to_smem" in flat_source(spec) and "__grid_constant__" in flat_source(spec)
    # The per-lane copies stay in the kernel's C++, discarded by `if constexpr (SWIZZLED)`.
    assert "constexpr bool SWIZZLED = true;" in result.source


@needs_nvrtc
@pytest.mark.parametrize("cluster, head_dim, group", [(9, 128, 4), (5, 64, 8), (14, 256, 2)])
def test_whole_row_clusters_of_sizes_other_than_powers_of_two_compile(cluster, head_dim, group):
    # The planner's whole-row clusters (e.g. 10 to 14 on an H200 for 5 to 7 K/V heads, where no
    # power of two fits) are compiled on first use.
    spec = default_spec("sm_90", head_dim, group).replace(cluster=cluster)
    result = compile_cubin(spec, use_disk_cache=False)
    assert result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
    assert f"__cluster_dims__({cluster}, 1, 1)" in result.source


@needs_nvrtc
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("variant", ["dense", "split"])
def test_tokens_on_the_mma_rows_compile_for_sm90(head_dim, variant):
    tile = 16 if head_dim > 128 else 32
    for group in (1, 8):
        spec = KernelSpec(arch="sm_90", head_dim=head_dim, group_size=group, variant=variant, mma_m="tokens",
                          tile_tokens=tile, chunk_size=4 * tile, cluster=8 if variant == "split" else 1)
        result = compile_cubin(spec, use_disk_cache=False)
        assert result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
        assert "movmatrix_trans" in flat_source(spec)


@needs_nvrtc
@pytest.mark.parametrize("changes", [
    {}, {"head_dim": 64}, {"tile_tokens": 16, "chunk_size": 64, "stages": 4}, {"group_size": 8, "warps": 8, "cluster": 8},
    {"variant": "dense", "cluster": 1}, {"page_size": 16}, {"q_dtype": "fp16", "kv_dtype": "fp16", "query_tokens": 8},
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "default")
def test_warpgroup_programs_compile_for_sm90a_without_serialised_mmas(changes):
    spec = KernelSpec(arch="sm_90", kv_copy="tma", mma_m="warpgroup", tile_tokens=64, stages=2, chunk_size=256,
                      query_tokens=16).replace(**changes)
    result = compile_cubin(spec, use_disk_cache=False)
    assert result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
    assert "sm_90a" in result.log and "wgmma.mma_async" in result.source
    # ptxas says so (C7510-C7515, "wgmma.mma_async instructions are serialized") where it has to
    # wait for each MMA: a register of one in flight touched, or too few registers.
    assert "serialized" not in result.log, result.log


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


@needs_nvrtc
def test_compile_failure_reports_log_and_source(monkeypatch, fresh):
    monkeypatch.setattr(compile_module, "render", lambda spec: "this is not CUDA;\n")
    with pytest.raises(CompileError) as info:
        compile_module.compile_cubin(KernelSpec(group_size=5), use_disk_cache=False)
    assert "error" in info.value.log
    assert info.value.source_path is not None and info.value.source_path.exists()
    assert info.value.source_path.read_text() == "this is not CUDA;\n"
    assert info.value.source_path.is_relative_to(fresh / "src")


@needs_nvrtc
def test_disk_cache_round_trip(fresh):
    spec = KernelSpec(group_size=3, head_dim=64)
    first = compile_module.compile_cubin(spec, use_disk_cache=False)
    compile_module._memory_cache.clear()
    again = compile_module.compile_cubin(spec)
    assert again.cached and not first.cached
    assert again.cubin == first.cubin and again.registers == first.registers
    assert again.cubin_path == first.cubin_path and again.cubin_path.parent == fresh
    assert again.source_path == first.source_path


@needs_nvrtc
def test_without_the_disk_cache_the_program_is_compiled_again_and_stored(fresh):
    # What compile_cubin's docstring promises for use_disk_cache=False.
    spec = MergeSpec(head_dim=64, out_dtype="fp16")
    first = compile_module.compile_cubin(spec)
    first.cubin_path.write_bytes(b"stale")
    compile_module._memory_cache.clear()
    again = compile_module.compile_cubin(spec, use_disk_cache=False)
    assert not again.cached and again.cubin[:4] == b"\x7fELF"
    assert again.cubin_path.read_bytes() == again.cubin, "the new cubin replaces the one on disk"
    assert compile_module.compile_cubin(spec, use_disk_cache=False) is again  # memory cache still used


@needs_nvrtc
def test_a_damaged_cached_cubin_is_compiled_again(fresh):
    """A cubin cut short or overwritten on disk (its metadata intact) is not served: compiled again."""
    spec = MergeSpec(head_dim=64, out_dtype="bf16")
    first = compile_module.compile_cubin(spec)
    for damage in (b"", b"garbage"):
        first.cubin_path.write_bytes(damage)
        compile_module._memory_cache.clear()
        again = compile_module.compile_cubin(spec)
        assert not again.cached and again.cubin == first.cubin and first.cubin_path.read_bytes() == first.cubin


def test_an_upgraded_toolchain_changes_the_cache_key(monkeypatch, tmp_path):
    """The key holds the CUDA headers' names, sizes and times and the NVRTC package's version:
    a header rewritten by an upgrade makes every key new."""
    (tmp_path / "cuda_bf16.h").write_text("// one version\n")
    monkeypatch.setattr(compile_module, "cuda_include_dirs", lambda: (str(tmp_path),))
    monkeypatch.setattr(compile_module, "nvrtc_version", lambda: (13, 0))
    compile_module.toolchain_fingerprint.cache_clear()
    try:
        before = compile_module._cache_key("src", {}, ["-x"])
        os.utime(tmp_path / "cuda_bf16.h", ns=(1, 1))
        compile_module.toolchain_fingerprint.cache_clear()
        assert compile_module._cache_key("src", {}, ["-x"]) != before
    finally:
        compile_module.toolchain_fingerprint.cache_clear()


@needs_nvrtc
def test_programs_of_one_name_keep_their_own_sources(monkeypatch, fresh):
    # Two splitkv versions sharing a cache render different programs under the same name.
    spec = KernelSpec(group_size=2, head_dim=96)
    ours = compile_module.compile_cubin(spec, use_disk_cache=False)
    theirs_source = "// another version\n" + ours.source
    monkeypatch.setattr(compile_module, "render", lambda s: theirs_source)
    theirs = compile_module.compile_cubin(spec, use_disk_cache=False)
    assert ours.source_path.name == theirs.source_path.name == f"{spec.name}.cu"
    assert ours.source_path != theirs.source_path
    assert ours.source_path.read_text() == ours.source
    assert theirs.source_path.read_text() == theirs_source
    for result in (ours, theirs):  # each folder compiles on its own: the headers are beside it
        for name, text in helper_headers().items():
            assert (result.source_path.parent / name).read_text() == text
    compile_module._memory_cache.clear()
    cached = compile_module.compile_cubin(spec)
    assert cached.cached and cached.source_path == theirs.source_path


def test_an_unwritable_cache_is_named(monkeypatch, fresh):
    blocker = fresh / "a-file"
    blocker.write_text("")
    cache = blocker / "cache"
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(cache))
    with pytest.raises(CacheDirError) as info:
        compile_module.ensure_cache_dir()
    assert str(cache) in str(info.value) and "from SPLITKV_CACHE_DIR" in str(info.value)
    assert isinstance(info.value, OSError) and info.value.folder == cache
    # The default folder (under XDG_CACHE_HOME) is named too, with the variable that moves it.
    monkeypatch.delenv("SPLITKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with pytest.raises(CacheDirError, match="set SPLITKV_CACHE_DIR") as info:
        compile_module.ensure_cache_dir()
    assert str(blocker / "splitkv") in str(info.value)


@needs_nvrtc
def test_compiling_into_an_unwritable_cache_fails_before_nvrtc_runs(monkeypatch, fresh):
    from cupy.cuda import nvrtc

    blocker = fresh / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(nvrtc, "compileProgram", lambda *args: pytest.fail("NVRTC ran for nothing"))
    with pytest.raises(CacheDirError, match="SPLITKV_CACHE_DIR"):
        compile_module.compile_cubin(MergeSpec(head_dim=96))


@needs_nvrtc
@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_cache_files_get_the_mode_the_umask_gives(fresh, umask):
    # A cache shared by several users or CI runners must be readable by them (mkstemp gives 0600).
    previous = os.umask(umask)
    try:
        result = compile_module.compile_cubin(MergeSpec(head_dim=128, out_dtype="fp16"))
    finally:
        os.umask(previous)
    files = [p for p in fresh.rglob("*") if p.is_file()]
    assert {result.cubin_path, result.source_path, result.source_path.parent / "merge.cuh"} <= set(files)
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {oct(0o666 & ~umask)}


@pytest.mark.parametrize("proc", [True, False], ids=["proc-status", "umask-call"])
def test_file_mode_follows_the_umask(monkeypatch, proc):
    if not proc:  # where /proc cannot be read, the umask is read by setting it
        monkeypatch.setattr(compile_module, "open", _no_file, raising=False)
    previous = os.umask(0o027)
    try:
        assert compile_module._file_mode() == 0o640
    finally:
        os.umask(previous)


def _no_file(*args, **kwargs):
    raise FileNotFoundError(args[0])


def hide_cupy(monkeypatch):
    """Make CuPy unimportable, as if it had never been installed: its submodules too, since an
    import of cupy.cuda that finds it in sys.modules never looks at cupy."""
    for name in [m for m in sys.modules if m.startswith("cupy.")] + ["cupy"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_without_cupy_compiling_says_what_to_install(monkeypatch, fresh):
    hide_cupy(monkeypatch)
    for attempt in (compile_module.check_compiler, lambda: compile_cubin(MergeSpec(head_dim=64))):
        with pytest.raises(CompilerUnavailableError) as info:
            attempt()
        assert "pip install 'splitkv[cu13]'" in str(info.value) and "'splitkv[cu12]'" in str(info.value)


def test_package_data_ships_every_template_and_table():
    # CI installs in editable mode, where every file is found whatever pyproject says; this keeps
    # a glob that misses a file from shipping a wheel without it.
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    package = REPO / "splitkv"
    # setuptools expands each glob under the package folder, recursively, the same way.
    shipped = {Path(path) for pattern in config["tool"]["setuptools"]["package-data"]["splitkv"]
               for path in glob.glob(str(package / pattern), recursive=True)}
    for folder in ("templates", "tuned_configs"):
        # A table's writer leaves its lock file beside it (git ignores it; no wheel needs it).
        files = [p for p in (package / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                 and not (p.name.startswith(".") and p.name.endswith(".lock"))]
        assert files, f"splitkv/{folder}/ holds no file, so no wheel would hold the folder"
        missing = sorted(str(p.relative_to(REPO)) for p in files if p not in shipped)
        assert not missing, f"pyproject's package-data leaves out {missing}"


@needs_nvrtc
def test_a_patched_source_compiles_beside_the_rendered_one(fresh):
    # The benchmark tools compile patched programs through the same path: same options and
    # headers, their own cache entry, and their own source file (the rendered one's stays intact).
    spec = KernelSpec(group_size=2, head_dim=64)
    rendered = compile_module.compile_cubin(spec, use_disk_cache=False)
    patched_text = flat_source(spec).replace("extern __shared__", "// patched\n    extern __shared__", 1)
    patched = compile_module.compile_cubin(spec, use_disk_cache=False, source=patched_text)
    assert patched.source == patched_text and patched.cubin[:4] == b"\x7fELF"
    assert patched.source_path != rendered.source_path
    assert rendered.source_path.read_text() == render(spec)
    assert patched.source_path.read_text() == patched_text
    compile_module._memory_cache.clear()
    assert compile_module.compile_cubin(spec).source_path == rendered.source_path  # from the disk cache


@needs_nvrtc
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


@needs_nvrtc
def test_other_helper_headers_compile_apart_from_the_packages():
    # A tool comparing an older copy of the helpers hands them in; they must reach NVRTC and key
    # the cache, or the comparison would time the package's own program twice.
    from splitkv.codegen.render import helper_headers

    spec = MergeSpec(arch="sm_90", head_dim=128, out_dtype="bf16")
    ours = compile_cubin(spec)
    other = dict(helper_headers())
    other["merge.cuh"] += "\n// an older copy\n"
    theirs = compile_cubin(spec, headers=other)
    assert theirs.source_path != ours.source_path
    assert (theirs.source_path.parent / "merge.cuh").read_text().endswith("// an older copy\n")
    assert compile_cubin(spec, headers=other) is theirs  # cached by its headers


@needs_nvrtc
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("page_size, layout", [(1, "NHD"), (8, "HND"), (16, "NHD"), (256, "HND")])
def test_paged_kernels_compile_for_sm90_without_spills(kv_dtype, page_size, layout):
    for variant in ("dense", "split"):
        spec = default_spec("sm_90", 128, 4, kv_dtype=kv_dtype, variant=variant, page_size=page_size,
                            kv_layout=layout)
        result = compile_cubin(spec, use_disk_cache=False)
        assert result.spill_bytes == 0, f"{spec.name} spills {result.spill_bytes} bytes"
        assert f"constexpr int PAGE = {page_size};" in result.source
        assert f"constexpr bool HND = {'true' if layout == 'HND' else 'false'};" in result.source
        # A tile of several pages comes as a box per page (tensor maps) or a page per row (per lane).
        if spec.kv_copy == "tma":
            assert f"constexpr int BOX_ROWS = {min(page_size, spec.tile_tokens)};" in result.source
