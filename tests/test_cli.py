"""splitkv-gen, with the code generator replaced by a fake: these tests pin the command line's own
behaviour (parsing, filters, output, files, exit codes), not the compiler's."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

import splitkv
from splitkv import cli
from splitkv.codegen import compile as real_compiler
from splitkv.spec import KernelSpec, MergeSpec

SPECS = [
    KernelSpec(arch="sm_90", head_dim=128, group_size=4, variant="split"),
    KernelSpec(arch="sm_90", head_dim=64, group_size=8, variant="dense"),
    MergeSpec(arch="sm_90", head_dim=128, out_dtype="bf16"),
]


FAKE_HEADERS = {"primitives.cuh": "// primitives\n", "merge.cuh": "// merge\n"}


@dataclass
class FakeResult:
    spec: object
    source: str
    cubin: bytes
    registers: int | None
    spill_bytes: int | None
    compile_ms: float
    log: str = ""
    source_path: Path | None = None


class FakeCompileError(RuntimeError):
    def __init__(self, message, log, source_path):
        super().__init__(message)
        self.log = log
        self.source_path = source_path


def fake_result(spec, i=0):
    return FakeResult(spec=spec, source=f"// {spec.name}\n__global__ void k{i}() {{}}\n",
                      cubin=b"\x7fELF" + bytes([i]) * (100 + i), registers=40 + i,
                      spill_bytes=0 if i != 1 else None, compile_ms=123.456 + i)


class FakeCodegen:
    """Records what the CLI asked for; `fail` maps spec names to the exception to raise."""

    def __init__(self, specs=SPECS):
        self.specs = list(specs)
        self.calls = []
        self.compiled = []
        self.fail = {}
        self.before = {}
        self.missing_compiler = None  # the message check_compiler raises with, when set
        self.lock = threading.Lock()

    def check_compiler(self):
        if self.missing_compiler is not None:
            raise real_compiler.CompilerUnavailableError(self.missing_compiler)

    def default_specs(self, arch, *, head_dims=None, group_sizes=None, kv_dtypes=None, page_sizes=(0,), kv_layout="NHD"):
        self.calls.append(dict(arch=arch, head_dims=head_dims, group_sizes=group_sizes,
                               kv_dtypes=kv_dtypes))
        self.paging = (page_sizes, kv_layout)
        return list(self.specs)

    def compile_cubin(self, spec):
        if spec.name in self.before:
            self.before[spec.name]()
        with self.lock:
            self.compiled.append(spec.name)
        if spec.name in self.fail:
            raise self.fail[spec.name]
        return fake_result(spec, self.specs.index(spec))


@pytest.fixture
def fake(monkeypatch, tmp_path):
    fc = FakeCodegen()
    module = types.ModuleType("splitkv.codegen")
    module.default_specs = fc.default_specs
    module.compile_cubin = fc.compile_cubin
    module.CompileError = FakeCompileError
    module.helper_headers = lambda: dict(FAKE_HEADERS)
    # The compiler checks: NVRTC faked, the cache folder's check real (it needs no CuPy) and kept
    # out of the user's own cache.
    module.compile = types.SimpleNamespace(
        check_compiler=fc.check_compiler, ensure_cache_dir=real_compiler.ensure_cache_dir,
        CompilerUnavailableError=real_compiler.CompilerUnavailableError,
        CacheDirError=real_compiler.CacheDirError)
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "splitkv.codegen", module)
    monkeypatch.setattr(splitkv, "codegen", module, raising=False)
    return fc


def run(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out):
    """Rows of the printed table keyed by kernel name (header and rule skipped)."""
    lines = out.strip().splitlines()
    assert lines[0].split()[0] == "kernel", out
    return {line.split()[0]: line.split()[1:] for line in lines[2:]}


# ---- listing and filters ----------------------------------------------------------------------

def test_list_prints_names_and_compiles_nothing(fake, capsys):
    code, out, _ = run(capsys, "--arch", "sm90", "--list")
    assert code == 0
    assert out.splitlines() == [s.name for s in SPECS]
    assert fake.compiled == []


def test_filters_are_passed_through(fake, capsys):
    code, _, _ = run(capsys, "--arch", "sm90", "--head-dim", "64,128", "--head-dim", "256",
                     "--group", "1,4,8", "--dtype", "bf16,fp16", "--list")
    assert code == 0
    assert fake.calls == [dict(arch="sm_90", head_dims=(64, 128, 256), group_sizes=(1, 4, 8),
                               kv_dtypes=("bf16", "fp16"))]


def test_no_filters_means_none(fake, capsys):
    code, _, _ = run(capsys, "--arch", "sm_100a", "--list")
    assert code == 0
    assert fake.calls == [dict(arch="sm_100a", head_dims=None, group_sizes=None, kv_dtypes=None)]


def test_repeated_filter_values_are_deduplicated(fake, capsys):
    code, _, _ = run(capsys, "--arch", "90", "--group", "4,4", "--group", "8,4", "--list")
    assert code == 0
    assert fake.calls[0]["group_sizes"] == (4, 8)


def test_no_matching_kernels_fails(fake, capsys):
    fake.specs = []
    code, _, err = run(capsys, "--arch", "sm90", "--head-dim", "96")
    assert code == 1
    assert "no kernels match" in err


# ---- compiling --------------------------------------------------------------------------------

def test_table_lists_every_kernel_with_its_figures(fake, capsys):
    code, out, err = run(capsys, "--arch", "sm90", "--jobs", "1")
    assert code == 0, err
    header = out.splitlines()[0]
    for column in ("registers", "spill bytes", "compile ms", "cubin bytes"):
        assert column in header
    rows = table_rows(out)
    assert list(rows) == [s.name for s in SPECS]
    for i, spec in enumerate(SPECS):
        r = fake_result(spec, i)
        spill = "-" if r.spill_bytes is None else str(r.spill_bytes)
        assert rows[spec.name] == [str(r.registers), spill, f"{r.compile_ms:.1f}", str(len(r.cubin))]
    assert sorted(fake.compiled) == sorted(s.name for s in SPECS)


def test_progress_one_line_per_kernel(fake, capsys):
    code, _, err = run(capsys, "--arch", "sm90", "--jobs", "1")
    assert code == 0
    progress = [line for line in err.splitlines() if line.startswith("[")]
    assert len(progress) == len(SPECS)
    assert progress[-1].startswith(f"[{len(SPECS)}/{len(SPECS)}]")
    for spec in SPECS:
        assert any(line.endswith(spec.name) for line in progress)


def test_parallel_jobs_keep_spec_order(fake, capsys):
    # The first spec waits for the other two, so completion order differs from spec order (and a
    # CLI that compiled one kernel at a time would show up here as a timeout).
    def wait_for_others():
        deadline = time.monotonic() + 10
        while len(fake.compiled) < len(SPECS) - 1:
            assert time.monotonic() < deadline, "kernels were not compiled concurrently"
            time.sleep(0.01)

    fake.before = {SPECS[0].name: wait_for_others}
    code, out, _ = run(capsys, "--arch", "sm90", "--jobs", "3")
    assert code == 0
    assert fake.compiled[-1] == SPECS[0].name
    assert list(table_rows(out)) == [s.name for s in SPECS]


def test_emit_writes_source_and_cubin(fake, capsys, tmp_path):
    dest = tmp_path / "out" / "kernels"
    code, _, _ = run(capsys, "--arch", "sm90", "--emit", str(dest))
    assert code == 0
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        [f"{s.name}{ext}" for s in SPECS for ext in (".cu", ".cubin")] + list(FAKE_HEADERS))
    for name, text in FAKE_HEADERS.items():  # the sources include them: the folder compiles alone
        assert (dest / name).read_text() == text
    for i, spec in enumerate(SPECS):
        r = fake_result(spec, i)
        assert (dest / f"{spec.name}.cu").read_text() == r.source
        assert (dest / f"{spec.name}.cubin").read_bytes() == r.cubin


@pytest.mark.parametrize("under_a_file", [False, True], ids=["dir-is-a-file", "dir-under-a-file"])
def test_emit_to_a_path_that_cannot_be_a_folder_is_a_usage_error(fake, capsys, tmp_path, under_a_file):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    dest = blocker / "kernels" if under_a_file else blocker
    code, out, err = run(capsys, "--arch", "sm90", "--emit", str(dest))
    assert code == 2
    assert "--emit" in err and str(dest) in err and "Traceback" not in err
    assert fake.compiled == [], "a bad --emit must be refused before anything compiles"
    assert out == ""


def test_emit_creates_its_folder_before_compiling(fake, capsys, tmp_path):
    dest = tmp_path / "new" / "kernels"
    fake.before = {SPECS[0].name: lambda: assert_is_dir(dest)}
    code, _, _ = run(capsys, "--arch", "sm90", "--jobs", "1", "--emit", str(dest))
    assert code == 0


def assert_is_dir(path):
    assert path.is_dir(), f"{path} should exist before the first kernel compiles"


def test_compile_failure_is_reported_and_the_rest_still_build(fake, capsys, tmp_path):
    bad = SPECS[1].name
    log = "\n".join(f"kernel.cu({n}): error: line {n} of the log" for n in range(1, 31))
    source = tmp_path / "cache" / f"{bad}.cu"
    fake.fail = {bad: FakeCompileError("NVRTC failed", log, source)}
    dest = tmp_path / "emit"
    code, out, err = run(capsys, "--arch", "sm90", "--emit", str(dest))
    assert code == 1
    assert list(table_rows(out)) == [SPECS[0].name, SPECS[2].name]
    assert f"FAILED {bad}" in err
    assert "line 1 of the log" in err
    assert f"line {cli.LOG_LINES} of the log" in err
    assert f"line {cli.LOG_LINES + 1} of the log" not in err  # only the first lines
    assert str(source) in err
    assert (dest / f"{SPECS[0].name}.cubin").exists()
    assert not (dest / f"{bad}.cubin").exists()
    assert "2 built, 1 failed" in err


def test_unexpected_error_in_one_kernel_is_reported_per_kernel(fake, capsys):
    bad = SPECS[0].name
    fake.fail = {bad: KeyError("undefined template parameter 'stages'")}
    code, out, err = run(capsys, "--arch", "sm90")
    assert code == 1
    assert f"FAILED {bad}: KeyError" in err
    assert "stages" in err
    assert list(table_rows(out)) == [SPECS[1].name, SPECS[2].name]


# ---- usage errors and unavailable features ----------------------------------------------------

def test_tune_refuses_without_a_gpu_of_the_arch(fake, capsys, monkeypatch):
    pytest.importorskip("optuna")
    from splitkv import timing

    import splitkv.autotune.cli as tune_cli

    def no_gpu():
        raise RuntimeError("no CUDA driver")
    monkeypatch.setattr(tune_cli, "unavailable_reason", lambda device=None: None)  # past the driver check
    monkeypatch.setattr(timing, "gpu_info", no_gpu)
    code, out, err = run(capsys, "--arch", "sm90", "--tune", "--head-dim", "128", "--group", "4", "--dtype", "bf16")
    assert code == 2
    assert "--tune measures on a GPU of sm_90" in err and "no CUDA driver" in err
    assert fake.calls == [] and fake.compiled == []


def test_missing_cupy_is_said_once_with_the_extras_to_install(monkeypatch, capsys, tmp_path):
    # The real code generator, on a machine without CuPy: one message, not one failure per kernel.
    for name in [m for m in sys.modules if m.startswith("cupy.")] + ["cupy"]:
        # As if CuPy had never been installed (its submodules too: an import that finds
        # cupy.cuda in sys.modules never looks at cupy).
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))
    code, out, err = run(capsys, "--arch", "sm90", "--head-dim", "64", "--group", "1,2")
    assert code == 2
    assert out == ""
    assert err.count("splitkv-gen:") == 1 and "FAILED" not in err and "compiling" not in err
    assert "pip install 'splitkv[cu13]'" in err and "'splitkv[cu12]'" in err


def test_missing_compiler_stops_before_compiling(fake, capsys):
    fake.missing_compiler = "NVRTC is not available; pip install 'splitkv[cu13]'"
    code, _, err = run(capsys, "--arch", "sm90")
    assert code == 2
    assert err.strip() == f"splitkv-gen: {fake.missing_compiler}"
    assert fake.compiled == []


def test_unwritable_cache_is_said_once(fake, capsys, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = blocker / "cache"
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(cache))
    code, out, err = run(capsys, "--arch", "sm90")
    assert code == 2
    assert err.count("splitkv-gen:") == 1 and "FAILED" not in err
    assert str(cache) in err and "SPLITKV_CACHE_DIR" in err
    assert fake.compiled == [] and out == ""


@pytest.mark.parametrize("arch, expected", [
    ("sm75", "sm_80 or newer"),
    ("banana", "expected something like"),
])
def test_bad_arch_is_a_usage_error(fake, capsys, arch, expected):
    code, _, err = run(capsys, "--arch", arch, "--list")
    assert code == 2
    assert "--arch" in err and expected in err
    assert fake.calls == []


def test_missing_arch_is_a_usage_error(fake, capsys):
    code, _, err = run(capsys, "--list")
    assert code == 2
    assert "--arch is required" in err


@pytest.mark.parametrize("argv, expected", [
    (["--head-dim", "100"], "--head-dim: 100 is not supported"),
    (["--head-dim", "x"], "expected comma-separated int"),
    (["--group", "0"], "--group: 0 is out of range"),
    (["--dtype", "fp32"], "--dtype: 'fp32' is not supported"),
    (["--jobs", "0"], "--jobs"),
])
def test_bad_filter_is_a_usage_error(fake, capsys, argv, expected):
    code, _, err = run(capsys, "--arch", "sm90", *argv)
    assert code == 2
    assert expected in err
    assert fake.compiled == []


def test_quantized_dtypes_below_sm89_are_a_usage_error(fake, capsys):
    code, _, err = run(capsys, "--arch", "sm80", "--dtype", "fp8_e4m3")
    assert code == 2 and "fp8_e4m3 K/V need sm_89 or newer" in err
    assert fake.compiled == []


def test_the_default_set_leaves_quantized_dtypes_out_below_sm89():
    from splitkv.codegen import default_specs

    assert {s.kv_dtype for s in default_specs("sm80") if hasattr(s, "kv_dtype")} == {"bf16", "fp16"}
    assert {s.kv_dtype for s in default_specs("sm89") if hasattr(s, "kv_dtype")} == {"bf16", "fp16", "fp8_e4m3", "nvfp4"}


# ---- bench subcommand, entry point, start-up cost ---------------------------------------------

def test_bench_forwards_its_arguments(monkeypatch, capsys):
    seen = []
    bench = types.ModuleType("splitkv.bench")
    bench.main = lambda args: seen.append(args) or 3
    monkeypatch.setitem(sys.modules, "splitkv.bench", bench)
    monkeypatch.setattr(splitkv, "bench", bench, raising=False)
    code, _, _ = run(capsys, "bench", "--arch", "sm90", "--json", "x.json")
    assert code == 3
    assert seen == [["--arch", "sm90", "--json", "x.json"]]


def test_a_reader_that_goes_away_ends_the_output_quietly():
    # `splitkv-gen --arch sm90 --list | head -1`, made deterministic: the pipe has no reader at
    # all, so the first write fails however fast or slow the child is.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "splitkv.cli", "--arch", "sm90", "--list"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == cli.EXIT_BROKEN_PIPE


def test_help_imports_neither_codegen_nor_bench():
    probe = ("import sys\nfrom splitkv import cli\n"
             "try:\n    cli.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
             "print('HEAVY', sorted(m for m in ('splitkv.codegen', 'splitkv.bench') "
             "if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--arch" in done.stdout and "bench" in done.stdout
    assert "HEAVY []" in done.stdout


def test_console_script_points_at_main():
    from importlib.metadata import PackageNotFoundError, entry_points, version

    try:
        version("splitkv")
    except PackageNotFoundError:
        pytest.fail("splitkv is not installed; run `pip install -e '.[cu13,test]'` first")
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("splitkv-gen") == "splitkv.cli:main"


def test_real_codegen_offers_what_the_cli_calls():
    # The tests above run against a fake; this pins the fake's shape to the real module's, so the
    # two cannot drift apart unnoticed. Nothing is rendered or compiled here.
    import importlib
    import inspect

    codegen = importlib.import_module("splitkv.codegen")
    params = inspect.signature(codegen.default_specs).parameters
    for keyword in ("head_dims", "group_sizes", "kv_dtypes"):
        assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY, keyword
    assert callable(codegen.compile_cubin)
    for name in ("check_compiler", "ensure_cache_dir"):
        assert callable(getattr(codegen.compile, name)), name
    assert issubclass(codegen.compile.CompilerUnavailableError, Exception)
    assert issubclass(codegen.compile.CacheDirError, OSError)
    templates = Path(codegen.__file__).resolve().parent.parent / "templates"
    # Every header NVRTC may include, by the name the programs include it by (decode/ headers too).
    assert set(codegen.helper_headers()) == {str(p.relative_to(templates)) for p in templates.rglob("*.cuh")}
    assert {"primitives.cuh", "merge.cuh", "kv_formats.cuh", "decode/kernel.cuh"} <= set(codegen.helper_headers())
    assert issubclass(codegen.CompileError, Exception)
    err = codegen.CompileError("failed", "the log", Path("kernel.cu"))
    assert err.log == "the log" and err.source_path == Path("kernel.cu")


def test_page_sizes_and_layout_reach_the_kernel_set(fake, capsys):
    code, _, _ = run(capsys, "--arch", "sm90", "--list", "--page-size", "0,16", "--page-size", "64", "--layout", "HND")
    assert code == 0 and fake.paging == ((0, 16, 64), "HND")
    code, _, err = run(capsys, "--arch", "sm90", "--list", "--page-size", "12")
    assert code == 2 and "--page-size: 12 is not supported" in err


# ---- --warm: what DecodeAttention.warmup compiles, listed or compiled without a GPU ----------------
def test_warm_lists_what_a_warm_up_compiles(capsys):
    from splitkv import warmup
    from splitkv.tuned.keys import TuneKey

    assert cli.main(["--arch", "sm90", "--warm", "--list", "--gpu", "NVIDIA H200", "--head-dim", "128", "--group", "4",
                     "--kv-heads", "8", "--max-len", "65536", "--max-batch", "64"]) == 0
    captured = capsys.readouterr()
    expected, entries = warmup.programs_to_warm("sm_90", "NVIDIA H200", TuneKey(128, 4, "bf16", "bf16", 0, "NHD"), 8,
                                                64, 65536)
    assert captured.out.split() == [spec.name for spec in expected]
    assert f"d128-g4-bf16-bf16-contiguous: {len(expected)} programs from {entries} tuned entries" in captured.err
    assert entries > 1


def test_warm_of_paged_caches_and_several_keys(capsys):
    assert cli.main(["--arch", "sm90", "--warm", "--list", "--head-dim", "128,64", "--group", "8", "--dtype",
                     "fp8_e4m3", "--page-size", "16", "--layout", "HND", "--kv-heads", "2", "--max-len", "4096"]) == 0
    names = capsys.readouterr().out.split()
    assert names and all(name.endswith("-p16hnd") or "merge" in name for name in names), names
    assert any(name.startswith("sm_90-d64-") for name in names) and any(name.startswith("sm_90-d128-") for name in names)


@pytest.mark.parametrize("argv, message", [
    (["--warm", "--group", "4", "--kv-heads", "8", "--max-len", "10"], "--warm: give the model's --head-dim and --group"),
    (["--warm", "--head-dim", "128", "--group", "4", "--max-len", "10"], "--warm: give --kv-heads and --max-len"),
    (["--warm", "--head-dim", "128", "--group", "4", "--kv-heads", "0", "--max-len", "10"],
     "num_kv_heads: expected a positive int, got 0"),
    (["--warm", "--head-dim", "128", "--group", "4", "--kv-heads", "8", "--max-len", "0"],
     "max_len: expected an int of at least 1, got 0"),
    (["--head-dim", "128", "--max-len", "10"], "--max-len goes with --warm"),
])
def test_warm_flags(capsys, argv, message):
    try:
        rc = cli.main(["--arch", "sm90", *argv])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err
