"""`merge_states`: the exact merge of attention states over disjoint token ranges, the step that
cascade and shared-prefix attention take (a prefix's state with each sequence's own), run by the
merge program that merges the split programs' partials (templates/merge/program.cuh).

A state is a range's normalised output ``o`` and its natural-log log-sum-exp ``lse`` (what
`DecodeAttention.run(..., return_lse=True)` returns). Over the union of the ranges,

    o = sum_i e^(lse_i - m) o_i / (sum_i e^(lse_i - m) + e^(sink - m)),  lse = m + ln sum_i e^(lse_i - m),

with m the largest lse_i; the optional sinks (a float32 logit per head) join the denominator of
o only, once, so lse stays the tokens' own. A row whose every state is empty (lse -inf) merges to
zeros and -inf; a NaN in any state makes its row NaN.
"""

from __future__ import annotations

import math

from . import arrays, gpu, streams, tensors
from .choices import HEAD_DIMS
from .params import MERGE
from .spec import MergeSpec

_LOG2E = 1.4426950408889634
#: The merge program's CTA: a warp per merged row.
_THREADS = 128


def merge_states(o_a, lse_a, o_b, lse_b, *, sinks=None, stream=None):
    """The merge of two states of the same rows: ``o_a``, ``o_b`` ``[N, H, D]`` (bf16 or fp16, CuPy
    or torch), ``lse_a``, ``lse_b`` float32 ``[N, H]``; returns ``(o, lse)`` of those shapes, o in
    the states' dtype and kind. ``sinks``: float32 ``[H]`` or None."""
    info = tensors.describe(o_a, "o_a", bf16_from_uint16=True)
    device = info.device if info.device is not None else gpu.current_device()
    with streams.on_device(device):
        ptr = arrays.stream_ptr(o_a, stream)  # o_a's framework's current stream, or stream=
        with streams.use_stream(ptr):
            states = _stack([o_a, o_b], "o_a/o_b")  # [N, 2, H, D]
            lses = _stack([lse_a, lse_b], "lse_a/lse_b")
        out, lse = merge_state_list(states, lses, sinks=sinks, stream=ptr)
    return _like(o_a, out), _like(lse_a, lse)


def merge_state_list(states, lses, *, sinks=None, stream=None):
    """The merge of S states of each row: ``states`` ``[N, S, H, D]`` (bf16 or fp16), ``lses``
    float32 ``[N, S, H]``; returns ``(o [N, H, D], lse [N, H])`` as CuPy arrays (o in the states'
    dtype, bf16 as uint16)."""
    import cupy

    info = tensors.describe(states, "states", bf16_from_uint16=True)
    lse_info = tensors.describe(lses, "lses")
    check_states(info, lse_info, None if sinks is None else tensors.describe(sinks, "sinks"))
    batch, count, heads, head_dim = info.shape
    device = info.device if info.device is not None else gpu.current_device()
    with streams.on_device(device):
        ptr = arrays.stream_ptr(states, stream)
        with streams.use_stream(ptr):
            x = arrays.to_cupy(states)
            if info.dtype == "bf16":  # bf16 bits to float32: the high half of the word
                partial_o = (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
            else:
                partial_o = x.astype(cupy.float32)
            partial_lse = arrays.to_cupy(lses).astype(cupy.float32) * cupy.float32(_LOG2E)
            out = cupy.empty((batch, heads, head_dim), dtype=x.dtype)
            lse = cupy.empty((batch, heads), dtype=cupy.float32)
            counts = cupy.full((batch,), count, dtype=cupy.int32)
            sinks_ptr = 0
            if sinks is not None:
                sinks_ptr = arrays.to_cupy(sinks).data.ptr
            _launch_merge(info.dtype, head_dim, partial_o, partial_lse, out, lse, counts, sinks_ptr, batch, count,
                          heads, ptr, device)
    return out, lse


def check_states(info, lse_info, sinks_info) -> None:
    """The states' layouts (TensorInfo): ValueError / TypeError naming the argument."""
    if info.ndim != 4:
        raise ValueError(f"states: expected [N, S, H, D], got shape {info.shape}")
    batch, count, heads, head_dim = info.shape
    if info.dtype not in ("bf16", "fp16"):
        raise TypeError(f"states: expected bf16 or fp16 outputs, got {info.dtype}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"states: head_dim {head_dim} is not one of {list(HEAD_DIMS)}")
    if count < 1:
        raise ValueError(f"states: expected at least one state per row, got shape {info.shape}")
    if lse_info.shape != (batch, count, heads) or lse_info.dtype != "fp32":
        raise ValueError(f"lses: expected float32 {(batch, count, heads)} [N, S, H], got {lse_info.dtype} {lse_info.shape}")
    if sinks_info is not None and (sinks_info.shape != (heads,) or sinks_info.dtype != "fp32"
                                   or not sinks_info.is_contiguous):
        raise ValueError(f"sinks: expected a contiguous float32 [{heads}] array, got {sinks_info.dtype} {sinks_info.shape}")
    if batch * heads > 2**31 - 1:
        raise ValueError(f"states: {batch} x {heads} rows exceed the merge program's int32 rows")


def _launch_merge(dtype, head_dim, partial_o, partial_lse, out, lse, counts, sinks_ptr, batch, count, heads,
                  stream, device) -> None:
    """The merge program over fp32 partials [N][S][H][D] (base-2 lse [N][S][H]): each row's S
    'splits' are its states (S tokens of one token per split), out rows n H + h."""
    import cupy
    import numpy as np

    from .codegen.load import load_kernel
    from .launch import launch_kernel

    arch = "sm_" + cupy.cuda.Device(device).compute_capability
    function, _ = load_kernel(MergeSpec(arch=arch, head_dim=head_dim, out_dtype=dtype, threads=_THREADS))
    struct = MERGE.new()
    fields = dict(partial_o=partial_o.data.ptr, partial_lse=partial_lse.data.ptr, out=out.data.ptr, lse=lse.data.ptr,
                  seq_lens=counts.data.ptr, units=0, sinks=sinks_ptr, batch=batch, num_qo_heads=heads,
                  num_splits=count, tokens_per_split=1, max_len=count, group=heads, max_units=0, query_tokens=1,
                  row_blocks=1, cta_rows=heads, rows_per_slot=heads, window_left=-1, window_align=1, empty_states=1)
    for name, value in fields.items():
        struct[name] = value
    argument = np.array([struct.ctypes.data], np.uint64)
    blocks = math.ceil(batch * heads / (_THREADS // 32))
    # The driver copies the struct when the launch is made; the buffers go back to the pool of the
    # stream they were allocated on, which hands them out again only after this kernel.
    launch_kernel((function.kernel.ptr, blocks, 1, 1, _THREADS, 1, 1, 0), stream, argument.ctypes.data)


def _stack(parts, name):
    import cupy

    cupy_parts = [arrays.to_cupy(p) for p in parts]
    try:
        return cupy.stack(cupy_parts, axis=1)
    except ValueError as exc:
        raise ValueError(f"{name}: the two states must have one shape: {exc}") from None


def _like(reference, result):
    """``result`` (CuPy) as the kind of ``reference``: torch for torch (bf16 from its uint16 carrier)."""
    if arrays._is_torch(reference):
        import torch

        tensor = torch.from_dlpack(result)
        return tensor.view(reference.dtype) if tensor.dtype != reference.dtype else tensor
    return result
