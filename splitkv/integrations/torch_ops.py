"""`DecodeAttention.run()` and `splitkv.decode()` as torch.library custom ops, with fake (meta)
implementations, so that ``torch.compile(model, fullgraph=True)`` traces through them and its
CUDA-graph mode captures them.

    import splitkv.integrations.torch_ops as ops

    attn = splitkv.DecodeAttention(32, 8, 128)
    attn.plan(seq_lens_device, max_len=L_max)          # outside the compiled region, once per step
    handle, plan = ops.handle(attn), ops.plan_tensor(attn)
    out = torch.ops.splitkv.run(q, k, v, plan, handle)   # inside it: no sync, no compile

The plan crosses into the op as a tensor (the plan's device lengths, as FA3's scheduler metadata
does): the compiled graph reads it, so the graph is ordered after the plan's writes. The instance
itself is named by an int handle (`handle`), which a graph holds as a constant. As for run()
itself, a CUDA graph captured over the op replays the plan it was captured with: after plan(),
capture again (device lengths rewritten in place within the plan's max_len reach replays).

``torch.ops.splitkv.decode`` plans on every call (reading device lengths back), like
`splitkv.decode`: it traces, but a CUDA graph cannot capture its plan; use ``run`` there.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

import splitkv

_lock = threading.Lock()
_instances: dict[int, weakref.ref] = {}  # handle -> the DecodeAttention
_handles: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # DecodeAttention -> handle


def handle(attn: "splitkv.DecodeAttention") -> int:
    """The int that names ``attn`` to the ops (the same one on every call for one instance)."""
    if not isinstance(attn, splitkv.DecodeAttention):
        raise TypeError(f"attn: expected a splitkv.DecodeAttention, got {type(attn).__name__}")
    with _lock:
        found = _handles.get(attn)
        if found is None:
            found = _handles[attn] = len(_instances) + 1
            _instances[found] = weakref.ref(attn)
        return found


def plan_tensor(attn: "splitkv.DecodeAttention") -> torch.Tensor:
    """The instance's current plan as a tensor: its device lengths (int32 [batch]), shared with the
    plan, no copy."""
    launch = attn._launch
    if launch is None:
        raise RuntimeError("plan_tensor() before plan(): call attn.plan(seq_lens) first")
    return torch.from_dlpack(launch.seq_lens)


def _instance(handle_: int) -> "splitkv.DecodeAttention":
    ref = _instances.get(handle_)
    attn = ref() if ref is not None else None
    if attn is None:
        raise ValueError(f"handle: {handle_} names no live DecodeAttention (see splitkv.integrations.torch_ops.handle)")
    return attn


@torch.library.custom_op("splitkv::run", mutates_args=())
def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: torch.Tensor, handle: int,
        sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``DecodeAttention.run(q, k, v, sinks=sinks)`` of the instance ``handle`` names, under the plan
    ``plan`` (`plan_tensor`); the output in a new tensor of q's shape."""
    attn = _instance(handle)
    if attn._launch is None:
        raise RuntimeError("plan: this DecodeAttention has no plan yet; call attn.plan(seq_lens) outside the graph")
    out = torch.empty_like(q)
    attn.run(q, k, v, out=out, sinks=sinks)
    return out


@run.register_fake
def _run_fake(q, k, v, plan, handle, sinks=None):
    return torch.empty_like(q)


@torch.library.custom_op("splitkv::decode", mutates_args=())
def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, kv_layout: str = "NHD",
           window_left: int = -1, logits_soft_cap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`splitkv.decode` (plans on every call: not for CUDA graphs)."""
    return splitkv.decode(q, k, v, seq_lens, kv_layout=kv_layout, window_left=window_left,
                          logits_soft_cap=logits_soft_cap, sinks=sinks)


@decode.register_fake
def _decode_fake(q, k, v, seq_lens, kv_layout="NHD", window_left=-1, logits_soft_cap=0.0, sinks=None):
    return torch.empty_like(q)
