"""The search space: which KernelSpec fields the tuner chooses, and from what.

A candidate is built by asking for one value per tuned field (``ask(name, choices)``), the way an
Optuna trial suggests parameters, so the same builder serves Optuna (`splitkv.autotune.search`), the
exhaustive enumeration a tuned result is compared with (`enumerate_specs`), and the heuristic's
own choice (`params_of`, enqueued as the first trial). The choices come from the spec's own
vocabulary; a field added to KernelSpec joins the search by a line in `FIELD_CHOICES`. Only the
choices of a parameter may depend on the key (never on other parameters: an Optuna parameter keeps
one distribution per study); which parameters are asked may depend on earlier answers (a split
program's cluster, not a dense one's).

Invalid combinations (too much shared memory, a tensor map on rows it cannot describe, ...) are
refused by KernelSpec itself before anything compiles: `build_spec` raises `Invalid` with
KernelSpec's reason, and the search records it as a pruned trial.

Left out on purpose: ``warp_heads`` (the planner takes it per plan) and the units variant (the
planner routes to it per plan, for ragged batches).
"""

from __future__ import annotations

import functools

from ..arch import arch_number
from ..choices import MMA_M, STAGES, TILE_TOKENS, rows_fit_tma_boxes
from ..spec import KernelSpec, warpgroup_refusal
from ..tuned.keys import TuneKey

#: Tuned fields and their candidate values. ``chunk_tiles`` is the split length in whole CTA
#: tiles (chunk_size = chunk_tiles x warps x tile_tokens), so a chunk is always a whole tile per warp.
FIELD_CHOICES = {
    "variant": ("dense", "split"),
    "warps": (4, 8),
    "tile_tokens": TILE_TOKENS,
    "stages": STAGES,
    "kv_copy": ("cp_async", "tma"),
    "mma_m": MMA_M,
    "chunk_tiles": (1, 2),
    "cluster": (1, 8, 16),
    "fused_merge": (True, False),
}


#: Fields `build_spec` asks for with logic of their own (the chunk in tiles, what only a split
#: program has); every other name of `FIELD_CHOICES` is a KernelSpec field asked for as it is.
_STRUCTURED = ("variant", "warps", "tile_tokens", "stages", "chunk_tiles", "cluster", "fused_merge")


class Invalid(ValueError):
    """A combination of choices that KernelSpec refuses (the reason is KernelSpec's message)."""


def choices(name: str, key: TuneKey, arch: str) -> tuple:
    """The values of tuned field ``name`` for this key and arch: those the key can ever take."""
    values = FIELD_CHOICES[name]
    if name == "kv_copy":
        tma = arch_number(arch) >= 90 and rows_fit_tma_boxes(key.head_dim, key.kv_dtype)
        values = tuple(v for v in values if v != "tma" or tma)
    elif name == "mma_m":
        values = tuple(v for v in values if (v != "tokens" or key.group_size <= 8)
                       and (v != "warpgroup" or _warpgroup_fits(key, arch)))
    elif name == "cluster" and arch_number(arch) < 90:
        values = (1,)
    elif name == "warps":  # the heuristic's own (fewer warps where shared memory is small) stays a point
        values = tuple(sorted(set(values) | _builtin_warps(key, arch)))
    return values


#: Rows (query heads x query tokens) from which warpgroup MMAs are searched: below, most of each
#: warpgroup's 64 rows would be padding (16 rows took 1.6x the time of 16-row warp MMAs on an H200).
WARPGROUP_MIN_ROWS = 32


def _warpgroup_fits(key: TuneKey, arch: str) -> bool:
    """Whether mma_m='warpgroup' can serve the key (`spec.warpgroup_refusal`) and may pay."""
    return (warpgroup_refusal(arch, key.head_dim, key.kv_dtype) is None
            and key.group_size * key.query_tokens >= WARPGROUP_MIN_ROWS)


@functools.lru_cache(maxsize=None)
def _builtin_warps(key: TuneKey, arch: str) -> frozenset:
    from ..heuristics import default_spec

    return frozenset(default_spec(arch, key.head_dim, key.group_size, key.q_dtype, key.kv_dtype, variant,
                                  key.page_size, key.kv_layout, key.query_tokens).warps
                     for variant in ("split", "dense"))


def build_spec(ask, key: TuneKey, arch: str) -> KernelSpec:
    """The candidate the answers of ``ask(name, choices)`` describe (raises `Invalid`)."""
    def pick(name):
        return ask(name, choices(name, key, arch))

    variant = pick("variant")
    warps, tile_tokens, stages = pick("warps"), pick("tile_tokens"), pick("stages")
    fields = dict(variant=variant, warps=warps, tile_tokens=tile_tokens, stages=stages,
                  **{name: pick(name) for name in _plain_fields()},
                  chunk_size=warps * tile_tokens, cluster=1, fused_merge=True)
    if variant == "split":
        fields["chunk_size"] *= pick("chunk_tiles")
        fields["cluster"] = pick("cluster")
        # Clusters merge in place and may run several per row with the fused merge: only a split
        # program without clusters chooses how its partials merge.
        fields["fused_merge"] = pick("fused_merge") if fields["cluster"] == 1 else True
    try:
        return KernelSpec(arch=arch, **key.spec_fields(), **fields)
    except ValueError as e:  # SharedMemoryError is a ValueError too
        raise Invalid(str(e)) from None


def params_of(spec: KernelSpec, key: TuneKey, arch: str) -> dict:
    """The answers that build ``spec`` (to enqueue it as a trial); ValueError when no answers do."""
    params = dict(variant=spec.variant, warps=spec.warps, tile_tokens=spec.tile_tokens, stages=spec.stages,
                  **{name: getattr(spec, name) for name in _plain_fields()})
    if spec.variant == "split":
        params["chunk_tiles"], rest = divmod(spec.chunk_size, spec.warps * spec.tile_tokens)
        params["cluster"] = spec.cluster
        if spec.cluster == 1:
            params["fused_merge"] = spec.fused_merge
        if rest:
            raise ValueError(f"{spec.name}: chunk_size is not a whole number of CTA tiles")
    for name, value in params.items():
        if value not in choices(name, key, arch):
            raise ValueError(f"{spec.name}: {name}={value!r} is outside the search space {choices(name, key, arch)}")

    def replay(name, values):
        return params[name]

    rebuilt = build_spec(replay, key, arch)
    if rebuilt != spec.replace(arch=rebuilt.arch):
        raise ValueError(f"{spec.name}: the search space cannot express it (it builds {rebuilt.name})")
    return params


def _plain_fields() -> list:
    return [name for name in FIELD_CHOICES if name not in _STRUCTURED]


def enumerate_specs(key: TuneKey, arch: str) -> tuple[list[KernelSpec], int]:
    """Every valid candidate of the space (distinct specs, in a fixed order), and how many
    combinations KernelSpec refused."""
    found, refused = {}, 0
    pending = [()]
    while pending:
        path = list(pending.pop())
        depth = 0

        def ask(name, values):
            nonlocal depth
            if depth == len(path):  # a new decision: follow the first value, queue the others
                pending.extend(tuple(path) + (j,) for j in range(len(values) - 1, 0, -1))
                path.append(0)
            value = values[path[depth]]
            depth += 1
            return value

        try:
            spec = build_spec(ask, key, arch)
        except Invalid:
            refused += 1
            continue
        found.setdefault(spec.name, spec)
    return list(found.values()), refused
