"""Compile rendered programs to cubin with NVRTC (through CuPy's bindings), with no GPU needed.

The same path serves the runtime and the GPU-free uses (CI, ``splitkv-gen``): NVRTC is given the
target arch explicitly, so it never asks a driver. Cubins are cached in memory and on disk, keyed
by everything that can change the machine code: the rendered source, the helper headers, the
options and the NVRTC version. Each cached program keeps its source and headers under
``src/<key>/`` of the cache, so a failure or a profile points at exactly what was compiled.
A cached cubin is served only if it matches the digest its metadata holds, and a program that
several processes (or threads) ask for at once is compiled by one of them, under a file lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import glob
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
import warnings
from pathlib import Path

from .render import helper_headers, render

_REGISTERS_RE = re.compile(r"Used (\d+) registers")
_SPILLS_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")

_logger = logging.getLogger("splitkv")

#: How long a compile waits for another process compiling the same program before compiling it
#: too (a holder that died has released its lock; one that waits this long is stopped or hung).
LOCK_WAIT_S = 600.0

#: What to install when NVRTC (through CuPy) or the CUDA headers are missing; see pyproject's extras.
INSTALL_HINT = ("install splitkv with the extra of your CUDA driver: "
                "pip install 'splitkv[cu13]' (CUDA 13) or pip install 'splitkv[cu12]' (CUDA 12)")


class CompileError(RuntimeError):
    """NVRTC rejected a program: carries its log and where the rendered source was written."""

    def __init__(self, message: str, log: str, source_path: Path | None):
        super().__init__(f"{message}\n--- NVRTC log ---\n{log}\n--- rendered source: {source_path}")
        self.log = log
        self.source_path = source_path


class CompilerUnavailableError(ImportError):
    """NVRTC (through CuPy) or the CUDA headers cannot be found, so no program can be compiled."""


class CacheDirError(OSError):
    """The cache folder cannot be created or written; compiled programs are loaded from there."""

    def __init__(self, folder: Path, cause: OSError):
        origin = " (from SPLITKV_CACHE_DIR)" if os.environ.get("SPLITKV_CACHE_DIR") else ""
        super().__init__(f"cannot write the kernel cache {folder}{origin}: {cause.strerror or cause}; "
                         "set SPLITKV_CACHE_DIR to a writable folder")
        self.folder = folder


@dataclasses.dataclass(frozen=True)
class CompileResult:
    spec: AnySpec
    source: str
    cubin: bytes
    registers: int | None
    spill_bytes: int | None
    compile_ms: float
    log: str
    source_path: Path | None  # the compiled source, with its headers beside it; None if since deleted
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
    raise CompilerUnavailableError(f"CUDA headers (cuda_bf16.h) not found: {INSTALL_HINT}, "
                                   "or set CUDA_PATH to a CUDA toolkit")


def _nvrtc():
    """CuPy's NVRTC bindings, or an error that says what to install instead of a bare import error."""
    try:
        from cupy.cuda import nvrtc
    except ImportError as exc:
        raise CompilerUnavailableError(f"NVRTC is not available (CuPy cannot be imported: {exc}); "
                                       f"{INSTALL_HINT}") from exc
    return nvrtc


@functools.lru_cache(maxsize=1)
def _nvrtc_library():
    """The NVRTC library CuPy's bindings use, through ctypes (loaded by cuda-pathfinder, as CuPy
    loads it), for the two calls `_cubin_of` makes."""
    import ctypes

    from cuda.pathfinder import load_nvidia_dynamic_lib

    library = ctypes.CDLL(load_nvidia_dynamic_lib("nvrtc").abs_path)
    for name in ("nvrtcGetCUBINSize", "nvrtcGetCUBIN"):
        getattr(library, name).restype = ctypes.c_int
    return library


def _cubin_of(program: int) -> bytes:
    """The compiled program's cubin, all of it: CuPy's getCUBIN strips a trailing NUL that a cubin
    does not have, and so drops the ELF's last byte."""
    import ctypes

    library = _nvrtc_library()
    size = ctypes.c_size_t()
    status = library.nvrtcGetCUBINSize(ctypes.c_void_p(program), ctypes.byref(size))
    if status == 0:
        buffer = ctypes.create_string_buffer(size.value)
        status = library.nvrtcGetCUBIN(ctypes.c_void_p(program), buffer)
    if status != 0:
        raise RuntimeError(f"NVRTC could not return the cubin (nvrtcResult {status})")
    return buffer.raw


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


def check_compiler() -> None:
    """Raise CompilerUnavailableError unless NVRTC and the CUDA headers can be found, so that a tool
    compiling many programs can say so once instead of once per program."""
    nvrtc_version()
    cuda_include_dirs()


def make_writable_folder(folder: Path) -> None:
    """Create ``folder`` if needed and check that files can be written in it (OSError otherwise):
    a probe file, because mkdir succeeds on a folder that exists but cannot be written."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
        pass


def ensure_cache_dir() -> Path:
    """The cache folder, created if needed and checked writable; CacheDirError if it is not."""
    folder = cache_dir()
    try:
        make_writable_folder(folder)
    except OSError as exc:
        raise CacheDirError(folder, exc) from exc
    return folder


def nvrtc_options(arch: str) -> list[str]:
    # NVRTC from 12.9 on serves a program it compiled before from the driver's compute cache, and
    # then prints no ptxas report: the registers (which bound the resident CTAs the planner counts
    # on) and spills would be lost. --no-cache keeps every compile whole; splitkv caches cubins itself.
    no_cache = ["--no-cache"] if nvrtc_version() >= (12, 9) else []
    return [f"--gpu-architecture={arch}", "--std=c++17", "-Xptxas=-v", *no_cache,
            *(f"--include-path={d}" for d in cuda_include_dirs())]


_memory_cache: dict[tuple, CompileResult] = {}
_lock = threading.Lock()


def compile_cubin(spec: AnySpec, *, use_disk_cache: bool = True,
                  source: str | None = None, headers: dict[str, str] | None = None) -> CompileResult:
    """Render ``spec`` and compile it to a cubin for ``spec.compile_arch``; no GPU is involved.

    A program compiled earlier in this process is returned from memory. Otherwise the disk cache is
    read, unless ``use_disk_cache`` is False: then the program is compiled again, and the new cubin
    still replaces the one on disk, because the loader loads cubins from their file. Compiling needs
    a writable cache folder (CacheDirError names it otherwise); reading a cached cubin does not.
    Callers compiling one program at once, in threads or processes, compile it once: the others
    wait for it (see `_compile_lock`) and read its cubin.

    ``source`` replaces the rendered program (the benchmark tools patch it to time or stamp its
    parts), compiled with the same options and headers so that it differs in nothing else.
    ``headers`` replaces the helper headers by include name (a tool comparing an older copy of
    them); both are part of the cache key.
    """
    patched = source is not None or headers is not None
    source = source if source is not None else render(spec)
    headers = helper_headers() if headers is None else dict(sorted(headers.items()))
    options = nvrtc_options(spec.compile_arch)
    key = _cache_key(source, headers, options)
    # The key already keeps the two apart; the name says which one a log or a listing shows.
    stem = f"{spec.name}-patched" if patched else spec.name
    with _lock:
        if key in _memory_cache:
            return _memory_cache[key]
    folder = cache_dir()
    # A valid cubin is read without the lock, so that a cache shipped read-only serves its programs
    # without a lock file to create.
    result = _read_disk_cache(folder, key, spec, source, stem) if use_disk_cache else None
    if result is not None:
        return _remember(key, result)
    with _compile_lock(folder, key):
        # One that held the lock before may have compiled the program: a thread of this process
        # leaves it in memory, another process on disk.
        with _lock:
            result = _memory_cache.get(key)
        if result is None and use_disk_cache:
            result = _read_disk_cache(folder, key, spec, source, stem)
        if result is None:
            result = _compile(spec, source, headers, options, folder, key, stem)
        return _remember(key, result)  # before the lock is released, for the threads waiting on it


def _remember(key: str, result: CompileResult) -> CompileResult:
    """Keep ``result`` in memory; the one kept first is what every caller gets."""
    with _lock:
        return _memory_cache.setdefault(key, result)


@contextlib.contextmanager
def _compile_lock(folder: Path, key: str):
    """Hold an exclusive flock on ``<key>.lock`` of the cache while ``key`` is looked up and compiled.

    Each call opens the file anew, and a flock belongs to the open file, not the process, so the
    lock keeps threads of one process apart as it does processes. The kernel releases the lock of
    a process that dies, so no lock is ever stale and none needs clearing; the (empty) file stays,
    since one removed while a waiter holds it open would let a newcomer lock a new file beside it.
    Past `LOCK_WAIT_S` (a holder stopped, not dead) the program is compiled anyway, with a warning:
    the cache's files are replaced atomically, so a second compile costs time, not a broken cache.
    A file system without flock compiles without the lock, for the same reason.
    """
    path = folder / f"{key}.lock"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # Read-only is enough to flock, so users sharing a cache can lock one another's files.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise CacheDirError(folder, exc) from exc
    try:
        try:
            timed_out = not _flock(fd, LOCK_WAIT_S)
        except OSError:  # no flock on this file system
            timed_out = False
        if timed_out:
            warnings.warn(f"splitkv: waited {LOCK_WAIT_S:.0f} s for {path}, held by another process "
                          "compiling the same program; compiling it here too", RuntimeWarning, stacklevel=4)
        yield
    finally:
        os.close(fd)  # releases the lock


def _flock(fd: int, wait_s: float) -> bool:
    """Lock ``fd`` exclusively, waiting up to ``wait_s``: False if that passed. Polled, because a
    blocking flock cannot be given a timeout."""
    deadline = time.monotonic() + wait_s
    pause = 0.005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.1)


@functools.lru_cache(maxsize=1)
def toolchain_fingerprint() -> str:
    """What of the compiler the cache key holds beyond NVRTC's (major, minor): the installed NVRTC
    package's version (its patch level) and the CUDA headers' names, sizes and modification times
    (an upgraded runtime package rewrites them), so an upgrade never serves an older cubin."""
    from importlib import metadata

    parts = []
    for dist in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu13", "nvidia-cuda-nvrtc-cu12"):
        try:
            parts.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    for folder in cuda_include_dirs():
        for root, _, files in sorted(os.walk(folder)):
            for name in sorted(files):
                try:
                    st = os.stat(os.path.join(root, name))
                except OSError:
                    continue
                parts.append(f"{os.path.relpath(os.path.join(root, name), folder)}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


#: Changes when what the cache holds for a key changes (3: the metadata holds the cubin's sha256;
#: 2: whole cubins; 1 lacked the last byte).
_CACHE_FORMAT = "3"


def _cache_key(source: str, headers: dict[str, str], options: list[str]) -> str:
    digest = hashlib.sha256()
    for part in (_CACHE_FORMAT, repr(nvrtc_version()), toolchain_fingerprint(), "\0".join(options), source,
                 *headers.keys(), *headers.values()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:24]


def _compile(spec, source, headers, options, folder: Path, key: str, stem: str) -> CompileResult:
    nvrtc = _nvrtc()
    src = folder / _source_dir(key)
    source_path = src / f"{stem}.cu"
    # Written first: it is where a failure points, and an unwritable cache shows before NVRTC runs.
    _write_cache_files(folder, [*((src / name, text.encode()) for name, text in headers.items()),
                                (source_path, source.encode())])
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
        cubin = _cubin_of(program)
    finally:
        nvrtc.destroyProgram(program)
    compile_ms = (time.perf_counter() - start) * 1e3
    registers, spills = parse_ptxas_log(log)
    meta = {"name": spec.name, "sha256": hashlib.sha256(cubin).hexdigest(), "registers": registers,
            "spill_bytes": spills, "compile_ms": compile_ms, "log": log}
    cubin_path = folder / f"{key}.cubin"
    # The cubin before its metadata: a reader that finds the metadata finds the cubin it describes
    # (or, amid a rewrite, one that fails the digest and is read again under the lock).
    _write_cache_files(folder, [(cubin_path, cubin),
                                (folder / f"{key}.json", json.dumps(meta, indent=1).encode())])
    return CompileResult(spec, source, cubin, registers, spills, compile_ms, log, source_path, cubin_path)


def _read_disk_cache(folder: Path, key: str, spec, source: str, stem: str) -> CompileResult | None:
    cubin_path, meta_path = folder / f"{key}.cubin", folder / f"{key}.json"
    try:
        meta = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError):
        return None
    # A cubin cut short or damaged (a crash mid-write, a full disk, a bad copy), or one from before
    # digests were kept, is not served: the caller compiles it again and rewrites it, which mends
    # the cache, so the user is told nothing (a debug line says why).
    if not isinstance(meta, dict) or meta.get("sha256") != hashlib.sha256(cubin).hexdigest():
        _logger.debug("splitkv: cached %s does not match its digest; compiling it again", cubin_path)
        return None
    source_path = folder / _source_dir(key) / f"{stem}.cu"
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


def _source_dir(key: str) -> Path:
    """Where a program's source and headers are kept, relative to the cache: one folder per cache
    key, so programs of the same name (two splitkv versions sharing a cache) never overwrite each
    other's."""
    return Path("src") / key


def _write_cache_files(folder: Path, files: list[tuple[Path, bytes]]) -> None:
    """Write ``files`` (paths under the cache ``folder``) in order. Any OSError becomes a
    CacheDirError naming the folder: nothing compiled can be loaded from a cache that cannot be
    written."""
    try:
        for path, data in files:
            atomic_write(path, data)
    except OSError as exc:
        raise CacheDirError(folder, exc) from exc


def _file_mode() -> int:
    """0o666 less the umask: the mode open() would give a new file (mkstemp gives 0o600, which
    other users of a shared cache could not read)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    # Setting the umask to read it is visible to other threads for an instant; hence the file above.
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file renamed over it, so that no reader sees
    half a file; the file gets the mode a plain open() would give it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if hasattr(os, "fchmod"):  # POSIX (and Windows from Python 3.13, where it sets only read-only)
                os.fchmod(handle.fileno(), _file_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
