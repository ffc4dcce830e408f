"""Closed forms of collective communication: the alpha-beta costs a lecture derives.

``collective_time(op, nbytes, n, link, algorithm)`` is the time for ``n`` ranks, each with a
port of ``link`` into one non-blocking switch, alpha = ``link.latency_s`` per step and
beta = 1 / bandwidth (Thakur, Rabenseifner & Gropp, IJHPCA 2005; ``reference.md``)::

    ring all-reduce            2(p-1) (alpha + ceil(S/p) beta)       = 2(p-1)alpha + 2(p-1)/p S beta
    ring reduce-scatter, all-gather, pairwise all-to-all
                               (p-1) (alpha + ceil(S/p) beta)
    binomial-tree all-reduce   2 ceil(lg p) (alpha + S beta)   (reduce, then broadcast)
    recursive doubling         lg p (alpha + S beta)                 (power-of-two p)
    Rabenseifner (halving + doubling)  2 lg p alpha + 2(p-1)/p S beta  (power-of-two p)
    pipelined chain broadcast  (p+k-2) alpha + (S + (p-2) ceil(S/k)) beta,  k = ceil(S/512 KiB)
    binomial-tree broadcast    ceil(lg p) (alpha + S beta)

``S`` is the nccl-tests size (the whole buffer; for reduce-scatter the input, for all-gather
the output, for all-to-all what one rank sends in total).  Chunks are whole bytes, so when
``p`` does not divide ``S`` the biggest chunk, ``ceil(S/p)``, sets the pace of every step.

**Which bandwidth.** ``achieved=True`` (the default) uses what NCCL really reaches on the link
(``Link.achieved_Bps``: ~230 of 300 GB/s on A100 NVLink), so predictions match measurements;
``achieved=False`` uses the line rate, the textbook bound.  The simulator takes the same flag.

**On a cluster** (``collective_time_on``) the group may span nodes: the same algorithms run
over the cluster's network model (``labsim.cluster``), where flows share links.  This is what
a training-step model should call for tensor-parallel (inside a node) and data-parallel
(across nodes) traffic::

    tp_group = range(0, 8)                        # one DGX node
    dp_group = range(0, cluster.world_size, 8)    # local GPU 0 of every node
    t_tp = collective_time_on(cluster, "allreduce", 2 * b * s * h, tp_group)
    t_dp = collective_time_on(cluster, "allreduce", 2 * params / tp, dp_group)

It times one collective alone on the network; concurrent collectives that share NICs (all
eight DP groups of a DGX at once) need the simulator (``labsim.sim``), or the bandwidth
shares in ``Cluster.nic_Bps_per_gpu``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np

from labsim.cluster import Cluster
from labsim.collectives.schedule import (
    ALGORITHMS,
    OPS,
    PIPELINE_BYTES,
    normalize,
    schedule,
)
from labsim.hardware import Link, link
from labsim.network import PatternRates, steps_time

__all__ = ["ALGORITHMS", "OPS", "algbw", "busbw", "busbw_factor", "collective_lower_bound",
           "crossover_bytes",
           "collective_time", "collective_time_on"]


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (``doc/PERFORMANCE.md``): all-reduce 2(n-1)/n;
    reduce-scatter, all-gather, all-to-all (n-1)/n; broadcast 1.  busbw = algbw x factor is
    the bandwidth each rank's link sustains, comparable with the hardware's peak."""
    op, _ = normalize(op, "ring" if op != "alltoall" else "pairwise", max(n, 1), 0)
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "allgather", "alltoall"):
        return (n - 1) / n
    return 1.0


def algbw(nbytes: float, time_s: float) -> float:
    """Algorithm bandwidth S / t in bytes/s (nccl-tests); inf for a zero-time operation."""
    return nbytes / time_s if time_s > 0 else math.inf


def busbw(op: str, nbytes: float, n: int, time_s: float) -> float:
    """Bus bandwidth algbw x ``busbw_factor(op, n)`` in bytes/s (nccl-tests)."""
    return algbw(nbytes, time_s) * busbw_factor(op, n)


def _alpha_beta(lk: Link | str, achieved: bool) -> tuple[float, float]:
    lk = link(lk)
    return lk.latency_s, 1.0 / (lk.achieved_Bps if achieved else lk.bandwidth_Bps)


def collective_time(op: str, nbytes: float, n: int, link: Link | str,
                    algorithm: str = "ring", *, achieved: bool = True,
                    piece_bytes: int = PIPELINE_BYTES) -> float:
    """Seconds for ``op`` on ``nbytes`` among ``n`` ranks behind one switch of ``link`` ports.

    ``algorithm``: see ``ALGORITHMS[op]``; power-of-two algorithms raise ValueError for other
    ``n``.  ``piece_bytes`` is the pipelining unit of the chain broadcast.
    """
    op, algo = normalize(op, algorithm, n, nbytes)
    if algo == "hierarchical":
        raise ValueError("hierarchical all-reduce needs a cluster (nodes x GPUs): use "
                         "collective_time_on(cluster, ...)")
    a, b = _alpha_beta(link, achieved)
    S, p = int(nbytes), int(n)
    if p == 1 or S == 0:
        return 0.0
    chunk = -(-S // p)
    lg = math.ceil(math.log2(p))
    q, r = divmod(S, p)
    doubling = sum(a + b * (d * q + min(d, r)) for d in (1 << j for j in range(lg)))
    if algo == "ring" and op == "allreduce":
        return 2 * (p - 1) * (a + chunk * b)
    if algo in ("ring", "pairwise") and op != "broadcast":
        return (p - 1) * (a + chunk * b)
    if algo == "ring":  # pipelined chain broadcast
        k = max(1, -(-S // int(piece_bytes)))
        return (p + k - 2) * a + (S + (p - 2) * -(-S // k)) * b
    if algo == "tree":
        return (2 if op == "allreduce" else 1) * lg * (a + S * b)
    if algo == "recursive_doubling" and op == "allreduce":
        return lg * (a + S * b)
    if algo in ("recursive_doubling", "recursive_halving"):
        return doubling
    return 2 * doubling  # rabenseifner


def collective_lower_bound(op: str, nbytes: float, n: int, link: Link | str, *,
                           achieved: bool = True) -> float:
    """No algorithm can be faster: one latency plus the bytes each rank must move through its
    port (all-reduce 2(n-1)/n S, reduce-scatter/all-gather/all-to-all (n-1)/n S, broadcast S;
    Patarasuk & Yuan 2009 for all-reduce)."""
    op, _ = normalize(op, "ring" if op != "alltoall" else "pairwise", n, nbytes)
    a, b = _alpha_beta(link, achieved)
    if n == 1 or nbytes == 0:
        return 0.0
    return a + busbw_factor(op, n) * nbytes * b


def group_ranks(cluster: Cluster, ranks: Iterable[int] | int | None) -> list[int]:
    if ranks is None:
        return list(range(cluster.world_size))
    if isinstance(ranks, (int, np.integer)):
        if not 1 <= ranks <= cluster.world_size:
            raise ValueError(f"group of {ranks} ranks on a {cluster.world_size}-GPU cluster")
        return list(range(int(ranks)))
    out = [int(r) for r in ranks]
    for r in out:
        cluster.node_of(r)  # range check
    if not out:
        raise ValueError("a collective needs at least one rank")
    return out








def collective_time_on(cluster: Cluster, op: str, nbytes: float,
                       ranks: Sequence[int] | int | None = None, algorithm: str = "ring", *,
                       achieved: bool = True, piece_bytes: int = PIPELINE_BYTES) -> float:
    """Seconds for ``op`` among ``ranks`` (default: all; an int n: ranks 0..n-1) of
    ``cluster``, alone on its network.

    A group inside one node uses the ``intra_node`` link; a group across nodes goes through
    the NICs, and a ring then runs one channel per NIC the group can use (as NCCL does).
    Each step lasts its largest latency plus its slowest transfer at max-min fair rates;
    inside one node with one ring this equals ``collective_time`` exactly.
    """
    group = group_ranks(cluster, ranks)
    steps = schedule(op, nbytes, group, algorithm, cluster, piece_bytes)
    return steps_time(steps, PatternRates(cluster, achieved))


assert set(OPS) == set(ALGORITHMS)


def crossover_bytes(op: str, n: int, link: Link | str, small: str = "tree",
                    large: str = "ring", *, achieved: bool = True,
                    max_bytes: float = 2**40) -> float:
    """The smallest size at which ``large`` is at least as fast as ``small`` (whole bytes,
    by bisection on the closed forms); inf if ``small`` wins up to ``max_bytes``.

    For all-reduce over p ranks, binomial tree vs ring: the tree's 2 lg p latencies beat the
    ring's 2(p-1) for small S, its 2 lg p S beta loses to the ring's 2(p-1)/p S beta for large S.
    """
    def large_wins(s: int) -> bool:
        return collective_time(op, s, n, link, large, achieved=achieved) <= \
            collective_time(op, s, n, link, small, achieved=achieved)

    hi = int(max_bytes)
    if not large_wins(hi):
        return math.inf
    lo = 1
    if large_wins(lo):
        return 1.0
    while hi - lo > 1:  # large loses at lo, wins at hi
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if large_wins(mid) else (mid, hi)
    return float(hi)


_WIRE_FACTOR = {"allreduce": 2.0, "reduce_scatter": 1.0, "allgather": 1.0}


def collective_s(op: str, nbytes: float, n: int, link: Link) -> float:
    """Closed-form ring collective time (``labsim.collectives``); zero for a group of one."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return collective_time(op, int(round(nbytes)), n, link)


def wire_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes each GPU sends in a ring collective of an ``nbytes`` buffer over ``n`` GPUs."""
    return _WIRE_FACTOR[op] * (n - 1) / n * nbytes if n > 1 else 0.0


def group_link(cluster: Cluster, size: int, stride: int) -> Link:
    """The link a ring over ``size`` GPUs whose ranks are ``stride`` apart runs at.

    Inside one node: the intra-node link.  Across nodes: NCCL runs one ring channel per NIC
    the group's GPUs in a node use, so the inter-node bandwidth is that many NICs (capped by
    the intra-node link).  Equals ``labsim.collectives.collective_time_on`` on the group's
    ranks for ring collectives (tested) at O(1) cost, so the cost of simulating a step does
    not grow with dp.
    """
    g = cluster.gpus_per_node
    if (size - 1) * stride + 1 <= g:
        return cluster.intra_node
    local = list(range(0, g, stride))[:size] if stride < g else [0]
    nics = len({i * cluster.nics_per_node // g for i in local})
    inter = cluster.inter_node
    cap = cluster.intra_node.achieved_Bps / inter.nccl_efficiency
    return replace(inter, bandwidth_Bps=min(nics * inter.bandwidth_Bps, cap))


