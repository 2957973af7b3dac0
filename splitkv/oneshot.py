"""`decode()`: one call that plans and runs, for callers without a step loop of their own.

It keeps a `DecodeAttention` per device, stream and head layout (the last few), and describes its
inputs once per layout seen: a call with inputs laid out as an earlier one costs that instance's
plan() and run() and little more.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from . import arrays, gpu, streams, tensors, variants
from .choices import KV_LAYOUTS
from .launch import read_arrays
from .runtime import DecodeAttention

#: decode()'s instances, most recently used last; each holds compiled programs and a workspace, so
#: only the last few layouts and streams are kept.
_instances: OrderedDict[tuple, DecodeAttention] = OrderedDict()
_MAX_INSTANCES = 16
_instances_lock = threading.Lock()
#: (q, k, v layouts, kv_layout) -> (DecodeShapes, device, q's TensorInfo) of inputs described before.
_described: OrderedDict[tuple, tuple] = OrderedDict()
_MAX_DESCRIBED = 64


def decode(q, k, v, seq_lens=None, *, block_table=None, kv_layout: str = "NHD", validate: bool = True,
           sm_scale: float | None = None, window_left: int = -1, logits_soft_cap: float = 0.0, sinks=None,
           deterministic: bool = False, out=None, return_lse: bool = False, stream=None):
    """Decode attention of ``q`` [B, Hq, D] (or [B, T, Hq, D]: T query tokens per sequence, causal
    among them) over ``k``, ``v`` [B, L_max, Hkv, D] (``kv_layout`` 'HND': [B, Hkv, L_max, D], as
    transformers' caches hold them; either may be a view of a longer cache, read in place).

    ``seq_lens``: per-sequence lengths (host ints or a device int32 array; None = all L_max).
    Paged caches: ``k``, ``v`` ``[num_pages, page_size, Hkv, D]`` (``kv_layout`` 'NHD') or
    ``[num_pages, Hkv, page_size, D]`` ('HND'), ``block_table`` int32 ``[B, max_pages_per_seq]`` (host
    or device) and ``seq_lens`` required; ``validate`` checks the table (see `DecodeAttention.plan`).
    The attention variants (`splitkv.variants` states them): ``window_left`` (-1: no sliding
    window), ``logits_soft_cap`` (0: none), ``sinks`` (a float32 [Hq] device array, or None).
    ``deterministic``: batch-invariant results (see `DecodeAttention.plan`).
    Returns ``out`` of q's shape, dtype and kind (CuPy or torch), and with ``return_lse`` also
    the natural-log log-sum-exp (q's shape without its last axis) in float32. Plans on every call (reading device lengths
    back); for the hot loop of a server use `DecodeAttention` and call ``run`` per layer.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {list(KV_LAYOUTS)}, got {kv_layout!r}")
    return_lse = tensors.check_flag(return_lse, "return_lse")
    deterministic = tensors.check_flag(deterministic, "deterministic")
    paging = block_table is not None
    cache_layout = kv_layout if paging else None
    read = read_arrays(q, k, v, out, None)  # run() takes it too: the arrays are read once per call
    shapes, device, qi = _describe(q, k, v, cache_layout, read[0], kv_layout)
    if paging and seq_lens is None:
        raise ValueError("seq_lens: a paged cache needs the lengths (its pages do not say them)")
    sm_scale = tensors.check_sm_scale(sm_scale)
    attention = variants.plan_variant(shapes.query_tokens, window_left, logits_soft_cap, sinks is not None)
    with streams.on_device(device):
        launch_stream = arrays.stream_ptr(qi, stream)
        if seq_lens is None:
            seq_lens = tensors.check_seq_lens(None, shapes.batch, shapes.max_len)
        elif tensors.is_device_array(seq_lens):
            # Read back here (decode() plans on every call anyway), so that the lengths are checked
            # against this batch and cache like host ones, and the plan keeps its own copy rather
            # than the caller's array. Read on the launch stream: the lengths, like q, k and v,
            # must be ready there.
            with streams.use_stream(launch_stream):
                seq_lens = tensors.read_back_lengths(seq_lens, shapes.batch, qi.device, "q is on")
        seq_lens = tensors.check_seq_lens(seq_lens, shapes.batch, None if paging else shapes.max_len)
        if shapes.batch == 0:  # nothing to attend: the empty results, checked like any others
            return _empty_results(q, k, v, out, return_lse, cache_layout, kv_layout)
        # One instance (so one workspace) per device and stream: kernels that may overlap on the
        # GPU never share partials, counters or lengths; calls on one stream run in order, and
        # the lock keeps each call's plan and run together on the host.
        # The per-thread default stream has one handle in every thread, but is a stream per thread.
        thread = threading.get_ident() if launch_stream == streams.PER_THREAD_DEFAULT else None
        page_size = shapes.page_size if paging else None
        key = (device, launch_stream, thread, shapes.num_qo_heads, shapes.num_kv_heads, shapes.head_dim,
               shapes.q_dtype, shapes.kv_dtype, sm_scale, page_size, kv_layout)
        with _instances_lock:
            attn = _instances.get(key)
            if attn is None:
                attn = DecodeAttention(shapes.num_qo_heads, shapes.num_kv_heads, shapes.head_dim,
                                       q_dtype=shapes.q_dtype, kv_dtype=shapes.kv_dtype, sm_scale=sm_scale,
                                       device=device, page_size=page_size, kv_layout=key[-1])
                _instances[key] = attn
                while len(_instances) > _MAX_INSTANCES:
                    # Its kernels may still run: its workspace goes back to CuPy's pool, which hands
                    # a block out again only to work on the same stream (plan and run share it
                    # here), so after those kernels.
                    _instances.popitem(last=False)
            _instances.move_to_end(key)
            attn._plan_checked(seq_lens, block_table=block_table, validate=validate, stream=launch_stream,
                               attention=attention, deterministic=deterministic)
            if out is not None and not return_lse:
                return attn._run_read(q, k, v, out, launch_stream, read, sinks)
            return attn.run(q, k, v, out=out, return_lse=return_lse, sinks=sinks, stream=launch_stream)


def _describe(q, k, v, cache_layout: str | None, layout: tuple | None, kv_layout: str = "NHD") -> tuple:
    """(DecodeShapes, device, q's TensorInfo) of the inputs, checked together; kept per layout of
    CuPy and torch inputs (arrays known only by an interface are described on every call).
    ``layout``: `read_arrays`' of (q, k, v, out, None), or None where one is of another kind;
    ``cache_layout``: a paged cache's layout (None: contiguous caches of ``kv_layout``)."""
    if layout is None:  # out may be the one of another kind
        layout = read_arrays(q, k, v, None, None)[0]
    key = None if layout is None else (layout[:3], cache_layout, kv_layout)
    held = _described.get(key) if key is not None else None
    if held is not None:
        return held
    qi, ki, vi = _infos(q, k, v, cache_layout)
    shapes = tensors.check_decode_inputs(qi, ki, vi, kv_layout=cache_layout, contiguous_layout=kv_layout)
    held = (shapes, qi.device if qi.device is not None else gpu.current_device(), qi)
    if key is not None:
        with _instances_lock:
            _described[key] = held
            while len(_described) > _MAX_DESCRIBED:
                _described.popitem(last=False)
    return held


def _infos(q, k, v, cache_layout: str | None) -> tuple:
    """q's, k's and v's TensorInfo (a paged cache's in ``cache_layout``)."""
    return (tensors.describe(q, "q", bf16_from_uint16=True), tensors.describe_kv(k, "k", cache_layout or "NHD"),
            tensors.describe_kv(v, "v", cache_layout or "NHD"))


def _empty_results(q, k, v, out, return_lse, cache_layout, kv_layout="NHD"):
    """decode() of an empty batch: out (given or new) and lse of batch 0, validated as usual."""
    if out is None:
        out = arrays.new_output(q)
    qi, ki, vi = _infos(q, k, v, cache_layout)
    tensors.check_decode_inputs(qi, ki, vi, out=tensors.describe(out, "out", bf16_from_uint16=True),
                                kv_layout=cache_layout, contiguous_layout=kv_layout)
    return (out, arrays.new_output(q, lse=True)) if return_lse else out
