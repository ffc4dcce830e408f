"""The textbook closed forms of collective communication (alpha-beta); nccl-tests' bandwidth
definitions (``algbw``, ``busbw``, ``busbw_factor``) are ``labsim.collectives.bandwidth``'s,
re-exported here.

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
(``Link.achieved_Bps``: ~230 of 300 GB/s on A100 NVLink); ``achieved=False`` the line rate,
the textbook bound.

These are the lecture's model.  What NCCL really does on a cluster -- protocols, Ring, Tree,
NVLS, channels, per-hop latencies -- is ``labsim.collectives.nccl``;
``labsim.estimate_collective`` and ``labsim.simulate_collective`` run either model (the
textbook one with ``protocol="alpha-beta"``), and ``collective_time`` given a cluster instead
of ``n, link`` is ``estimate_collective(...).time_s``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from labsim.collectives.bandwidth import algbw, busbw, busbw_factor
from labsim.collectives.schedule import ALGORITHMS, OPS, PIPELINE_BYTES, normalize
from labsim.hardware import Link, link

if TYPE_CHECKING:
    from labsim.cluster import Cluster

__all__ = ["ALGORITHMS", "OPS", "algbw", "busbw", "busbw_factor", "collective_lower_bound",
           "collective_time", "crossover_bytes"]


def _alpha_beta(lk: Link | str, achieved: bool) -> tuple[float, float]:
    lk = link(lk)
    return lk.latency_s, 1.0 / (lk.achieved_Bps if achieved else lk.bandwidth_Bps)


def collective_time(op: str, nbytes: float, n: int | Cluster, link: Link | str | None = None,
                    algorithm: str | None = None, *, achieved: bool = True,
                    piece_bytes: int = PIPELINE_BYTES, protocol: str | None = None,
                    ranks: object = None) -> float:
    """Seconds for ``op`` on ``nbytes`` among ``n`` ranks behind one switch of ``link`` ports
    (the textbook alpha-beta forms of the module doc).

    ``algorithm``: see ``ALGORITHMS[op]`` (default ``"ring"``); power-of-two algorithms raise
    ValueError for other ``n``.  ``piece_bytes`` is the pipelining unit of the chain
    broadcast.  Given a ``Cluster`` instead of ``n`` (and no ``link``), this is
    ``labsim.estimate_collective(op, nbytes, cluster, algorithm, ranks, protocol=...)``'s time
    (the NCCL model by default).
    """
    if link is None:
        from labsim.collectives.estimate import estimate_collective

        return estimate_collective(op, nbytes, n, algorithm or "auto", ranks,
                                   protocol=protocol or "auto", achieved=achieved).time_s
    if protocol not in (None, "alpha-beta"):
        raise ValueError(f"protocol={protocol!r}: n ranks on a link have only the textbook "
                         "alpha-beta model; pass a Cluster for the NCCL protocols")
    op, algo = normalize(op, algorithm or "ring", n, nbytes)
    if algo == "hierarchical":
        raise ValueError("hierarchical all-reduce needs a cluster (nodes x GPUs): use "
                         "collective_time(op, nbytes, cluster, ...)")
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
