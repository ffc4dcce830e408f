"""The network engine: exact timelines of shared and unshared links."""

import numpy as np
import pytest
import simpy

from labsim.cluster import Cluster
from labsim.collectives.schedule import Pattern
from labsim.hardware import Link
from labsim.sim.network import Network

L = Link("t", bandwidth_Bps=100.0, latency_s=0.0, source="test")


def one_node(n: int = 4, lk: Link = L) -> Cluster:
    return Cluster("A100-80GB", 1, n, lk, lk)


def run(flows: list[tuple[float, list[int], list[int], list[float]]],
        cluster: Cluster | None = None) -> list[float]:
    """Start each (start_s, src, dst, nbytes) bundle; return the end time of each."""
    env = simpy.Environment()
    net = Network(env, cluster or one_node())
    ends = [0.0] * len(flows)

    def go(i: int, start: float, src: list[int], dst: list[int], nbytes: list[float]):
        yield env.timeout(start)
        yield net.transfer(Pattern(src, dst, i), np.array(nbytes, dtype=float))
        ends[i] = env.now

    for i, flow in enumerate(flows):
        env.process(go(i, *flow))
    env.run()
    return ends


def test_a_flow_alone_takes_alpha_plus_bytes_over_bandwidth():
    lk = Link("t", bandwidth_Bps=100.0, latency_s=0.25, source="test")
    assert run([(0.0, [0], [1], [50.0])], one_node(2, lk)) == [pytest.approx(0.75)]


def test_two_flows_on_one_direction_each_get_half():
    # 0->1 and 2->1 share gpu1's rx direction
    assert run([(0.0, [0], [1], [100.0]), (0.0, [2], [1], [100.0])]) == [2.0, 2.0]


def test_a_late_flow_slows_the_first_and_speeds_up_when_it_ends():
    # A alone for 0.5 s (50 B), then 50 B/s each: A ends at 1.5, B has 50 B left -> 2.0
    ends = run([(0.0, [0], [1], [100.0]), (0.5, [2], [1], [100.0])])
    assert ends == [pytest.approx(1.5), pytest.approx(2.0)]


def test_full_duplex_opposite_directions_do_not_interact():
    assert run([(0.0, [0], [1], [100.0]), (0.0, [1], [0], [100.0])]) == [1.0, 1.0]


def test_a_bundle_ends_with_its_largest_transfer():
    assert run([(0.0, [0, 1, 2], [1, 2, 3], [10.0, 100.0, 30.0])]) == [1.0]


def test_cross_node_traffic_shares_the_nic():
    # 2 nodes x 2 GPUs, one NIC per node: two transfers leaving node 0 share its NIC
    c = Cluster("A100-80GB", 2, 2, L, L, nics_per_node=1)
    assert run([(0.0, [0, 1], [2, 3], [100.0, 100.0])], c) == [2.0]
    c2 = Cluster("A100-80GB", 2, 2, L, L, nics_per_node=2)
    assert run([(0.0, [0, 1], [2, 3], [100.0, 100.0])], c2) == [1.0]
