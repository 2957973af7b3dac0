"""The programs one DecodeAttention keeps between plans.

A plan() names its programs as `KernelSpec` objects; building, validating or hashing a spec costs
tens of µs, and loading one costs a lookup in the loader's cache (which hashes every field). So an
instance keeps, per spec object, what it loaded, and derives each related program (the dense one
with a warp per K/V head, the units one, one with a plan's attention variant compiled in) once,
while its source stays: later plans get the same objects back, and each lookup here is an identity
check.
"""

from __future__ import annotations

import dataclasses

from . import streams, variants
from .heuristics import few_splits_max_bytes, resident_ctas_per_sm, saturating_ctas
from .spec import KernelSpec, SharedMemoryError

#: Loaded programs a cache keeps before starting afresh (an instance drops the specs of tuned
#: entries it no longer plans with).
MAX_LOADED = 32


@dataclasses.dataclass
class SplitProgram:
    """What the planner asks of one split program, kept while that program stays."""

    spec: KernelSpec
    ctas_per_sm: int  # resident CTAs per SM (its registers bound them)
    saturating: int | None  # `heuristics.saturating_ctas`
    few_splits_max_bytes: int  # `heuristics.few_splits_max_bytes`
    clustered: dict = dataclasses.field(default_factory=dict)  # cluster size -> the program in such clusters
    cluster_fit: dict = dataclasses.field(default_factory=dict)  # cluster size -> clusters resident at once

    def in_clusters(self, cluster: int) -> KernelSpec:
        """The split program with ``cluster`` CTAs per thread-block cluster."""
        spec = self.clustered.get(cluster)
        if spec is None:
            spec = self.clustered[cluster] = self.spec.replace(cluster=cluster)
        return spec


class ProgramCache:
    """Programs loaded on one device, and the specs derived from others (see the module notes)."""

    def __init__(self, device: int):
        self.device = device
        self.split: SplitProgram | None = None  # the last plan's split program
        self._derived: dict[str, tuple] = {}  # name -> (source, derived), see kept
        self._variants: dict[str, tuple] = {}  # name -> (source, variant, derived), see with_variant
        self._loaded: dict[int, tuple] = {}  # id(spec) -> (spec, function, compile result), see load

    def load(self, spec) -> tuple:
        """`load_kernel(spec)` on this cache's device, whichever is current: (function, compile
        result), kept per spec object."""
        held = self._loaded.get(id(spec))
        if held is None or held[0] is not spec:  # the id of a spec since dropped may be reused
            from .codegen.load import load_kernel

            if len(self._loaded) >= MAX_LOADED:
                self._loaded.clear()
            with streams.on_device(self.device):  # a module is loaded into the current device's context
                held = self._loaded[id(spec)] = (spec, *load_kernel(spec))
        return held[1:]

    def kept(self, name: str, source: KernelSpec, derive) -> KernelSpec:
        """``derive(source)``, kept under ``name`` while ``source`` stays."""
        held = self._derived.get(name)
        if held is None or not same_spec(held[0], source):
            held = self._derived[name] = (source, derive(source))
        return held[1]

    def with_variant(self, name: str, source: KernelSpec, attention: variants.AttentionVariant) -> KernelSpec:
        """``source`` with ``attention``'s variant compiled in (``source`` itself where it has it),
        kept under ``name`` while the source and the variant stay."""
        if source.compiled_variant == attention.compiled:
            return source
        held = self._variants.get(name)
        if held is None or held[1] != attention.compiled or not same_spec(held[0], source):
            try:
                derived = attention.of(source)
            except SharedMemoryError as e:  # a shape of several tokens' row slices, asked for fewer
                raise ValueError(f"query_tokens: {source.name} serves {source.query_tokens} query token(s) per "
                                 f"sequence; with {attention.query_tokens} its rings need more shared memory "
                                 f"than the GPU has ({e})") from e
            held = self._variants[name] = (source, attention.compiled, derived)
        return held[2]

    def split_program(self, spec: KernelSpec) -> SplitProgram:
        """The split program ``spec``'s resident CTAs per SM, saturating CTAs and derived programs,
        loading it (kept while that program stays)."""
        held = self.split
        if held is None or not same_spec(held.spec, spec):
            _, compiled = self.load(spec)
            held = self.split = SplitProgram(spec, resident_ctas_per_sm(spec, compiled.registers),
                                             saturating_ctas(spec), few_splits_max_bytes(spec))
        return held

    def max_active_clusters(self, cluster: int, spec: KernelSpec) -> int | None:
        """Clusters of ``cluster`` CTAs of the last plan's split program (``spec`` before any plan)
        resident at once on this device (None: unknown)."""
        program = self.split or self.split_program(spec)
        if cluster not in program.cluster_fit:
            from .codegen.occupancy import max_active_clusters

            clustered = program.in_clusters(cluster)
            function, _ = self.load(clustered)
            with streams.on_device(self.device):  # the query runs in the function's context
                program.cluster_fit[cluster] = max_active_clusters(function, cluster, clustered.threads,
                                                                   clustered.smem_bytes)
        return program.cluster_fit[cluster]


def same_spec(held, spec) -> bool:
    """Whether what was derived from spec ``held`` serves ``spec``: the same object, or an equal one
    (comparing two specs field by field costs about a µs, so identity is tried first)."""
    return held is spec or held == spec
