"""nccl-tests' bandwidth definitions (``doc/PERFORMANCE.md``): algorithm bandwidth S / t and
bus bandwidth, algbw times a factor per operation that makes it comparable with a link's peak
whatever the rank count.  Both faces of the collective model (``cost``'s closed forms and
``estimate``'s NCCL model) report them.
"""

from __future__ import annotations

import math

from labsim.collectives.schedule import normalize

__all__ = ["algbw", "busbw", "busbw_factor"]


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
