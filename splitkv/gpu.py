"""Whether a CUDA GPU is usable here, and a splitkv error that says why not.

Without a driver CuPy's first device call raises "CUDA driver version is insufficient for CUDA
runtime version", which reads as a version mismatch even when no NVIDIA driver is installed at
all. `require_gpu` asks the runtime the questions that tell the cases apart (is there a driver,
which CUDA version does it support, how many devices does it see) and raises `GpuUnavailableError`
naming the one that failed and what to do. The runtime, `quantize_kv` and `splitkv-gen --tune`
call it before their first device call; the tests' skip reasons use `unavailable_reason`.
Compiling needs no GPU (`splitkv-gen --arch sm90 ...`), so nothing here runs on that path.
"""

from __future__ import annotations

import os


class GpuUnavailableError(RuntimeError):
    """No usable CUDA GPU: no driver, a driver older than the CUDA runtime, or no device."""


def _cuda_version(encoded: int) -> str:
    """'13.0' from the runtime's 13000."""
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def _cuda_runtime():
    """CuPy's CUDA runtime module (its own function, so that tests can stand in for it)."""
    import cupy

    return cupy.cuda.runtime


def unavailable_reason(device: int | None = None) -> str | None:
    """None when ``device`` (None: any device) can be used, else a sentence saying why not."""
    try:
        runtime = _cuda_runtime()
    except Exception as e:  # ImportError, or a CuPy build that cannot find its CUDA libraries
        return (f"CuPy cannot be imported ({type(e).__name__}: {e}); install splitkv with the extra of "
                f"your CUDA major version, e.g. pip install 'splitkv[cu13]'")
    try:
        driver = runtime.driverGetVersion()  # 0 when libcuda cannot be loaded: no driver at all
        needed = runtime.runtimeGetVersion()
    except Exception as e:  # noqa: BLE001 - a CuPy without its runtime library
        return f"the CUDA runtime cannot be queried ({type(e).__name__}: {e})"
    if driver == 0:
        return ("no NVIDIA driver is installed or loadable here (libcuda.so.1 not found); splitkv runs its "
                "programs on an NVIDIA GPU (compiling them needs none: splitkv-gen --arch ...)")
    if driver // 1000 < needed // 1000:  # within a major version, an older driver runs a newer runtime
        return (f"the NVIDIA driver supports CUDA up to {_cuda_version(driver)}, older than the CUDA "
                f"{_cuda_version(needed)} runtime CuPy was built for; update the driver, or install the "
                f"extra of the driver's CUDA major version (e.g. splitkv[cu{driver // 1000}])")
    try:
        count = runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - e.g. a driver that is loaded but cannot initialise
        return f"the CUDA driver found no usable device ({type(e).__name__}: {e})"
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"the CUDA driver sees no device{hint}"
    if device is not None and not 0 <= device < count:
        return f"device {device} does not exist: the CUDA driver sees {count} (0..{count - 1})"
    return None


def require_gpu(device: int | None = None) -> None:
    """Raise `GpuUnavailableError` unless ``device`` (None: any device) is usable."""
    reason = unavailable_reason(device)
    if reason is not None:
        raise GpuUnavailableError(f"no usable CUDA GPU: {reason}")


def current_device() -> int:
    """CuPy's current device, for inputs that do not say theirs (``__cuda_array_interface__``);
    `GpuUnavailableError` rather than CuPy's error where there is no usable GPU."""
    runtime = _cuda_runtime()
    try:
        return runtime.getDevice()
    except runtime.CUDARuntimeError:
        require_gpu()  # says what is missing
        raise
