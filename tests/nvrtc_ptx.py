"""PTX of a CUDA source string through NVRTC, for tests that keep run-time kernels compiling on a
machine without a GPU."""

import pytest


def ptx_for_sm90(source: str, name: str) -> str:
    """PTX of a CUDA source compiled by NVRTC for compute_90 (no GPU needed); the test fails
    with NVRTC's log if it does not compile, and skips where NVRTC is missing."""
    pytest.importorskip("cupy")
    try:
        from cupy.cuda import nvrtc

        prog = nvrtc.createProgram(source, name, [], [])
    except Exception as exc:  # NVRTC library missing on this machine
        pytest.skip(f"NVRTC unavailable: {exc}")
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=compute_90", "-std=c++17"])
    except Exception:
        pytest.fail(nvrtc.getProgramLog(prog))
    ptx = nvrtc.getPTX(prog)
    nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx
