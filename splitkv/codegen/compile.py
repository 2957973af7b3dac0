"""Compile rendered programs to cubin with NVRTC (through CuPy's bindings), with no GPU needed.

The same path serves the runtime and the GPU-free uses (CI, ``splitkv-gen``): NVRTC is given the
target arch explicitly, so it never asks a driver. Cubins are cached in memory and on disk, keyed
by everything that can change the machine code: the rendered source, the helper headers, the
options and the NVRTC version.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from ..spec import KernelSpec, MergeSpec
from .render import helper_headers, render

_REGISTERS_RE = re.compile(r"Used (\d+) registers")
_SPILLS_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


class CompileError(RuntimeError):
    """NVRTC rejected a program: carries its log and where the rendered source was written."""

    def __init__(self, message: str, log: str, source_path: Path | None):
        super().__init__(f"{message}\n--- NVRTC log ---\n{log}\n--- rendered source: {source_path}")
        self.log = log
        self.source_path = source_path


@dataclasses.dataclass(frozen=True)
class CompileResult:
    spec: KernelSpec | MergeSpec
    source: str
    cubin: bytes
    registers: int | None
    spill_bytes: int | None
    compile_ms: float
    log: str
    source_path: Path | None
    cubin_path: Path | None = None
    cached: bool = False  # from the disk cache; compile_ms is then the time of the original compile


def cache_dir() -> Path:
    """``$SPLITKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/splitkv``, else ``~/.cache/splitkv``."""
    explicit = os.environ.get("SPLITKV_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "splitkv"


@functools.lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories holding the CUDA headers the programs include (cuda_bf16.h, cuda_fp16.h).

    Looked up in the NVIDIA runtime wheels first (what ``splitkv[cu13]`` installs), then in
    ``$CUDA_PATH`` / ``$CUDA_HOME`` and the usual toolkit location.
    """
    candidates = []
    try:
        import nvidia  # namespace package of the NVIDIA wheels

        for root in nvidia.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "*", "include")))
            candidates += sorted(glob.glob(os.path.join(root, "cuda_runtime", "include")))
    except ImportError:
        pass
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append("/usr/local/cuda/include")
    for folder in candidates:
        if os.path.exists(os.path.join(folder, "cuda_bf16.h")):
            return (folder,)
    raise CompileError("CUDA headers (cuda_bf16.h) not found: install splitkv[cu13] (or [cu12]), "
                       "or set CUDA_PATH", "", None)


def nvrtc_version() -> tuple[int, int]:
    from cupy.cuda import nvrtc

    return tuple(nvrtc.getVersion())


def nvrtc_options(arch: str) -> list[str]:
    return [f"--gpu-architecture={arch}", "--std=c++17", "-Xptxas=-v",
            *(f"--include-path={d}" for d in cuda_include_dirs())]


_memory_cache: dict[tuple, CompileResult] = {}
_lock = threading.Lock()


def compile_cubin(spec: KernelSpec | MergeSpec, *, use_disk_cache: bool = True,
                  source: str | None = None) -> CompileResult:
    """Render ``spec`` and compile it to a cubin for ``spec.arch``; no GPU is involved.

    ``source`` replaces the rendered program (the benchmark tools patch it to time or stamp its
    parts), compiled with the same options and headers so that it differs in nothing else.
    """
    patched = source is not None
    source = source if patched else render(spec)
    headers = helper_headers()
    options = nvrtc_options(spec.arch)
    key = _cache_key(source, headers, options)
    # A patched program keeps its source next to, not over, the rendered one's.
    stem = f"{spec.name}-patched-{key[:12]}" if patched else spec.name
    with _lock:
        if key in _memory_cache:
            return _memory_cache[key]
    folder = cache_dir()
    result = _read_disk_cache(folder, key, spec, source, stem) if use_disk_cache else None
    if result is None:
        result = _compile(spec, source, headers, options, folder, key, stem)
    with _lock:
        _memory_cache[key] = result
    return result


def _cache_key(source: str, headers: dict[str, str], options: list[str]) -> str:
    digest = hashlib.sha256()
    for part in (repr(nvrtc_version()), "\0".join(options), source, *headers.keys(), *headers.values()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:24]


def _compile(spec, source, headers, options, folder: Path, key: str, stem: str) -> CompileResult:
    from cupy.cuda import nvrtc

    source_path = _write_source(folder, stem, source, headers)
    start = time.perf_counter()
    program = nvrtc.createProgram(source, f"{stem}.cu", [h.encode() for h in headers.values()],
                                  [n.encode() for n in headers.keys()])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            raise CompileError(f"NVRTC failed to compile {spec.name} ({exc})",
                               nvrtc.getProgramLog(program), source_path) from None
        log = nvrtc.getProgramLog(program)
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    compile_ms = (time.perf_counter() - start) * 1e3
    registers, spills = parse_ptxas_log(log)
    cubin_path = _atomic_write(folder / f"{key}.cubin", cubin)
    meta = {"name": spec.name, "registers": registers, "spill_bytes": spills, "compile_ms": compile_ms, "log": log}
    _atomic_write(folder / f"{key}.json", json.dumps(meta, indent=1).encode())
    return CompileResult(spec, source, cubin, registers, spills, compile_ms, log, source_path, cubin_path)


def _read_disk_cache(folder: Path, key: str, spec, source: str, stem: str) -> CompileResult | None:
    cubin_path, meta_path = folder / f"{key}.cubin", folder / f"{key}.json"
    try:
        meta = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError):
        return None
    source_path = folder / "src" / f"{stem}.cu"
    return CompileResult(spec, source, cubin, meta.get("registers"), meta.get("spill_bytes"),
                         float(meta.get("compile_ms", 0.0)), meta.get("log", ""),
                         source_path if source_path.exists() else None, cubin_path, cached=True)


def parse_ptxas_log(log: str) -> tuple[int | None, int | None]:
    """Registers and spill bytes (stores + loads) of the kernel, from ptxas' verbose report."""
    regs = _REGISTERS_RE.findall(log)
    spills = _SPILLS_RE.findall(log)
    registers = max(int(r) for r in regs) if regs else None
    spill_bytes = max(int(s) + int(l) for s, l in spills) if spills else None
    return registers, spill_bytes


def _write_source(folder: Path, stem: str, source: str, headers: dict[str, str]) -> Path | None:
    """Keep the rendered program (and its headers) on disk, so a failure can point at it."""
    src = folder / "src"
    try:
        src.mkdir(parents=True, exist_ok=True)
        for name, text in headers.items():
            _atomic_write(src / name, text.encode())
        return _atomic_write(src / f"{stem}.cu", source.encode())
    except OSError:
        return None


def _atomic_write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
