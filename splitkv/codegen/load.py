"""Load compiled programs onto the current GPU (the only part of codegen that needs one)."""

from __future__ import annotations

import dataclasses
import threading

from .compile import CompileResult, compile_cubin
from .render import kernel_name

#: Above this a kernel must opt in to more dynamic shared memory.
_DEFAULT_SMEM_LIMIT = 48 * 1024
#: Clusters larger than this need the kernel's opt-in (CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED).
_PORTABLE_CLUSTER = 8
_NON_PORTABLE_CLUSTER_ATTRIBUTE = 14
_NUM_REGS_ATTRIBUTE = 4  # CU_FUNC_ATTRIBUTE_NUM_REGS

_loaded: dict[tuple, tuple] = {}
_lock = threading.Lock()


def load_kernel(spec: AnySpec, *, source: str | None = None,
                headers: dict[str, str] | None = None):
    """(CuPy kernel function, CompileResult) for ``spec`` on the current device, cached per device.

    ``source``, ``headers``: a patched program, or other helper headers, to compile in place of the
    package's (see `compile_cubin`).
    """
    module, function, result = load_module(spec, source=source, headers=headers)
    return function, result


def load_module(spec: AnySpec, *, source: str | None = None,
                headers: dict[str, str] | None = None):
    """(CuPy module, its kernel function, CompileResult): `load_kernel`, with the module for tools
    that read the program's globals."""
    import cupy

    device = cupy.cuda.Device().id
    key = (spec, device, source, None if headers is None else tuple(sorted(headers.items())))
    with _lock:
        if key in _loaded:
            return _loaded[key]
    result: CompileResult = compile_cubin(spec, source=source, headers=headers)
    module = cupy.RawModule(path=str(result.cubin_path))
    function = module.get_function(kernel_name(spec))
    if result.registers is None:  # no ptxas report (a cubin cached without one): the driver knows
        result = dataclasses.replace(result, registers=function_registers(function))
    smem = getattr(spec, "smem_bytes", 0)
    # The 48 KB a CTA gets without opting in counts static and dynamic shared memory together.
    if smem + getattr(spec, "static_smem_bytes", 0) > _DEFAULT_SMEM_LIMIT:
        function.max_dynamic_shared_size_bytes = smem
    allow_cluster_size(function, getattr(spec, "cluster", 1))
    with _lock:
        _loaded[key] = (module, function, result)
    return module, function, result


def allow_cluster_size(function, cluster: int) -> None:
    """Let ``function`` (a CuPy kernel) launch in clusters of ``cluster`` CTAs: sizes above the
    portable 8 need the kernel's opt-in."""
    if cluster > _PORTABLE_CLUSTER:
        from cupy_backends.cuda.api import driver

        driver.funcSetAttribute(function.kernel.ptr, _NON_PORTABLE_CLUSTER_ATTRIBUTE, 1)


def function_registers(function) -> int:
    """Registers per thread of ``function`` (a CuPy kernel), as the driver loaded it."""
    from cupy_backends.cuda.api import driver

    return int(driver.funcGetAttribute(_NUM_REGS_ATTRIBUTE, function.kernel.ptr))
