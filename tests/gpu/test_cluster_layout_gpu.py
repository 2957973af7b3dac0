"""The cluster-layout probe on a real GPU: its groups partition the SMs and agree with the driver."""

import pytest

cupy = pytest.importorskip("cupy")

from splitkv import cluster_layout  # noqa: E402

pytestmark = pytest.mark.gpu


def test_probe_groups_partition_the_sms_and_hold_the_resident_clusters():
    num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    layout = cluster_layout.probe()
    groups = layout["sm_groups"]
    assert sorted(sm for group in groups for sm in group) == list(range(num_sms))
    assert layout["sm_group_sizes"] == sorted((len(g) for g in groups), reverse=True)
    resident = layout["resident_clusters"]
    assert set(resident) == set(cluster_layout.PROBE_SIZES)
    # Clusters of 2 fit wherever two SMs share a group; larger ones only in the groups.
    assert resident[2] is not None and 0 < resident[2] <= num_sms // 2
    for size, count in resident.items():
        assert count is not None
        # The driver's count of resident clusters cannot exceed what the groups seen can hold:
        # a cluster lies inside one group (a GPC).
        assert count <= sum(len(g) // size for g in groups), (size, count, layout["sm_group_sizes"])
    # sm_90 guarantees the portable size of 8 somewhere.
    assert resident[8] >= 1 and layout["sm_group_sizes"][0] >= 8
