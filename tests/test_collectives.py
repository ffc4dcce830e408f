"""Collectives as values: the textbook closed forms, NCCL's tuner, NCCL's channel search, and
the NCCL model's cost (closed form) of a collective on a cluster."""

import math
from dataclasses import replace

import pytest

from labsim.cluster import Cluster, dgx_a100, dgx_h100, pcie_box
from labsim.collectives import (
    ALGORITHMS,
    algbw,
    busbw,
    busbw_factor,
    collective_lower_bound,
    collective_time,
    estimate_collective,
    group_of,
    plan_collective,
    strided_group,
)
from labsim.collectives.group import topology
from labsim.collectives.nccl import _plan_cached, _topology_of, clear_cache
from labsim.collectives.tuner import (
    ALGOS,
    PROTOS,
    bandwidth_GBps,
    estimate_us,
    latency_bandwidth,
    parse_choice,
    select,
    supported_pairs,
)
from labsim.hardware import Link, link
from labsim.published import SYSTEMS, nccl_tests
from labsim.sim.collectives import simulate_collective

from .conftest import links_times

L = Link("test", bandwidth_Bps=100.0, latency_s=1.0, source="test")  # alpha 1 s, beta 0.01 s/B


# -- textbook alpha-beta ---------------------------------------------------------------------
def test_ring_allreduce_textbook_form():
    # 2(p-1) alpha + 2 (p-1)/p S beta, S divisible by p
    assert collective_time("allreduce", 800, 8, L, achieved=False) == pytest.approx(
        14 * 1.0 + 2 * 7 / 8 * 800 / 100)


def test_ring_uses_the_biggest_chunk_when_p_does_not_divide_s():
    # 10 bytes over 4 ranks: chunks 3,3,2,2 -> every step moves up to 3 bytes
    assert collective_time("allreduce", 10, 4, L) == pytest.approx(6 * (1 + 3 / 100))
    assert collective_time("reduce_scatter", 10, 4, L) == pytest.approx(3 * (1 + 3 / 100))
    assert collective_time("allgather", 1, 3, L) == pytest.approx(2 * (1 + 1 / 100))


def test_other_textbook_algorithms_exact():
    assert collective_time("allreduce", 100, 5, L, "tree") == pytest.approx(2 * 3 * (1 + 1))
    assert collective_time("allreduce", 100, 8, L, "recursive_doubling") == pytest.approx(3 * 2)
    assert collective_time("allreduce", 800, 8, L, "rabenseifner") == pytest.approx(
        6 + 2 * 7 / 8 * 8)
    assert collective_time("broadcast", 100, 4, L, "tree") == pytest.approx(2 * 2)
    assert collective_time("broadcast", 100, 4, L, "ring", piece_bytes=25) == pytest.approx(
        6 * 1.25)
    assert collective_time("alltoall", 90, 3, L) == pytest.approx(2 * (1 + 0.3))


def test_degenerate_cases_cost_nothing():
    for op, algos in ALGORITHMS.items():
        for algo in algos:
            if algo != "hierarchical":
                assert collective_time(op, 0, 4, L, algo) == 0.0
                assert collective_time(op, 1e6, 1, L, algo) == 0.0
    assert estimate_collective("allreduce", 0, dgx_h100(2)).time_s == 0.0
    assert estimate_collective("allreduce", 10**9, dgx_h100(2), ranks=1).time_s == 0.0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: collective_time("allscatter", 1, 2, L), "unknown collective"),
        (lambda: collective_time("allreduce", -1, 2, L), ">= 0"),
        (lambda: collective_time("allreduce", float("nan"), 2, L), "finite"),
        (lambda: collective_time("allreduce", True, 2, L), "finite number"),
        (lambda: collective_time("allreduce", "64", 2, L), "finite number"),
        (lambda: collective_time("allreduce", 1, 0, L), ">= 1"),
        (lambda: collective_time("allreduce", 1, 6, L, "recursive_doubling"), "power-of-two"),
        (lambda: collective_time("broadcast", 1, 2, L, "rabenseifner"), "no algorithm"),
        (lambda: collective_time("allreduce", 1, 2, L, "hierarchical"), "needs a cluster"),
        (lambda: collective_time("allreduce", 1, 2, L, protocol="LL"), "alpha-beta"),
        (lambda: estimate_collective("allreduce", 1e30, dgx_h100(1)), "1 PiB"),
        (lambda: estimate_collective("allreduce", 1.5, dgx_h100(1)), "whole number"),
        (lambda: estimate_collective("allreduce", 8, None), "labsim.Cluster"),
        (lambda: estimate_collective("allreduce", 8, dgx_h100(1), "hierarchical"), "unknown"),
        (lambda: estimate_collective("allreduce", 8, dgx_h100(1), ranks=[0, 0]), "distinct"),
        (lambda: estimate_collective("allreduce", 8, dgx_h100(1), ranks=9), "8-GPU"),
        (lambda: estimate_collective("allreduce", 8, dgx_h100(1), protocol="LL64"), "LL128"),
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


def test_lower_bound_holds_for_every_textbook_algorithm():
    for op, algos in ALGORITHMS.items():
        for algo in algos:
            if algo == "hierarchical":
                continue
            for n in (2, 4, 8, 16):
                for S in (1, 1000, 12345):
                    t = collective_time(op, S, n, L, algo)
                    assert t >= collective_lower_bound(op, S, n, L) * (1 - 1e-12)


def test_the_textbook_model_on_one_switch_equals_the_link_form():
    c = dgx_a100(1)
    for op, algo, n in [("allreduce", "ring", 8), ("allreduce", "tree", 5),
                        ("allgather", "ring", 3), ("alltoall", "pairwise", 4),
                        ("allreduce", "rabenseifner", 8)]:
        for S in (1, 999, 10**9 + 7):
            t = estimate_collective(op, S, c, algo, n, protocol="alpha-beta").time_s
            assert t == pytest.approx(collective_time(op, S, n, c.intra_node, algo), rel=1e-9)


# -- NCCL's tuner and channel search (NCCL 2.30.7) ------------------------------------------
def test_channel_search_matches_nccl_on_dgx_systems():
    # A100: 12 NVLink x 20 GB/s = 240: 6 channels at 40, doubled to 12 x 20; 24 to execute
    a = topology(group_of(dgx_a100(1)))
    assert (a.ring_channels, a.bw_intra, a.channels) == (12, 20.0, 24)
    # H100: 18 x 20.6 = 370.8: 6 x 60, doubled to 12 x 30
    h = topology(group_of(dgx_h100(1)))
    assert (h.ring_channels, h.bw_intra, h.channels, h.nvls_heads) == (12, 30.0, 24, 8)
    # 4 DGX H100 nodes: 8 channels at 45 GB/s (8 x 48 > 370.8 NVLink), not doubled (< 50)
    m = topology(group_of(dgx_h100(4)))
    assert (m.ring_channels, m.bw_inter, m.channels) == (8, 45.0, 16)
    # DGX A100 nodes: PCIe 4.0 to the NIC caps a channel at 24 GB/s
    assert topology(group_of(dgx_a100(2))).bw_inter == 24.0
    assert topology(group_of(dgx_a100(1))).nvls_heads == 0  # no NVLink SHARP before Hopper


def test_tuner_tables_give_the_numbers_of_tuning_cc_for_8_h100():
    # notes derived from tuning.cc: Ring LL 6.6 + 14 x 0.6 = 15.0 us, algbw min(141, 180)*8/14
    topo = topology(group_of(dgx_h100(1)))
    lat, bw = latency_bandwidth("allreduce", "ring", "LL", topo)
    assert lat == pytest.approx(15.0) and bw == pytest.approx(141 * 8 / 14)
    lat, bw = latency_bandwidth("allreduce", "ring", "Simple", topo)
    assert lat == pytest.approx(8.4 + 14 * 3.4) and bw == pytest.approx(360 * 8 / 14)
    lat, bw = latency_bandwidth("allreduce", "nvls", "Simple", topo)
    assert lat == 25.0 and bw == pytest.approx(8 * 40 * 0.85 * 7 / 8 * 2 * 8 / 14)
    assert latency_bandwidth("allreduce", "nvls", "LL", topo) == (0.0, 0.0)  # Simple only


def test_selection_by_size_like_nccl_and_overrides_like_nccl_algo():
    topo = topology(group_of(dgx_h100(1)))
    small = select("allreduce", 1024, topo)
    large = select("allreduce", 2**30, topo)
    assert small[:2] == ("ring", "LL") and large[:2] == ("nvls", "Simple")
    only_ring = select("allreduce", 2**30, topo, parse_choice("ring", ("ring", "nvls"), "algo"))
    assert only_ring[0] == "ring"
    assert parse_choice("^LL128", ("LL", "LL128", "Simple"), "proto") == {"LL", "Simple"}
    with pytest.raises(ValueError, match="no algorithm/protocol available"):
        select("allreduce", 1024, topo, frozenset({"pat"}))
    with pytest.raises(ValueError, match="textbook algorithm: pass protocol='alpha-beta'"):
        parse_choice("hierarchical", ("ring", "tree"), "algo")
    # PAT is NCCL's choice only with one GPU per node; CollNet only with SHARP switches
    dp = strided_group(dgx_h100(8), 8, 8)
    assert plan_collective("allgather", 2**26, dp).algorithm in ("pat", "ring")
    with pytest.raises(ValueError, match="no algorithm"):
        plan_collective("allreduce", 2**26, group_of(dgx_h100(4)), "collnet_chain")
    sharp = Cluster("H100-SXM", 4, 8, "nvlink4", "ib-ndr", in_network_reduction=True)
    assert plan_collective("allreduce", 2**30, group_of(sharp), "collnet_chain").nic_load > 0


def test_the_tuner_keeps_a_communicators_tables_and_forgets_them_on_request():
    """``select`` reads NCCL's (latency, bandwidth) of the pairs with a bandwidth from one
    table per (collective, communicator), the numbers ``latency_bandwidth`` gives
    (``supported_pairs``); its pick and estimate are a fresh ``estimate_us``'s minimum, ties
    to the lower index, under any NCCL_ALGO / NCCL_PROTO restriction; ``clear_cache`` leaves
    every cache empty, as a fresh process has them (``--speed``'s first calls)."""
    topo = topology(group_of(dgx_a100(2)))
    pairs = supported_pairs("allreduce", topo)
    assert pairs is supported_pairs("allreduce", topo)
    every = {(a, p): latency_bandwidth("allreduce", a, p, topo) for a in ALGOS for p in PROTOS}
    assert pairs == tuple((a, p, *every[a, p]) for a in ALGOS for p in PROTOS
                          if every[a, p][1] > 0)
    assert 0 < len(pairs) < len(every)
    for a, p, _, bw in pairs:  # a call's own channels, priced
        assert bandwidth_GBps("allreduce", a, p, topo, topo.ring_channels, topo.bw_intra,
                              topo.bw_inter) == bw
        assert bandwidth_GBps("allreduce", a, p, topo, 3, 7.5, 7.5, ll_cap=False) == \
            latency_bandwidth("allreduce", a, p, replace(topo, ring_channels=3, bw_intra=7.5,
                                                         bw_inter=7.5), ll_cap=False)[1]
    restrictions = [(frozenset(ALGOS), frozenset(PROTOS)), (frozenset({"ring"}),
                    frozenset(PROTOS)), (frozenset(ALGOS), frozenset({"LL128", "Simple"})),
                    (frozenset({"tree", "nvls"}), frozenset({"Simple"}))]
    for cluster in (dgx_a100(2), dgx_h100(1), dgx_h100(4), pcie_box(2, nics_per_node=2)):
        topo = topology(group_of(cluster))
        for func in ("allreduce", "allgather", "reduce_scatter", "broadcast"):
            for algos, protos in restrictions:
                for size in (64, 1024, 100_000, 2**20, 3 * 2**24, 2**30, 8 * 2**30):
                    fresh = [(estimate_us(func, size, a, p, topo), i, j)
                             for i, a in enumerate(ALGOS) for j, p in enumerate(PROTOS)
                             if a in algos and p in protos]
                    fresh = [x for x in fresh if x[0] >= 0]
                    if not fresh:
                        with pytest.raises(ValueError, match="no algorithm/protocol"):
                            select(func, size, topo, algos, protos)
                        continue
                    t, i, j = min(fresh)
                    assert select(func, size, topo, algos, protos) == (ALGOS[i], PROTOS[j], t)
    plan_collective("allreduce", 2**20, group_of(dgx_a100(2)))
    clear_cache()
    assert supported_pairs.cache_info().currsize == 0
    assert _topology_of.cache_info().currsize == 0 and _plan_cached.cache_info().currsize == 0


def test_strided_groups_equal_listed_groups():
    c = dgx_h100(16)
    for size, stride in [(16, 8), (64, 2), (4, 1), (32, 4)]:
        assert strided_group(c, size, stride) == group_of(c, range(0, size * stride, stride))


# -- the NCCL model -------------------------------------------------------------------------
def test_large_messages_reach_the_published_plateaus():
    S = 8 * 2**30
    assert estimate_collective("allreduce", S, dgx_a100(1)).busbw_Bps == pytest.approx(
        230e9, rel=0.05)  # NCCL maintainers: ~230 GB/s on 8 A100
    ring = estimate_collective("allreduce", S, dgx_h100(1), "ring")
    assert ring.busbw_Bps == pytest.approx(370e9, rel=0.05)  # ~370 with NCCL_ALGO=Ring
    nvls = estimate_collective("allreduce", S, dgx_h100(1))
    assert nvls.algorithm == "nvls" and nvls.busbw_Bps == pytest.approx(480e9, rel=0.05)


def test_costs_scale_the_right_way():
    g = group_of(dgx_h100(4))
    times = [plan_collective("allreduce", s, g).time_s for s in (2**10, 2**20, 2**30)]
    assert times == sorted(times)
    # a PCIe box's one NIC per node carries what eight NICs carry on a DGX
    box = pcie_box(2)
    assert plan_collective("allreduce", 2**30, group_of(box)).time_s > \
        plan_collective("allreduce", 2**30, group_of(dgx_a100(2))).time_s
    # line rate is never slower than NCCL-achieved bandwidth
    c = dgx_a100(2)
    assert estimate_collective("allreduce", 2**30, c, achieved=False).time_s <= \
        estimate_collective("allreduce", 2**30, c).time_s


# -- more bandwidth is never slower (issue property 6) --------------------------------------
@pytest.mark.parametrize("make, nodes", [(dgx_a100, 2), (dgx_h100, 16), (pcie_box, 16),
                                         (SYSTEMS["jean-zay-a100"], 4)])
@pytest.mark.parametrize("factor", [1.25, 2.0])
def test_faster_links_never_slow_a_collective_of_fixed_algorithm_and_protocol(make, nodes,
                                                                              factor):
    """Faster links give NCCL's search more channels at a lower speed each (8 x 24 GB/s ->
    16 x 15 GB/s on two DGX A100 at 1.25x); a channel's own rate, LL's ceiling on the sum and
    the fill at the channel's rate keep every (algorithm, protocol) at least as fast.  The
    model before (bandwidth as a fraction of the communicator's channels, fill at the capped
    rate) made a 4 MiB Tree/LL all-reduce on two DGX A100 20 % slower at 2x."""
    base = make(nodes)
    slow_group, fast_group = group_of(base), group_of(links_times(base, factor))
    checked = 0
    for op in ("allreduce", "allgather", "reduce_scatter"):
        for nbytes in (2.0 ** k for k in range(10, 33, 2)):
            for algorithm in ALGOS:
                for protocol in PROTOS:
                    try:
                        slow = plan_collective(op, nbytes, slow_group, algorithm, protocol)
                    except ValueError:
                        continue
                    fast = plan_collective(op, nbytes, fast_group, algorithm, protocol)
                    assert fast.time_s <= slow.time_s * (1 + 1e-9), (op, nbytes, algorithm,
                                                                     protocol)
                    checked += 1
    assert checked >= 3 * 12 * 4  # ring and tree in three protocols at least


def test_a_channel_runs_at_its_own_rate_whatever_the_links():
    """A small call on few channels: its bandwidth is its channels' rate, not a share of the
    communicator's; so a 64 KiB Ring/LL all-reduce on one channel moves at the same rate on
    links twice as fast (the search then gives 32 channels instead of 16)."""
    base = dgx_a100(2)
    slow = plan_collective("allreduce", 64 << 10, group_of(base), "ring", "LL")
    fast = plan_collective("allreduce", 64 << 10, group_of(links_times(base, 2.0)), "ring",
                           "LL")
    assert slow.channels == fast.channels == 1
    assert fast.cap_Bps == pytest.approx(slow.cap_Bps, rel=1e-12)
    # and LL's ceiling (llMaxBws) caps the sum of many channels
    big = plan_collective("allreduce", 1 << 30, group_of(base), "ring", "LL")
    _, ll_max = latency_bandwidth("allreduce", "ring", "LL", _topology_of(group_of(base)))
    assert big.cap_Bps == pytest.approx(ll_max * 1e9, rel=1e-12)



# -- a network transport slower than its port (Omni-Path on Jean Zay) -------------------------
def _jean_zay(nodes: int = 4, channels: int | None = 2, port: float = 1.0,
              per_channel: float | None = 2.54e9) -> Cluster:
    opa = link("opa-100")
    opa = replace(opa, bandwidth_Bps=opa.bandwidth_Bps * port, nccl_Bps=opa.nccl_Bps * port,
                  nccl_channel_Bps=per_channel)
    return Cluster("A100-80GB", nodes, 8, "nvlink3", opa, 4, nccl_net_channels=channels)


def test_a_channel_limited_network_scales_with_channels_not_with_the_port():
    """BigScience's logs: 2 channels on the A100 nodes reached busbw 5.07 GB/s, 4 on the V100
    nodes 10.6, on the same 100 Gb/s ports.  So twice the channels give twice the busbw, a port
    twice as fast gives nothing, and with neither limit the same all-reduce would run at the
    four ports' rate, some 9 times faster."""
    def busbw_GBps(cluster: Cluster) -> float:
        return estimate_collective("allreduce", 4e9, cluster).busbw_Bps / 1e9

    two = busbw_GBps(_jean_zay())
    assert two == pytest.approx(5.08, abs=0.02)
    assert busbw_GBps(_jean_zay(channels=4)) == pytest.approx(2 * two, rel=0.01)
    assert busbw_GBps(_jean_zay(port=2.0)) == pytest.approx(two, rel=1e-6)
    # without the channel limit one channel fills a port; labsim's own search would use four
    assert busbw_GBps(_jean_zay(per_channel=None)) > 2 * two
    assert busbw_GBps(_jean_zay(channels=None, per_channel=None)) > 8 * two


def test_the_channel_rate_is_what_the_jean_zay_log_gives():
    """opa-100's ``nccl_channel_Bps`` is the benchmark's per-channel busbw: 4 GB x 2 x 31/32
    over 1.529 s, over 2 channels (the latency is a few microseconds of 1.5 s)."""
    point = next(c for c in nccl_tests() if c.id == "bigscience_jeanzay_a100_4node_opa")
    ((size, t, _),) = point.points
    assert (point.role, point.gpus, point.cluster.nccl_net_channels) == ("calibration", 32, 2)
    per_channel = size * 2 * 31 / 32 / t / 2
    assert link("opa-100").nccl_channel_Bps == pytest.approx(per_channel, rel=0.005)


def test_set_channels_apply_to_communicators_across_nodes_only():
    """``nccl_net_channels`` is what the log showed for communicators spanning nodes; one
    node's communicator (tensor parallelism over NVLink) keeps the search's channels."""
    jz, free = _jean_zay(), _jean_zay(channels=None)
    assert topology(group_of(jz)).channels == 2
    assert topology(group_of(jz)).ring_channels == 1
    assert topology(group_of(free)).channels > 2
    assert topology(group_of(jz, 8)) == topology(group_of(free, 8))
    one = plan_collective("allreduce", 1 << 30, group_of(jz, 8))
    assert one.time_s == plan_collective("allreduce", 1 << 30, group_of(free, 8)).time_s


def test_a_send_across_nodes_gets_one_channel_and_its_rate():
    """NCCL 2.10 gives a remote peer one p2p channel (``paths.cc``, ncclTopoGetNchannels):
    a pipeline send between nodes moves at one channel's rate; inside a node it does not."""
    jz = _jean_zay()
    cross = plan_collective("sendrecv", 1 << 30, group_of(jz, [0, 8]))
    assert cross.bandwidth_Bps == pytest.approx(2.54e9)
    inside = plan_collective("sendrecv", 1 << 30, group_of(jz, [0, 1]))
    assert inside.cap_Bps == math.inf and inside.bandwidth_Bps > 100e9
    assert plan_collective("sendrecv", 1 << 30, group_of(_jean_zay(per_channel=None),
                                                         [0, 8])).cap_Bps == math.inf


def test_both_faces_agree_on_a_channel_limited_network():
    jz = _jean_zay()
    for op, nbytes in (("allreduce", 4e9), ("allgather", 1e9), ("reduce_scatter", 64e6),
                       ("allreduce", 1e5)):
        est = estimate_collective(op, nbytes, jz)
        sim = simulate_collective(op, nbytes, jz)
        assert sim.time_s == pytest.approx(est.time_s, rel=1e-6), (op, nbytes)


@pytest.mark.parametrize("bad", [0, 65, 2.5, True, "2"])
def test_nccl_net_channels_must_be_a_channel_count(bad):
    with pytest.raises(ValueError, match="nccl_net_channels"):
        Cluster("A100-80GB", 2, 8, "nvlink3", "opa-100", 4, nccl_net_channels=bad)


@pytest.mark.parametrize("bad", [0.0, -1e9, math.nan, math.inf, "fast"])
def test_a_link_channel_rate_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="nccl_channel_Bps"):
        replace(link("opa-100"), nccl_channel_Bps=bad)


def test_only_a_nic_has_a_channel_rate():
    with pytest.raises(ValueError, match="nccl_channel_Bps is a NIC's limit"):
        replace(link("nvlink3"), nccl_channel_Bps=2.5e9)


def test_nvls_reads_its_own_graph_not_the_rings():
    """NCCL's NVLS and NVLS-Tree read the NVLS graph (``graphs[]`` of ncclTopoTuneModel): a
    head at the fastest speed the NVLink carries over the heads, its NIC at the fastest the
    NIC carries.  Faster links that give the ring more, slower channels (45 -> 30 GB/s each on
    four DGX H100 at 1.25x) leave NVLS-Tree's NIC speed where it was."""
    four = dgx_h100(4)
    t = topology(group_of(four))
    assert (t.nvls_heads, t.nvls_bw, t.nvls_bw_inter) == (8, 40.0, 48.0)
    assert topology(group_of(dgx_h100(1), 4)).nvls_bw == 60.0  # 4 heads share the NVLink less
    fast = topology(group_of(links_times(four, 1.25)))
    assert fast.bw_inter < t.bw_inter and fast.nvls_bw_inter >= t.nvls_bw_inter
    assert topology(group_of(dgx_a100(2))).nvls_heads == 0  # no NVLS before Hopper


def test_what_one_rank_sends_in_each_spelling() -> None:
    """One table of the ring's share (labsim.collectives.bandwidth.sent_factor), read by the
    ZeRO-1 check (c10d operator names) and lab 09's bytes table (recorder kinds)."""
    from labsim.collectives.bandwidth import sent_factor

    for ops, share in ((("c10d::allreduce_", "all_reduce", "allreduce"), 1.5),
                       (("c10d::_reduce_scatter_base_", "c10d::reduce_scatter_tensor_coalesced_",
                         "reduce_scatter", "c10d::allgather_into_tensor_coalesced_",
                         "c10d::_allgather_base_", "all_gather", "c10d::broadcast_",
                         "c10d::alltoall_base_", "all_to_all", "c10d::scatter_", "gather"),
                        0.75),
                       (("c10d::send", "send"), 1.0)):
        assert {op: sent_factor(op, 4) for op in ops} == dict.fromkeys(ops, share)
    assert sent_factor("c10d::recv_", 4) is sent_factor("barrier", 4) is None
    assert sent_factor("all_reduce", 2) == 1.0 and sent_factor("all_gather", 8) == 7 / 8
