"""The cluster-layout record's pure parts: joining SMs seen in one cluster, and its one-line form."""

import numpy as np
import pytest

from splitkv import cluster_layout


def test_sms_met_in_one_cluster_form_one_group_even_through_others():
    # 0-1 and 1-2 met in different clusters: 0, 1 and 2 are one group. 3 was in no cluster.
    groups = cluster_layout.join_groups([[0, 1], np.array([2, 1]), [4, 5], [5, 4]], num_sms=6)
    assert groups == [[0, 1, 2], [3], [4, 5]]


def test_groups_partition_every_sm_once():
    rng = np.random.default_rng(7)
    sms = rng.permutation(40)
    clusters = [sms[i:i + 4] for i in range(0, 40, 4)] + [sms[i:i + 4] for i in range(2, 38, 8)]
    groups = cluster_layout.join_groups(clusters, num_sms=40)
    flat = sorted(sm for group in groups for sm in group)
    assert flat == list(range(40))
    assert all(group == sorted(group) for group in groups)
    # every cluster lies inside one group
    where = {sm: i for i, group in enumerate(groups) for sm in group}
    assert all(len({where[int(sm)] for sm in c}) == 1 for c in clusters)


def test_an_sm_id_out_of_range_is_refused():
    # -1 is what a probe CTA that never ran leaves behind; it must not be read as an SM.
    with pytest.raises(ValueError, match="SM id -1"):
        cluster_layout.join_groups([[0, -1]], num_sms=4)


def test_describe_reads_a_probe_result_and_its_json_form():
    layout = {"sm_group_sizes": [18, 16, 2], "sm_groups": [[0], [1], [2]], "resident_clusters": {2: 66, 9: 9}}
    assert cluster_layout.describe(layout) == (
        "SM groups of clusters 18, 16, 2; resident clusters (one CTA per SM) 2:66 9:9")
    as_json = {"sm_group_sizes": [18], "resident_clusters": {"2": 66}}
    assert cluster_layout.describe(as_json).endswith("2:66")


def test_a_launch_is_cut_into_its_clusters_in_launch_order():
    sms = np.array([4, 5, 0, 1, 9, 8])
    assert [list(c) for c in cluster_layout.cluster_sms(sms, 2)] == [[4, 5], [0, 1], [9, 8]]
    with pytest.raises(ValueError, match="not whole clusters of 4"):
        cluster_layout.cluster_sms(sms, 4)


def test_the_probe_takes_more_than_half_an_sm_of_shared_memory_where_a_cta_may():
    assert cluster_layout.probe_smem_bytes(228 * 1024, 227 * 1024) == 115 * 1024  # sm_90
    assert cluster_layout.probe_smem_bytes(100 * 1024, 99 * 1024) == 51 * 1024  # sm_120
    with pytest.raises(ValueError, match="one CTA per SM cannot be forced"):
        cluster_layout.probe_smem_bytes(228 * 1024, 48 * 1024)


def test_describe_marks_a_count_the_driver_could_not_give():
    layout = {"sm_group_sizes": [8], "resident_clusters": {2: 4, 16: None}}
    assert cluster_layout.describe(layout).endswith("2:4 16:?")

