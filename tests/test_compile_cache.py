"""The disk cache's guards: a cubin is served only if it matches the digest kept beside it, and
processes or threads compiling one program at once compile it once (a file lock per program)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import multiprocessing
import subprocess
import sys
import threading
import time
import warnings

import pytest

import splitkv.codegen.compile as compile_module
from splitkv.spec import MergeSpec

pytestmark = pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                                reason="CuPy is not installed (pip install -e '.[cu13,test]')")

SPEC = MergeSpec(head_dim=64, out_dtype="fp16")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder and an empty memory cache, so that results come from this test."""
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_module, "_memory_cache", {})
    return tmp_path


def _compile_from_disk():
    """``SPEC`` as a new process would get it: the memory cache forgotten, the disk cache read."""
    compile_module._memory_cache.clear()
    return compile_module.compile_cubin(SPEC)


def _damaged(cubin: bytes, how: str) -> bytes:
    if how == "cut-short":  # what a crash mid-copy leaves: still ELF, and a plausible size
        return cubin[: len(cubin) // 2]
    middle = len(cubin) // 2
    return cubin[:middle] + bytes([cubin[middle] ^ 0x10]) + cubin[middle + 1:]


@pytest.mark.parametrize("how", ["cut-short", "flipped-byte"])
def test_a_cubin_that_fails_its_digest_is_compiled_again(fresh, how):
    first = compile_module.compile_cubin(SPEC)
    damaged = _damaged(first.cubin, how)
    assert damaged[:4] == b"\x7fELF" and damaged != first.cubin
    first.cubin_path.write_bytes(damaged)
    again = _compile_from_disk()
    assert not again.cached, "a damaged cubin was served"
    assert again.cubin == first.cubin and first.cubin_path.read_bytes() == first.cubin, "the cache is mended"
    assert _compile_from_disk().cached


@pytest.mark.parametrize("meta", [None, "no-digest", "not-an-object"])
def test_a_cubin_without_its_digest_is_compiled_again(fresh, meta):
    # The metadata lost, or written by an older splitkv (no digest), or not what it should be.
    first = compile_module.compile_cubin(SPEC)
    meta_path = first.cubin_path.with_suffix(".json")
    if meta is None:
        meta_path.unlink()
    elif meta == "no-digest":
        kept = json.loads(meta_path.read_text())
        del kept["sha256"]
        meta_path.write_text(json.dumps(kept))
    else:
        meta_path.write_text("[]")
    again = _compile_from_disk()
    assert not again.cached and again.cubin == first.cubin
    assert json.loads(meta_path.read_text())["sha256"] == hashlib.sha256(first.cubin).hexdigest()


def test_a_valid_cubin_in_a_read_only_cache_is_served_without_writing(fresh):
    # A cache shipped prebuilt in a read-only image: no lock file, no rewrite, nothing.
    first = compile_module.compile_cubin(SPEC)
    for lock in fresh.glob("*.lock"):  # shipped without them (they are the compiling processes')
        lock.unlink()
    before = _listing(fresh)
    for folder in (fresh, *(p for p in fresh.rglob("*") if p.is_dir())):
        folder.chmod(0o555)
    try:
        again = _compile_from_disk()
    finally:
        for folder in (fresh, *(p for p in fresh.rglob("*") if p.is_dir())):
            folder.chmod(0o755)
    assert again.cached and again.cubin == first.cubin
    assert _listing(fresh) == before


def _listing(folder):
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def _compile_with_the_others(barrier, results):
    """One of several processes asking for ``SPEC`` at the same instant (after the work before the
    compile, which would otherwise set them apart)."""
    compile_module.toolchain_fingerprint()
    compile_module.nvrtc_options(SPEC.arch)
    barrier.wait()
    result = compile_module.compile_cubin(SPEC)
    results.put((result.cached, hashlib.sha256(result.cubin).hexdigest()))


def test_processes_compiling_one_program_at_once_compile_it_once(fresh):
    context = multiprocessing.get_context("spawn")
    count = 4
    barrier, results = context.Barrier(count), context.Queue()
    workers = [context.Process(target=_compile_with_the_others, args=(barrier, results)) for _ in range(count)]
    for worker in workers:
        worker.start()
    try:
        outcomes = [results.get(timeout=120) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=60)
    # The one that compiled returns cached=False; those that waited for it read its cubin from disk.
    assert sorted(cached for cached, _ in outcomes) == [False, True, True, True]
    assert len({digest for _, digest in outcomes}) == 1


def test_threads_compiling_one_program_at_once_compile_it_once(fresh, monkeypatch):
    # The tuner compiles on a thread pool; NVRTC releases the GIL, so without the lock each would compile.
    compiles = []
    real_compile = compile_module._compile

    def counted(*args):
        compiles.append(threading.get_ident())
        return real_compile(*args)

    monkeypatch.setattr(compile_module, "_compile", counted)
    barrier, results = threading.Barrier(4), []

    def ask():
        barrier.wait()
        results.append(compile_module.compile_cubin(SPEC))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(compiles) == 1 and len(results) == 4
    assert all(result is results[0] for result in results)


def _hold_the_lock(fresh):
    """A process holding ``SPEC``'s compile lock, as one compiling it would."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(fresh / f"{_key_of(SPEC)}.lock")],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    return holder


_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def _key_of(spec):
    return compile_module._cache_key(compile_module.render(spec), compile_module.helper_headers(),
                                     compile_module.nvrtc_options(spec.arch))


def test_a_lock_held_too_long_is_waited_for_only_so_long(fresh, monkeypatch):
    monkeypatch.setattr(compile_module, "LOCK_WAIT_S", 0.5)
    holder = _hold_the_lock(fresh)
    try:
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match="compiling it here too"):
            result = compile_module.compile_cubin(SPEC)
        assert not result.cached and result.cubin_path.read_bytes() == result.cubin
        assert time.monotonic() - start >= 0.5, "the lock was not waited for"
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_process_is_released(fresh, monkeypatch):
    monkeypatch.setattr(compile_module, "LOCK_WAIT_S", 10.0)
    holder = _hold_the_lock(fresh)
    holder.kill()
    holder.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a wait past LOCK_WAIT_S would warn
        result = compile_module.compile_cubin(SPEC)
    assert not result.cached and result.cubin[:4] == b"\x7fELF"



@pytest.mark.parametrize("version, asked", [((12, 8), False), ((12, 9), True), ((13, 0), True)])
def test_nvrtc_is_told_not_to_serve_compiles_from_the_drivers_cache(monkeypatch, version, asked):
    """NVRTC 12.9+ would serve a repeated compile from the driver's compute cache with no ptxas
    report, so no registers: the resident CTAs would then be counted from shared memory alone."""
    monkeypatch.setattr(compile_module, "nvrtc_version", lambda: version)
    assert ("--no-cache" in compile_module.nvrtc_options(SPEC.arch)) is asked


def test_a_compile_reports_registers_every_time(fresh):
    """The same program compiled again, past every cache of splitkv's, still reports its registers."""
    first = compile_module.compile_cubin(SPEC, use_disk_cache=False)
    compile_module._memory_cache.clear()
    again = compile_module.compile_cubin(SPEC, use_disk_cache=False)
    assert first.registers and again.registers == first.registers and not again.cached
