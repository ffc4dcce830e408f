"""Closed forms: exact small cases, nccl-tests definitions, cluster-aware evaluation."""

import math

import pytest

from labsim.cluster import Cluster, dgx_a100, dgx_h100
from labsim.collectives import (
    ALGORITHMS,
    algbw,
    busbw,
    busbw_factor,
    collective_lower_bound,
    collective_time,
    collective_time_on,
)
from labsim.hardware import Link

L = Link("test", bandwidth_Bps=100.0, latency_s=1.0, source="test")  # alpha 1 s, beta 0.01 s/B


def test_ring_allreduce_textbook_form():
    # 2(p-1) alpha + 2 (p-1)/p S beta, S divisible by p
    assert collective_time("allreduce", 800, 8, L, achieved=False) == pytest.approx(
        14 * 1.0 + 2 * 7 / 8 * 800 / 100)


def test_ring_uses_the_biggest_chunk_when_p_does_not_divide_s():
    # 10 bytes over 4 ranks: chunks 3,3,2,2 -> every step moves up to 3 bytes
    assert collective_time("allreduce", 10, 4, L) == pytest.approx(6 * (1 + 3 / 100))
    assert collective_time("reduce_scatter", 10, 4, L) == pytest.approx(3 * (1 + 3 / 100))
    assert collective_time("allgather", 1, 3, L) == pytest.approx(2 * (1 + 1 / 100))


def test_other_algorithms_exact():
    assert collective_time("allreduce", 100, 5, L, "tree") == pytest.approx(2 * 3 * (1 + 1))
    assert collective_time("allreduce", 100, 8, L, "recursive_doubling") == pytest.approx(3 * 2)
    # Rabenseifner, S divisible: 2 lg p alpha + 2 (p-1)/p S beta
    assert collective_time("allreduce", 800, 8, L, "rabenseifner") == pytest.approx(
        6 + 2 * 7 / 8 * 8)
    assert collective_time("broadcast", 100, 4, L, "tree") == pytest.approx(2 * 2)
    # chain, k = 4 pieces of 25 B over 3 hops: (p + k - 2) steps of (alpha + 25 beta)
    assert collective_time("broadcast", 100, 4, L, "ring", piece_bytes=25) == pytest.approx(
        6 * 1.25)
    assert collective_time("alltoall", 90, 3, L) == pytest.approx(2 * (1 + 0.3))


def test_degenerate_cases_cost_nothing():
    for op, algos in ALGORITHMS.items():
        for algo in algos:
            if algo != "hierarchical":
                assert collective_time(op, 0, 4, L, algo) == 0.0
                assert collective_time(op, 1e6, 1, L, algo) == 0.0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: collective_time("allscatter", 1, 2, L), "unknown collective"),
        (lambda: collective_time("allreduce", -1, 2, L), ">= 0 bytes"),
        (lambda: collective_time("allreduce", 1, 0, L), ">= 1"),
        (lambda: collective_time("allreduce", 1, 6, L, "recursive_doubling"), "power-of-two"),
        (lambda: collective_time("broadcast", 1, 2, L, "rabenseifner"), "no algorithm"),
        (lambda: collective_time("allreduce", 1, 2, L, "hierarchical"), "needs a cluster"),
    ],
)
def test_bad_input_raises_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_nccl_tests_definitions():
    assert busbw_factor("allreduce", 8) == 2 * 7 / 8
    assert busbw_factor("allgather", 4) == busbw_factor("reduce_scatter", 4) == 3 / 4
    assert busbw_factor("alltoall", 2) == 0.5 and busbw_factor("broadcast", 8) == 1.0
    assert algbw(1e9, 0.5) == 2e9 and math.isinf(algbw(1, 0.0))
    assert busbw("allreduce", 1e9, 8, 0.5) == pytest.approx(2e9 * 1.75)


def test_lower_bound_holds_for_every_algorithm():
    for op, algos in ALGORITHMS.items():
        for algo in algos:
            if algo == "hierarchical":
                continue
            for n in (2, 4, 8, 16):
                for S in (1, 1000, 12345):
                    t = collective_time(op, S, n, L, algo)
                    assert t >= collective_lower_bound(op, S, n, L) * (1 - 1e-12)


def test_on_one_node_the_cluster_form_equals_the_link_form():
    c = dgx_a100(1)
    for op, algos in ALGORITHMS.items():
        for algo in algos:
            for n in (2, 3, 4, 8):
                if algo in ("recursive_doubling", "rabenseifner", "recursive_halving") \
                        and n & (n - 1):
                    continue
                for S in (1, 999, 10**9 + 7):
                    t = collective_time_on(c, op, S, n, algo)
                    if algo == "hierarchical":  # one node: hierarchical is the ring
                        assert t == pytest.approx(collective_time(op, S, n, c.intra_node),
                                                  rel=1e-9)
                    else:
                        assert t == pytest.approx(
                            collective_time(op, S, n, c.intra_node, algo), rel=1e-9)


def test_nccl_figures_reproduced_within_ten_percent():
    S = 8 * 2**30  # nccl-tests figures need >= 8 GB messages
    a = collective_time_on(dgx_a100(1), "allreduce", S)
    h = collective_time_on(dgx_h100(1), "allreduce", S)
    assert busbw("allreduce", S, 8, a) == pytest.approx(230e9, rel=0.10)
    assert busbw("allreduce", S, 8, h) == pytest.approx(370e9, rel=0.10)
    # two DGX H100 nodes: bus bandwidth per 400 Gb/s NIC 46-48 GB/s
    two = collective_time_on(dgx_h100(2), "allreduce", S)
    assert busbw("allreduce", S, 16, two) / 8 == pytest.approx(47e9, rel=0.10)


def test_groups_across_nodes_go_through_the_nics():
    c = dgx_h100(4)
    dp = range(0, 32, 8)  # local GPU 0 of each node: one NIC each, 4 ranks
    t = collective_time_on(c, "allreduce", 1e9, dp)
    assert t == pytest.approx(collective_time("allreduce", 1e9, 4, c.inter_node), rel=1e-9)
    # a PCIe box with one NIC per node: a ring over all GPUs has one channel through it
    box = Cluster("A100-80GB", 2, 4, "pcie4-x16", "ib-hdr", nics_per_node=1)
    assert collective_time_on(box, "allreduce", 1e9) > collective_time_on(box, "allreduce",
                                                                          1e9, 4)
