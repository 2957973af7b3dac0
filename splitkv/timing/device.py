"""What a figure was measured on: the GPU's name, SM count, arch, L2 and the CUDA versions.

Recorded with every benchmark result and checked by the tuner before it measures (a table of one
arch is not tuned on a GPU of another).
"""

from __future__ import annotations

import subprocess


def version_text(v: int) -> str:
    """CUDA's integer versions: 12080 -> '12.8'."""
    return f"{v // 1000}.{(v % 1000) // 10}" if v else "?"


def gpu_info() -> dict:
    """The current CuPy device: name, sm_count, arch ('sm_90'), l2_bytes, memory_bytes, the
    driver's and the runtime's CUDA versions, the driver and NVRTC versions (None when unknown).
    Raises when no CUDA device is usable."""
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    attrs = dev.attributes
    info = {
        "name": name,
        "sm_count": int(attrs["MultiProcessorCount"]),
        "arch": "sm_" + dev.compute_capability,
        "l2_bytes": int(attrs.get("L2CacheSize", 0)),
        "memory_bytes": int(props.get("totalGlobalMem", 0)),
        "driver_cuda_version": version_text(cupy.cuda.runtime.driverGetVersion()),
        "cuda_runtime_version": version_text(cupy.cuda.runtime.runtimeGetVersion()),
        "driver_version": None,
        "nvrtc_version": None,
    }
    try:
        major, minor = cupy.cuda.nvrtc.getVersion()
        info["nvrtc_version"] = f"{major}.{minor}"
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                              f"--id={dev.id}"], capture_output=True, text=True, timeout=20)
        if smi.returncode == 0 and smi.stdout.strip():
            info["driver_version"] = smi.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info
