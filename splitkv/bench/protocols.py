"""The three protocols, and the rounds that time every implementation of a shape under each.

* **serving**: the shape's N layers (each its own K/V, N x K/V bytes >= 512 MiB, so that no layer
  finds its K/V in the L2) back to back in one CUDA graph, planned once outside it; per layer, the
  replay time / N, CUDA events around each replay (`splitkv.timing.time_replays`).
* **flush**: layer 0 alone, the L2 flushed by a memset before each call, CUDA events around the
  call, the flush repeated until it outlasts the call's host time, so that host time stays out
  (`splitkv.timing.Harness.time`).
* **eager**: the N layers called one after another from the host, no graph, the sequence repeated
  to at least ``eager_min_calls`` calls; per call, the host clock from an idle GPU to the end of
  the synchronize after the last call, over the number of calls (`splitkv.timing.time_back_to_back`):
  what a caller outside a graph waits per layer, host time and GPU time whichever is longer.

Before any figure, `prepare` checks the implementation twice against the float64 reference, every
layer's output poisoned with NaN first: after eager calls, and after a replay of its captured
graph. A wrong output gets no figure (status 'wrong'); a graph that cannot be captured loses the
serving figure only.

`run_rounds` then times in rounds: each round times every implementation under each protocol,
in `round_order` (ABBA: forward, then reversed, rotating every two rounds), so that drift of the
GPU's clocks or temperature over a run falls on every implementation alike.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field

from ..timing import capture_graph, summarize, time_back_to_back, time_replays
from ..timing.stats import percentile
from .cases import Case, reason
from .inputs import check, poison, relative_error
from .shapes import SERVING_BYTES

PROTOCOLS = ("serving", "flush", "eager")


@dataclass(frozen=True)
class Settings:
    """How much each round times: ``iters`` flushed calls, ``replays`` graph replays,
    ``eager_samples`` back-to-back samples of at least ``eager_min_calls`` calls each; the
    serving layers hold at least ``serving_bytes`` of K/V together."""

    rounds: int = 5
    iters: int = 40
    replays: int = 20
    eager_samples: int = 10
    eager_min_calls: int = 128
    protocols: tuple = PROTOCOLS
    serving_bytes: int = SERVING_BYTES


def round_order(count: int, round_index: int) -> list[int]:
    """The order of ``count`` implementations in round ``round_index``: rotated by one every two
    rounds, reversed in odd rounds. Two implementations run A B, B A, B A, A B...; over 2 x count
    rounds every implementation takes every position twice."""
    if count <= 0:
        return []
    shift = (round_index // 2) % count
    order = list(range(shift, count)) + list(range(shift))
    return order[::-1] if round_index % 2 else order


def positions_balanced(rounds: int, count: int) -> bool:
    """Whether ``rounds`` rounds of `round_order` give each of ``count`` implementations every
    position equally often (any multiple of 2 x count does). Call order moves a short shape's
    figure (a round's outer calls against its inner ones, docs/experiments.md), so an A/B whose
    rounds are not balanced leans on where each tree happened to run."""
    taken = [[0] * count for _ in range(count)]  # [implementation][position]
    for r in range(rounds):
        for position, implementation in enumerate(round_order(count, r)):
            taken[implementation][position] += 1
    return all(len(set(row)) == 1 for row in taken)


def _within(context):
    return context() if context is not None else contextlib.nullcontext()


@dataclass
class Prepared:
    """An implementation checked and ready for the rounds: its case, its graph (None where the
    serving protocol is not run for it) and, per protocol, why it is not timed there."""

    name: str
    case: Case
    graph: object = None
    skipped: dict = field(default_factory=dict)
    samples: dict = field(default_factory=dict)  # protocol -> one list of µs per round
    host_us: list = field(default_factory=list)
    flush_reps: int = 0
    host_bound: bool = False

    def runs(self, protocol: str) -> bool:
        return protocol not in self.skipped


def prepare(name: str, make, layers, harness, settings: Settings, scope=None) -> tuple[dict, Prepared | None]:
    """Make the case (``make(layers)``), run every layer once (compiles and JIT out of the way),
    check it, capture and check its graph; ``scope`` (a context-manager factory: a checkout
    standing in for ``splitkv``) is entered around all that runs the implementation's code.
    Returns (the result entry so far, the Prepared or None when nothing of it can be timed); never
    raises."""
    caught = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with _within(scope):
                case = make(layers)
                with _within(case.context):
                    for call in case.calls:
                        call()
                harness.synchronize()
            entry = {"status": "ok", "info": dict(case.info)}
            refs = None
            if case.outputs is not None:
                refs = case.reference if case.reference is not None else layers.reference()
                poison(case.outputs())
                with _within(scope), _within(case.context):
                    for call in case.calls:
                        call()
                harness.synchronize()
                outs = case.outputs()
                entry["check"] = check(outs, refs, case.tolerance)
                if not entry["check"]["ok"]:
                    entry["status"] = "wrong"
                    return entry, None
                if layers.shape.quantized:
                    entry["check"]["end_to_end_rel_err"] = relative_error(outs[0], layers.end_to_end_reference())
    except Exception as exc:  # noqa: BLE001 - report, never end the run
        return {"status": "n/a", "reason": reason(exc, caught)}, None
    prepared = Prepared(name, case)
    if "serving" in settings.protocols:
        prepared.graph, skip, serving_check = _graph(case, refs, harness, scope)
        if skip:
            prepared.skipped["serving"] = skip
        if serving_check is not None:
            entry["serving_check"] = serving_check
    return entry, prepared


def _graph(case: Case, refs, harness, scope):
    """(graph, why serving is skipped or None, the replay's check or None)."""
    try:
        with _within(scope):
            graph = capture_graph(case.calls, harness.torch, case.context)
        if case.outputs is None:
            return graph, None, None
        poison(case.outputs())  # the tensors the graph writes (allocated in its pool by some peers)
        graph.replay()
        harness.synchronize()
        outs = case.outputs()
        result = check(outs, refs, case.tolerance)
    except Exception as exc:  # noqa: BLE001 - no graph: no serving figure, the rest still runs
        return None, "no CUDA graph: " + reason(exc), None
    if not result["ok"]:
        return None, "wrong output after a graph replay", result
    case.keep = (case.keep, outs)  # later eager calls of an allocating peer must not free them
    return graph, None, result


def measure(prepared: Prepared, protocol: str, harness, settings: Settings) -> list[float]:
    """One round's µs per call of ``prepared`` under ``protocol``."""
    case = prepared.case
    if protocol == "serving":
        return time_replays(prepared.graph, settings.replays, len(case.calls), harness.torch)
    if protocol == "flush":
        times = harness.time(case.calls[0], settings.iters, context=case.context)
        prepared.host_us += harness.last_host_us
        prepared.flush_reps = max(prepared.flush_reps, harness.last_flush_reps)
        prepared.host_bound = prepared.host_bound or harness.host_bound()
        return times
    if protocol == "eager":
        return time_back_to_back(case.calls, settings.eager_samples, settings.eager_min_calls,
                                 harness.synchronize, case.context)
    raise ValueError(f"protocol: expected one of {PROTOCOLS}, got {protocol!r}")


def run_rounds(prepared: list, harness, settings: Settings, measure_fn=measure) -> None:
    """``settings.rounds`` rounds over ``prepared`` in `round_order`, each protocol in turn; the
    samples land in each Prepared's ``samples``. An implementation that fails while being timed
    under a protocol is skipped there from then on, with the reason."""
    for r in range(settings.rounds):
        order = round_order(len(prepared), r)
        for protocol in settings.protocols:
            for index in order:
                p = prepared[index]
                if not p.runs(protocol):
                    continue
                try:
                    times = measure_fn(p, protocol, harness, settings)
                except Exception as exc:  # noqa: BLE001 - one implementation must not end the run
                    p.skipped[protocol] = "while timing: " + reason(exc)
                    p.samples.pop(protocol, None)
                    continue
                p.samples.setdefault(protocol, []).append(list(times))


def summary(prepared: Prepared, protocols) -> dict:
    """Per protocol: the median of every round's samples pooled, p10/p90/min/mean/n, each round's
    median; or {'status': 'n/a', 'reason': ...}."""
    out = {}
    for protocol in protocols:
        rounds = prepared.samples.get(protocol)
        if not prepared.runs(protocol) or not rounds:
            out[protocol] = {"status": "n/a", "reason": prepared.skipped.get(protocol, "not timed")}
            continue
        pooled = [t for samples in rounds for t in samples]
        entry = {"status": "ok", **summarize(pooled), "round_medians": [percentile(s, 50) for s in rounds]}
        if protocol == "flush":
            entry["host_us"] = percentile(prepared.host_us, 50) if prepared.host_us else None
            entry["flush_reps"] = prepared.flush_reps
            if prepared.host_bound:
                entry["host_bound"] = True
        out[protocol] = entry
    return out


def round_spread(round_medians) -> float | None:
    """(max - min) / median of the round medians: how much one implementation's figure moved from
    round to round (None for fewer than two rounds)."""
    values = [v for v in round_medians or [] if v is not None and math.isfinite(v)]
    if len(values) < 2:
        return None
    mid = percentile(values, 50)
    return (max(values) - min(values)) / mid if mid > 0 else None
