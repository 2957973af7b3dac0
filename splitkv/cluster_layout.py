"""How this GPU's SMs group for thread-block clusters: a record for the benchmark.

A cluster's CTAs run together on one GPC, so where clusters can go depends on how many SMs each
GPC of the particular chip kept, and H200s differ there (dies are floor-swept). Two views:

* `sm_groups`: the groups of SMs that clusters were seen to share. A probe launches clusters of
  2 to 16 CTAs, one CTA per SM, and records each CTA's SM; SMs met in one cluster are joined. The
  groups are the GPCs as clusters see them (SMs that only ever host clusters of two stay in pairs).
* `resident_clusters`: per cluster size, how many clusters of that many CTAs, one CTA per SM (as
  the decode programs of head_dim 128 run), the driver says are resident at once: the occupancy
  query the planner makes for its own programs.

The benchmark stores both with its results, so that runs on different H200s can be told apart.
`cluster_sms`, `join_groups` and `describe` are pure and need no GPU; `probe` launches on the
current CuPy device.
"""

from __future__ import annotations

#: Cluster sizes the probe launches (above 8 the kernel opts in to non-portable sizes).
PROBE_SIZES = tuple(range(2, 17))
#: Launches per size: which GPCs the clusters of one launch take varies between launches.
PROBE_LAUNCHES = 4
#: Threads per probe CTA (the decode programs' four warps).
PROBE_THREADS = 128

_PROBE_SOURCE = r"""
// Each CTA records the SM it runs on, then holds it for a while so that the launch's clusters
// are resident together and spread over the GPU instead of reusing the first free SMs.
extern "C" __global__ void __cluster_dims__(CLUSTER_SIZE, 1, 1) splitkv_cluster_probe(int* sm_of_cta) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    if (threadIdx.x == 0) sm_of_cta[blockIdx.x] = (int)sm;
    const long long start = clock64();
    while (clock64() - start < 200000) {
    }
}
"""


def cluster_sms(sm_of_cta, size: int) -> list:
    """The SMs each cluster of a probe launch ran on: ``sm_of_cta`` (one SM id per CTA, in
    launch order, whose consecutive runs of ``size`` CTAs are the clusters) cut into clusters."""
    if size < 1 or len(sm_of_cta) % size:
        raise ValueError(f"cluster_sms: {len(sm_of_cta)} CTAs are not whole clusters of {size}")
    return [sm_of_cta[first:first + size] for first in range(0, len(sm_of_cta), size)]


def probe_smem_bytes(smem_per_sm: int, smem_per_block_optin: int) -> int:
    """Dynamic shared memory per probe CTA: more than half an SM's, so that one CTA fits per SM
    (as for the decode programs), within what one CTA may have."""
    wanted = smem_per_sm // 2 + 1024
    if wanted > smem_per_block_optin:
        raise ValueError(f"cluster probe: one CTA may have {smem_per_block_optin} bytes of shared memory, "
                         f"less than half an SM's {smem_per_sm}, so one CTA per SM cannot be forced")
    return wanted


def join_groups(clusters, num_sms: int) -> list[list[int]]:
    """Groups of SMs (sorted lists, ordered by their first SM) from ``clusters``, each a sequence
    of the SM ids one cluster ran on: SMs that shared a cluster, directly or through others, are
    one group. SMs in no cluster are groups of their own."""
    parent = list(range(num_sms))

    def root(sm: int) -> int:
        while parent[sm] != sm:
            parent[sm] = parent[parent[sm]]
            sm = parent[sm]
        return sm

    for members in clusters:
        members = [int(sm) for sm in members]
        for sm in members:
            if not 0 <= sm < num_sms:
                raise ValueError(f"join_groups: SM id {sm} outside 0..{num_sms - 1}")
        for sm in members[1:]:
            parent[root(sm)] = root(members[0])
    groups: dict[int, list[int]] = {}
    for sm in range(num_sms):
        groups.setdefault(root(sm), []).append(sm)
    return sorted(groups.values(), key=lambda group: group[0])


def probe() -> dict:
    """The current GPU's cluster layout: ``sm_group_sizes`` (largest first), ``sm_groups`` (see
    the module notes) and ``resident_clusters``, per size in `PROBE_SIZES`, the clusters of that
    many CTAs, one per SM, that the driver says are resident at once (0 or None: that size is not
    launched)."""
    import cupy

    from .codegen.load import allow_cluster_size
    from .codegen.occupancy import max_active_clusters

    attributes = cupy.cuda.Device().attributes
    num_sms = attributes["MultiProcessorCount"]
    smem = probe_smem_bytes(attributes["MaxSharedMemoryPerMultiprocessor"],
                            attributes["MaxSharedMemoryPerBlockOptin"])
    clusters, resident = [], {}
    for size in PROBE_SIZES:
        module = cupy.RawModule(code=_PROBE_SOURCE.replace("CLUSTER_SIZE", str(size)),
                                options=("-std=c++17",))
        kernel = module.get_function("splitkv_cluster_probe")
        kernel.max_dynamic_shared_size_bytes = smem
        allow_cluster_size(kernel, size)
        resident[size] = max_active_clusters(kernel, size, PROBE_THREADS, smem)
        if not resident[size]:
            continue  # no cluster of this size fits (or the driver cannot say): nothing to launch
        ctas = size * resident[size] * 2  # two waves of clusters
        for _ in range(PROBE_LAUNCHES):
            sm_of_cta = cupy.full(ctas, -1, cupy.int32)
            kernel((ctas,), (PROBE_THREADS,), (sm_of_cta,), shared_mem=smem)
            clusters += cluster_sms(sm_of_cta.get(), size)
    groups = join_groups(clusters, num_sms)
    return {"sm_group_sizes": sorted((len(g) for g in groups), reverse=True), "sm_groups": groups,
            "resident_clusters": resident}


def describe(layout: dict) -> str:
    """One line of `probe`'s result: 'SM groups of clusters 18, 18, 16, ...; resident clusters
    2:66 3:39 ...'."""
    groups = ", ".join(str(n) for n in layout.get("sm_group_sizes", [])) or "?"
    resident = " ".join(f"{size}:{'?' if count is None else count}"
                        for size, count in layout.get("resident_clusters", {}).items())
    return f"SM groups of clusters {groups}; resident clusters (one CTA per SM) {resident or '?'}"
