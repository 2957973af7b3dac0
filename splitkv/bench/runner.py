"""One shape, every implementation, three protocols: the inputs, the checks, the rounds, the
figures. `implementations` lists what a run times; `bench_shape` times them on one shape.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

from ..timing import gbps
from .cases import floor_case, reason, splitkv_case
from .inputs import Layers
from .overrides import builtin_spec, spec_for_shape, spec_label
from .peers import PEER_NAMES, PEER_SETUPS
from .protocols import Settings, positions_balanced, prepare, run_rounds, summary
from .shapes import Shape, serving_layers


@dataclass(frozen=True)
class Implementation:
    """What a run times: ``make(layers)`` gives its `cases.Case`; ``scope`` (a context-manager
    factory) is entered while it sets up (a checkout standing in for ``splitkv``); ``record`` is
    what the result keeps of it (its kind, display name, and the commit of a splitkv tree)."""

    name: str
    make: object
    record: dict
    scope: object = None


def implementations(splitkv_package, floor, peers: list, overrides: list, arch: str, commit: str,
                    checkouts: list = ()) -> list:
    """splitkv of this tree, each ``--specs`` override of it, each checkout (name, Checkout), the
    peers and the read floor, in that order (round 0's)."""
    out = [Implementation("splitkv", lambda layers: splitkv_case(splitkv_package, layers),
                          {"kind": "splitkv", "label": "splitkv", "tree": "this", "commit": commit})]
    for o in overrides:
        label = spec_label(o)
        out.append(Implementation(f"splitkv[{label}]", _override_maker(splitkv_package, o, arch),
                                  {"kind": "splitkv", "label": f"spec {label}", "tree": "this", "commit": commit,
                                   "overrides": label}))
    for name, checkout in checkouts:
        out.append(Implementation(name, _checkout_maker(checkout),
                                  {"kind": "splitkv", "label": f"{name} {checkout.commit}", "tree": "checkout",
                                   **checkout.describe()}, scope=checkout.active))
    for name in peers:
        out.append(Implementation(name, PEER_SETUPS[name], {"kind": "peer", "label": PEER_NAMES[name]}))
    out.append(Implementation("floor", lambda layers: floor_case(floor, layers),
                              {"kind": "floor", "label": "read floor"}))
    return out


def _override_maker(package, overrides: dict, arch: str):
    def make(layers):
        spec = spec_for_shape(overrides, layers.shape, arch, builtin_spec(layers.shape, arch))
        return splitkv_case(package, layers, spec, overrides.get("variant"))
    return make


def _checkout_maker(checkout):
    def make(layers):
        return splitkv_case(checkout.module, layers)
    return make


def derived(entry: dict, shape: Shape, floors: dict, copy_gbps: float | None) -> None:
    """GB/s, % of the copy bandwidth and x the read floor of the same protocol, in place."""
    for protocol, figures in (entry.get("protocols") or {}).items():
        if figures.get("status") != "ok":
            continue
        rate = gbps(shape.total_bytes, figures["median_us"])
        figures["gbps"] = rate
        figures["pct_copy_bw"] = 100.0 * rate / copy_gbps if copy_gbps else None
        floor = floors.get(protocol)
        figures["x_floor"] = figures["median_us"] / floor if floor else None


def bench_shape(shape: Shape, impls: list, harness, settings: Settings, seed: int,
                copy_gbps: float | None = None) -> dict:
    """Every implementation of ``impls`` on ``shape``: prepared (checked) one after another, then
    timed in ``settings.rounds`` ABBA rounds; the shape's result entry."""
    torch = harness.torch
    needs_layers = {"serving", "eager"} & set(settings.protocols)
    count = serving_layers(shape, settings.serving_bytes) if needs_layers else 1
    entry = {"shape": shape.to_dict(), "label": shape.label, "token": shape.token, "bytes": shape.bytes_dict(),
             "layers": count, "implementations": {}}
    try:
        layers = Layers(shape, count, seed, torch)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory making the inputs
        entry["error"] = "making the inputs: " + reason(exc)
        free_memory(torch)
        return entry
    prepared = []
    for impl in impls:
        result, ready = prepare(impl.name, impl.make, layers, harness, settings, impl.scope)
        entry["implementations"][impl.name] = result
        if ready is not None:
            prepared.append(ready)
    run_rounds(prepared, harness, settings)
    entry["order"] = [p.name for p in prepared]  # round 0's; `protocols.round_order` gives the rest
    entry["positions_balanced"] = positions_balanced(settings.rounds, len(prepared))
    for p in prepared:
        entry["implementations"][p.name]["protocols"] = summary(p, settings.protocols)
    floor = entry["implementations"].get("floor", {}).get("protocols", {})
    floors = {k: v["median_us"] for k, v in floor.items() if v.get("status") == "ok"}
    for name, result in entry["implementations"].items():
        derived(result, shape, floors if name != "floor" else {}, copy_gbps)
    del layers, prepared
    free_memory(torch)
    return entry


def free_memory(torch_mod):
    import cupy

    gc.collect()
    if torch_mod is not None:
        torch_mod.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
