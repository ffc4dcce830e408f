"""Simulated collectives against their closed forms (NCCL and textbook), and properties."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labsim.cluster import Cluster, dgx_a100, dgx_h100
from labsim.collectives import (
    collective_lower_bound,
    collective_time,
    crossover_bytes,
    estimate_collective,
)
from labsim.collectives.schedule import ALGORITHMS, POWER_OF_TWO
from labsim.hardware import Link
from labsim.sim import simulate_collective

NV = Link("nv", bandwidth_Bps=300e9, latency_s=3.4e-6, source="test")


def switch(n: int, lk: Link = NV) -> Cluster:
    """The idealised case: n GPUs behind one non-blocking switch."""
    return Cluster("A100-80GB", 1, n, lk, lk)


def cases():
    for op, algos in ALGORITHMS.items():
        for algo in algos:
            if algo == "hierarchical":
                continue
            for n in (2, 3, 5, 8, 16, 64):
                if algo in POWER_OF_TWO and n & (n - 1):
                    continue
                for nbytes in (1, 7, 1000, 65_537, 10**10 + 1):
                    if (op, algo) == ("broadcast", "ring") and nbytes > 10**9 and n > 2:
                        nbytes = 10**9 + 1  # 10 GB is 19 073 pipelined steps: once is enough
                    yield op, algo, n, nbytes


@pytest.mark.slow
@pytest.mark.parametrize("op, algo, n, nbytes", list(cases()))
def test_simulation_equals_closed_form_on_one_switch(op, algo, n, nbytes):
    r = simulate_collective(op, nbytes, switch(n), algo, protocol="alpha-beta", detail="phase")
    assert r.time_s == pytest.approx(collective_time(op, nbytes, n, NV, algo), rel=1e-9)


@pytest.mark.parametrize("cluster", [dgx_a100(1), dgx_h100(1), dgx_h100(4), dgx_a100(3),
                                     Cluster("A100-80GB", 2, 4, "pcie4-x16", "ib-hdr", 1)],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("op", ["allreduce", "allgather", "reduce_scatter", "broadcast",
                                "alltoall"])
def test_nccl_model_simulated_alone_equals_its_closed_form(cluster, op):
    for nbytes in (1024, 3 * 2**20 + 5, 2**31):
        for algo in ("auto", "ring"):
            sim = simulate_collective(op, nbytes, cluster, algo)
            est = estimate_collective(op, nbytes, cluster, algo)
            assert sim.time_s == pytest.approx(est.time_s, rel=1e-12)
            assert (sim.algorithm, sim.protocol) == (est.algorithm, est.protocol)
            assert np.allclose(sim.pipe_bytes, est.pipe_bytes)


def test_trace_detail_never_changes_the_numbers():
    c = dgx_h100(2)
    results = [simulate_collective("allreduce", 12345679, c, "ring", protocol="alpha-beta",
                                   detail=d) for d in ("full", "step", "phase")]
    assert len({r.time_s for r in results}) == 1
    full, step, phase = (r.trace for r in results)
    assert len(full) == results[0].transfers > len(step) == results[0].steps > len(phase)
    # the spans carry the same bytes at every level
    assert full.total_bytes() == step.total_bytes() == phase.total_bytes()


def test_bytes_sent_equal_bytes_received_and_match_the_algorithm():
    S, n = 10_001, 6
    r = simulate_collective("allreduce", S, switch(n), "ring", protocol="alpha-beta",
                            detail="full")
    tx, rx = r.pipe_bytes[:n], r.pipe_bytes[n:2 * n]
    assert tx.sum() == rx.sum() == r.trace.total_bytes()
    assert tx.sum() == 2 * (n - 1) * S  # each of 2(n-1) steps moves every chunk once


def test_nccl_ring_across_nodes_runs_at_the_nics_line():
    S = 8 * 2**30
    two = simulate_collective("allreduce", S, dgx_h100(2), "ring")
    assert 0.9 * 46e9 <= two.busbw_Bps / 8 <= 1.1 * 48e9  # per 400 Gb/s NIC
    # NCCL's choice on 2 nodes is a tree: 2 nodes exchange each half once (up to 2x the NICs)
    assert simulate_collective("allreduce", S, dgx_h100(2)).busbw_Bps > two.busbw_Bps


@pytest.mark.slow
def test_multi_node_textbook_simulation_equals_its_closed_form():
    for cl, algo in [(dgx_h100(4), "ring"), (dgx_a100(3), "hierarchical"),
                     (Cluster("A100-80GB", 2, 4, "pcie4-x16", "ib-hdr", 1), "ring")]:
        r = simulate_collective("allreduce", 10**8 + 3, cl, algo, protocol="alpha-beta")
        e = estimate_collective("allreduce", 10**8 + 3, cl, algo, protocol="alpha-beta")
        assert r.time_s == pytest.approx(e.time_s, rel=1e-9)


def test_nccl_latency_at_scale_is_not_a_strawman():
    # a 64 KiB all-reduce on 64 GPUs: NCCL's tree and LL protocol, tens of microseconds
    r = simulate_collective("allreduce", 2**16, dgx_a100(8))
    assert r.protocol == "LL" and r.time_s < 150e-6
    # the textbook ring pays 2(p-1) Simple-protocol latencies: over a millisecond
    ring = simulate_collective("allreduce", 2**16, dgx_a100(8), "ring", protocol="alpha-beta")
    assert ring.time_s > 1e-3


def test_chrome_export_has_one_event_per_span(tmp_path):
    r = simulate_collective("allreduce", 4096, switch(4), protocol="alpha-beta", detail="full")
    path = tmp_path / "t.json"
    r.trace.to_chrome(path)
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(r.trace) == 24
    assert all({"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) for e in spans)


def test_link_utilisation_of_a_ring_is_the_same_on_every_port():
    r = simulate_collective("allreduce", 8 * 10**9, switch(8), "ring")
    util = r.link_utilisation()
    assert len(util) == 16 and max(util.values()) <= 1 + 1e-12
    assert min(util.values()) == pytest.approx(max(util.values()))


sizes = st.integers(min_value=0, max_value=10**10)
ns = st.integers(min_value=2, max_value=24)
ops = st.sampled_from(["allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall"])


@settings(max_examples=40, deadline=None)
@given(op=ops, n=ns, nbytes=sizes, factor=st.floats(1.0, 10.0))
def test_more_bandwidth_is_never_slower(op, n, nbytes, factor):
    # for one algorithm and protocol; NCCL's own choice may change with the link and its
    # estimate may be wrong (on a 2x faster link it can pick LL128 where LL was faster)
    fast_link = Link("f", NV.bandwidth_Bps * factor, NV.latency_s, "test")
    slow = simulate_collective(op, nbytes, switch(n), protocol="alpha-beta").time_s
    fast = simulate_collective(op, nbytes, switch(n, fast_link), protocol="alpha-beta").time_s
    assert fast <= slow * (1 + 1e-12)
    chosen = simulate_collective(op, nbytes, switch(n))
    if chosen.algorithm in ("none", "p2p"):
        return
    pinned = dict(algorithm=chosen.algorithm, protocol=chosen.protocol)
    fast = simulate_collective(op, nbytes, switch(n, fast_link), **pinned).time_s
    assert fast <= chosen.time_s * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(op=ops, n=ns, nbytes=sizes, data=st.data())
def test_never_faster_than_the_lower_bound_and_deterministic(op, n, nbytes, data):
    algo = data.draw(st.sampled_from([a for a in ALGORITHMS[op]
                                      if a != "hierarchical" and
                                      not (a in POWER_OF_TWO and n & (n - 1))]))
    r1 = simulate_collective(op, nbytes, switch(n), algo, protocol="alpha-beta", detail="phase")
    r2 = simulate_collective(op, nbytes, switch(n), algo, protocol="alpha-beta", detail="phase")
    assert r1.time_s == r2.time_s
    assert r1.time_s >= collective_lower_bound(op, nbytes, n, NV) * (1 - 1e-12)
    assert np.array_equal(r1.pipe_bytes, r2.pipe_bytes)
    assert r1.pipe_bytes[:n].sum() == r1.pipe_bytes[n:2 * n].sum()


@settings(max_examples=15, deadline=None)
@given(n=st.integers(min_value=4, max_value=64))
def test_tree_beats_ring_below_the_crossover_and_loses_above(n):
    cross = crossover_bytes("allreduce", n, NV, "tree", "ring")
    below, above = int(cross) // 2, int(cross) * 2
    c = switch(n)
    t = {(algo, s): simulate_collective("allreduce", s, c, algo, protocol="alpha-beta",
                                        detail="phase").time_s
         for algo in ("tree", "ring") for s in (below, above)}
    assert t["tree", below] < t["ring", below]
    assert t["ring", above] < t["tree", above]


def test_concurrent_collectives_share_links_and_separate_ones_do_not():
    import simpy

    from labsim.sim import Network, start_collective

    c = dgx_h100(2)

    def run(groups):
        env = simpy.Environment()
        net = Network(env, c.pipe_capacities())
        done = [start_collective(net, c, "allreduce", 10**9, list(g), "ring") for g in groups]
        env.run()
        assert all(d.triggered for d in done)
        return env.now

    alone = run([range(0, 8)])
    # the same GPUs twice at once: every port carries two flows -> the bytes take twice as
    # long, the latency is paid once each, at the same time
    twice = run([range(0, 8), range(0, 8)])
    assert alone < twice < 2 * alone
    # two nodes' groups in parallel touch no common link: no slowdown
    assert run([range(0, 8), range(8, 16)]) == pytest.approx(alone, rel=1e-12)


def test_hierarchical_equals_its_textbook_form():
    # g GPUs per node, N nodes, one NIC per GPU: 2(g-1) NVLink steps of S/g, then 2(N-1)
    # network steps of S/(gN), each ring alone on its links
    for nodes, S in [(2, 8 * 2 * 10**6), (4, 8 * 4 * 12345)]:
        c = dgx_h100(nodes)
        a_i, b_i = c.intra_node.latency_s, c.intra_node.achieved_Bps
        a_n, b_n = c.inter_node.latency_s, c.inter_node.achieved_Bps
        expected = 2 * 7 * (a_i + S / 8 / b_i) + 2 * (nodes - 1) * (a_n + S / 8 / nodes / b_n)
        r = simulate_collective("allreduce", S, c, "hierarchical", protocol="alpha-beta")
        assert r.time_s == pytest.approx(expected, rel=1e-9)
