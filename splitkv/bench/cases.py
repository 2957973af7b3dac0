"""Implementations made ready to time: a `Case` per implementation and shape.

A case launches one layer's decode per call (``calls[i]`` reads layer i's q, K and V and writes
that layer's output), on the current stream, with everything that can be done once (plans,
layouts, scheduler metadata, compiles) done when it is made. The protocols only call it: the
serving protocol captures every call in one CUDA graph, the flush protocol times ``calls[0]``
after an L2 flush, the eager protocol issues the calls back to back from the host.

`splitkv_case` serves both this tree and another checkout (`checkout.Checkout`): it is handed the
package to call. The peers are in `peers`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .checkout import adopt_cache
from .inputs import TOLERANCE, Layers


class Unavailable(RuntimeError):
    """An implementation that cannot run this shape; its message is already the whole reason."""


def reason(exc: BaseException, caught=()) -> str:
    """One line: the exception, plus what the library warned about while failing (torch's SDPA
    explains why a backend was refused only in warnings)."""
    text = str(exc) if isinstance(exc, Unavailable) else f"{type(exc).__name__}: {exc}".strip()
    extra = []
    for w in caught:
        msg = " ".join(str(w.message).split())
        if msg and msg not in extra:
            extra.append(msg)
    if extra:
        text += " [" + "; ".join(extra[:3]) + "]"
    return " ".join(text.split())[:400]


@dataclass
class Case:
    """One implementation on one shape's layers.

    ``calls``: one no-argument launch per layer. ``outputs()``: each layer's output as the last
    calls left it (None for the read floor, which has none). ``context``: a context-manager factory
    entered around any call (SDPA's backend choice). ``reference``: the float64 outputs to check
    against when the case reads other values than the layers' (None: the layers' own).
    """

    calls: list
    outputs: object = None
    context: object = None
    reference: list | None = None
    tolerance: float = TOLERANCE
    info: dict = dataclasses.field(default_factory=dict)
    keep: object = None  # buffers the launches read that nothing else holds


def splitkv_case(package, layers: Layers, spec=None, variant: str | None = None, tuned: bool = True) -> Case:
    """splitkv as an engine calls it: ``package.DecodeAttention`` planned once for the shape, then
    ``run(q, k, v, out=out)`` per layer into outputs allocated once. Without ``spec``, the programs
    come from the package's tuned table for this GPU (``tuned=False``: its built-in heuristic's);
    ``variant`` (from a --specs override) is handed to plan(), since the planner, not the spec,
    decides between dense and split."""
    torch = layers.torch
    s = layers.shape
    attn = package.DecodeAttention(s.num_qo_heads, s.num_kv_heads, s.head_dim, q_dtype="bf16",
                                   kv_dtype=s.kv_dtype, spec=spec, tuned=tuned)
    plan_kw = {} if variant is None else {"variant": variant}
    if s.has_variant:
        plan_kw.update(query_tokens=s.query_tokens, window_left=s.window_left, logits_soft_cap=s.soft_cap,
                       sinks=s.sinks)
    if s.deterministic:
        plan_kw["deterministic"] = True
    attn.plan([s.seq_len] * s.batch, s.seq_len, **plan_kw)
    ks = [adopt_cache(package, k) for k in layers.k]
    vs = [adopt_cache(package, v) for v in layers.v]
    outs = [torch.empty_like(q) for q in layers.q]

    def launcher(q, k, v, out, sinks):
        if sinks is None:  # another checkout's run() may predate the argument
            def call():
                attn.run(q, k, v, out=out)
        else:
            def call():
                attn.run(q, k, v, out=out, sinks=sinks)
        return call

    sinks = layers.sinks or [None] * layers.count
    calls = [launcher(*args) for args in zip(layers.q, ks, vs, outs, sinks)]
    info = {"plan_info": str(getattr(attn, "plan_info", ""))}
    if spec is not None:
        info["spec_name"] = spec.name
    entry = getattr(attn, "tuned_entry", None)
    if entry is not None:
        info["tuned_bucket"] = entry.bucket.name
    return Case(calls, lambda: outs, info=info, keep=(attn, ks, vs))


def floor_case(floor, layers: Layers) -> Case:
    """The read floor (`splitkv.timing.ReadFloor`): per layer, one read of as many bytes as the
    shape moves, each layer from bytes of its own. Nothing to check."""
    nbytes = layers.shape.total_bytes
    stride = -(-nbytes // 16) * 16
    return Case([floor.reader(nbytes, i * stride) for i in range(layers.count)], None,
                info={"bytes": nbytes})


def floor_capacity(shape, layers: int) -> int:
    """Bytes the read floor's buffer needs for `floor_case` on ``layers`` layers of ``shape``."""
    return layers * -(-shape.total_bytes // 16) * 16
