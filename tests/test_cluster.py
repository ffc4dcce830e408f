"""Cluster: validation, rank mapping, routes and max-min fair sharing."""

import numpy as np
import pytest

from labsim.cluster import Cluster, cluster, dgx_a100, dgx_h100, pcie_box
from labsim.hardware import link


def test_presets_match_the_datasheets():
    a, h = dgx_a100(2), dgx_h100(4)
    assert (a.world_size, a.gpus_per_node, a.nics_per_node) == (16, 8, 8)
    assert a.gpu.name == "A100-80GB" and a.intra_node.name == "nvlink3"
    assert a.inter_node.name == "ib-hdr"
    assert h.world_size == 32 and h.intra_node.name == "nvlink4" and h.inter_node.name == "ib-ndr"
    assert pcie_box().intra_node.name == "pcie4-x16" and pcie_box().nics_per_node == 1
    assert cluster("DGX_H100", 3) == dgx_h100(3)


def test_rank_mapping_is_node_major():
    c = dgx_h100(3)
    assert [c.node_of(r) for r in (0, 7, 8, 23)] == [0, 0, 1, 2]
    assert [c.local_rank(r) for r in (0, 7, 8, 23)] == [0, 7, 0, 7]
    assert all(c.rank_of(c.node_of(r), c.local_rank(r)) == r for r in range(24))
    assert c.same_node(8, 15) and not c.same_node(7, 8)
    assert c.link_between(1, 2) == link("nvlink4") and c.link_between(1, 9) == link("ib-ndr")
    with pytest.raises(ValueError, match="out of range"):
        c.node_of(24)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nodes": 0}, "nodes"),
        ({"gpus_per_node": -1}, "gpus_per_node"),
        ({"nics_per_node": 3}, "divide"),
        ({"nics_per_node": 9}, "between 1 and"),
        ({"intra_node": "nvlink9"}, "unknown link"),
    ],
)
def test_validation_names_the_fix(kwargs, message):
    args = {"gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 8, "intra_node": "nvlink3",
            "inter_node": "ib-hdr"} | kwargs
    with pytest.raises(ValueError, match=message):
        Cluster(**args)


def test_paths_use_ports_inside_a_node_and_nics_across():
    c = Cluster("H100-SXM", 2, 4, "nvlink4", "ib-ndr", nics_per_node=2)
    paths = c.paths(np.array([0, 1, 3]), np.array([1, 4, 6]))
    n = c.world_size
    # 0 -> 1 inside node 0: gpu0 tx, gpu1 rx
    assert paths[0].tolist() == [0, n + 1]
    # 1 -> 4: node 0 NIC 0 (local 1 of 4 GPUs, 2 NICs) tx, node 1 NIC 0 rx
    assert paths[1].tolist() == [2 * n + 0, 2 * n + 4 + 2]
    # 3 -> 6: node 0 NIC 1 tx, node 1 NIC 1 rx
    assert paths[2].tolist() == [2 * n + 1, 2 * n + 4 + 3]
    assert len(c.pipe_names()) == c.n_pipes == len(c.pipe_capacities())


def test_cluster_values_are_checked_and_huge_clusters_refused():
    with pytest.raises(ValueError, match="nodes must be a whole number"):
        Cluster("A100-80GB", 4.7, 8, "nvlink3", "ib-hdr")
    with pytest.raises(ValueError, match="nodes must be a whole number"):
        Cluster("A100-80GB", float("nan"), 8, "nvlink3", "ib-hdr")
    with pytest.raises(ValueError, match="1,048,576"):
        dgx_h100(1_000_000_000)
    with pytest.raises(ValueError, match="in_network_reduction"):
        Cluster("A100-80GB", 1, 8, "nvlink3", "ib-hdr", in_network_reduction="yes")
    with pytest.raises(ValueError, match="cluster name"):
        cluster(None)  # type: ignore[arg-type]


def test_gpu_to_nic_path_follows_the_pcie_generation():
    assert dgx_a100().gpu_nic_Bps == 24e9 and dgx_h100().gpu_nic_Bps == 48e9
