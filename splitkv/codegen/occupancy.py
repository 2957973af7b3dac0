"""How many thread-block clusters of a loaded kernel the GPU runs at once.

A cluster's CTAs must be resident together in one GPC, so a grid of clusters can need more waves
than its CTA count suggests: with one CTA per SM, GPCs whose SM count is no multiple of the cluster
size leave SMs idle. The driver answers the question (cuOccupancyMaxActiveClusters); CuPy does
not wrap it, so it is called through ctypes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig (cuda.h); no launch attributes: the cluster shape is compiled into the kernel.
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _driver():
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    library = ctypes.CDLL(name)
    query = library.cuOccupancyMaxActiveClusters
    query.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(_LaunchConfig)]
    query.restype = ctypes.c_int
    return query


def max_active_clusters(function, cluster: int, threads: int, smem_bytes: int) -> int | None:
    """Clusters of ``cluster`` CTAs of ``function`` (a CuPy kernel) resident at once; None when the
    driver cannot say (then callers should not rely on clusters fitting)."""
    try:
        query = _driver()
        config = _LaunchConfig(cluster, 1, 1, threads, 1, 1, smem_bytes, None, None, 0)
        count = ctypes.c_int(0)
        status = query(ctypes.byref(count), ctypes.c_void_p(function.kernel.ptr), ctypes.byref(config))
    except (OSError, AttributeError):
        return None
    return count.value if status == 0 else None
