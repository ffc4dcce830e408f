"""Simulated collectives against their closed forms, published figures and properties."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labsim.cluster import Cluster, dgx_a100, dgx_h100
from labsim.collectives import (
    collective_lower_bound,
    collective_time,
    collective_time_on,
    crossover_bytes,
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
    r = simulate_collective(op, nbytes, switch(n), algo, detail="phase")
    assert r.time_s == pytest.approx(collective_time(op, nbytes, n, NV, algo), rel=1e-9)


def test_trace_detail_never_changes_the_numbers():
    c = dgx_h100(2)
    results = [simulate_collective("allreduce", 12345679, c, "ring", detail=d)
               for d in ("full", "step", "phase")]
    assert len({r.time_s for r in results}) == 1
    full, step, phase = (r.trace for r in results)
    assert len(full) == results[0].transfers > len(step) == results[0].steps > len(phase)
    # the spans carry the same bytes at every level
    assert full.total_bytes() == step.total_bytes() == phase.total_bytes()


def test_bytes_sent_equal_bytes_received_and_match_the_algorithm():
    S, n = 10_001, 6
    r = simulate_collective("allreduce", S, switch(n), "ring", detail="full")
    tx, rx = r.pipe_bytes[:n], r.pipe_bytes[n:2 * n]
    assert tx.sum() == rx.sum() == r.trace.total_bytes()
    assert tx.sum() == 2 * (n - 1) * S  # each of 2(n-1) steps moves every chunk once


def test_reproduces_nccl_bus_bandwidths():
    S = 8 * 2**30
    a = simulate_collective("allreduce", S, dgx_a100(1))
    h = simulate_collective("allreduce", S, dgx_h100(1))
    assert a.busbw_Bps == pytest.approx(230e9, rel=0.10)
    assert h.busbw_Bps == pytest.approx(370e9, rel=0.10)
    two = simulate_collective("allreduce", S, dgx_h100(2))
    assert 0.9 * 46e9 <= two.busbw_Bps / 8 <= 1.1 * 48e9  # per 400 Gb/s NIC


@pytest.mark.slow
def test_multi_node_simulation_equals_the_cluster_form():
    for cl, algo in [(dgx_h100(4), "ring"), (dgx_a100(3), "hierarchical"),
                     (Cluster("A100-80GB", 2, 4, "pcie4-x16", "ib-hdr", 1), "ring")]:
        r = simulate_collective("allreduce", 10**8 + 3, cl, algo)
        assert r.time_s == pytest.approx(collective_time_on(cl, "allreduce", 10**8 + 3,
                                                            algorithm=algo), rel=1e-9)


def test_hierarchical_beats_a_flat_ring_at_scale_for_large_messages():
    c = dgx_h100(64)
    flat = simulate_collective("allreduce", 2**30, c, "ring")
    hier = simulate_collective("allreduce", 2**30, c, "hierarchical")
    assert hier.time_s < flat.time_s


def test_chrome_export_has_one_event_per_span(tmp_path):
    r = simulate_collective("allreduce", 4096, switch(4), detail="full")
    path = tmp_path / "t.json"
    r.trace.to_chrome(path)
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(r.trace) == 24
    assert all({"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) for e in spans)


def test_link_utilisation_of_a_ring_is_the_same_on_every_port():
    r = simulate_collective("allreduce", 8 * 10**9, switch(8), detail="phase")
    util = r.link_utilisation()
    assert len(util) == 16 and max(util.values()) <= 1 + 1e-12
    assert min(util.values()) == pytest.approx(max(util.values()))


sizes = st.integers(min_value=0, max_value=10**10)
ns = st.integers(min_value=2, max_value=24)
ops = st.sampled_from(["allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall"])


@settings(max_examples=40, deadline=None)
@given(op=ops, n=ns, nbytes=sizes, factor=st.floats(1.0, 10.0))
def test_more_bandwidth_is_never_slower(op, n, nbytes, factor):
    slow = simulate_collective(op, nbytes, switch(n), detail="phase").time_s
    fast_link = Link("f", NV.bandwidth_Bps * factor, NV.latency_s, "test")
    assert simulate_collective(op, nbytes, switch(n, fast_link), detail="phase").time_s <= slow


@settings(max_examples=40, deadline=None)
@given(op=ops, n=ns, nbytes=sizes, data=st.data())
def test_never_faster_than_the_lower_bound_and_deterministic(op, n, nbytes, data):
    algo = data.draw(st.sampled_from([a for a in ALGORITHMS[op]
                                      if a != "hierarchical" and
                                      not (a in POWER_OF_TWO and n & (n - 1))]))
    r1 = simulate_collective(op, nbytes, switch(n), algo, detail="phase")
    r2 = simulate_collective(op, nbytes, switch(n), algo, detail="phase")
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
    t = {(algo, s): simulate_collective("allreduce", s, c, algo, detail="phase").time_s
         for algo in ("tree", "ring") for s in (below, above)}
    assert t["tree", below] < t["ring", below]
    assert t["ring", above] < t["tree", above]


def test_concurrent_collectives_share_links_and_separate_ones_do_not():
    import simpy

    from labsim.sim import Network, start_collective

    def run(groups):
        env = simpy.Environment()
        net = Network(env, dgx_h100(2))
        procs = [start_collective(net, "allreduce", 10**9, g) for g in groups]
        env.run()
        assert all(p.triggered for p in procs)
        return env.now

    alone = run([range(0, 8)])
    # the same GPUs twice at once: every port carries two flows -> bandwidth term doubles
    twice = run([range(0, 8), range(0, 8)])
    # 14 ring steps: the latencies do not add up, the bytes do
    assert twice == pytest.approx(2 * alone - 14 * dgx_h100().intra_node.latency_s, rel=1e-9)
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
        r = simulate_collective("allreduce", S, c, "hierarchical")
        assert r.time_s == pytest.approx(expected, rel=1e-9)
        assert r.time_s == pytest.approx(collective_time_on(c, "allreduce", S,
                                                            algorithm="hierarchical"), rel=1e-9)
