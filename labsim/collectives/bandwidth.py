"""nccl-tests' bandwidth definitions (``doc/PERFORMANCE.md``): algorithm bandwidth S / t and
bus bandwidth, algbw times a factor per operation that makes it comparable with a link's peak
whatever the rank count.  Both faces of the collective model (``cost``'s closed forms and
``estimate``'s NCCL model) report them.
"""

from __future__ import annotations

import math

from labsim.collectives.schedule import normalize

__all__ = ["algbw", "busbw", "busbw_factor", "sent_factor"]

# what one rank sends, as a fraction of the collective's size S, when the collective moves its
# bytes the bandwidth-optimal way (a ring or a chain), averaged over the ranks
_SENT: dict[str, object] = {
    "allreduce": lambda n: 2 * (n - 1) / n,  # reduce-scatter, then all-gather
    "reduce_scatter": lambda n: (n - 1) / n,  # S: the input
    "allgather": lambda n: (n - 1) / n,  # S: the output
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,  # every rank but the last passes S on
    "reduce": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
}
_ALIASES = {"all_reduce": "allreduce", "all_gather": "allgather", "all_to_all": "alltoall",
            "reducescatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
            "_allgather_base": "allgather", "allgather_into_tensor_coalesced": "allgather",
            "reduce_scatter_tensor_coalesced": "reduce_scatter", "alltoall_base": "alltoall"}


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


def sent_factor(op: str, n: int) -> float | None:
    """Bytes one of ``n`` ranks sends per byte of the collective (S: an all-gather's output, a
    reduce-scatter's input), moved the bandwidth-optimal way and averaged over the ranks: an
    all-reduce 2(n-1)/n, a reduce-scatter, all-gather, all-to-all, broadcast, reduce, scatter
    or gather (n-1)/n (broadcasting each shard from its owner costs what one all-gather does),
    a send 1; None for what sends nothing (receives, barriers).  ``op`` is a collective's name
    in nccl-tests', ``torch.distributed``'s or a ``c10d::`` operator's spelling
    (``"c10d::allreduce_"``, ``"all_gather"``, ``"_reduce_scatter_base"``)."""
    name = op.removeprefix("c10d::").rstrip("_") or op
    name = _ALIASES.get(name, name)
    for key in (name, name.removesuffix("_coalesced"), name.removesuffix("_into_tensor"),
                name.removesuffix("_tensor")):
        key = _ALIASES.get(key, key)
        if key in _SENT:
            return _SENT[key](n)  # type: ignore[operator]
    return None
