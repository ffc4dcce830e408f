"""Collective algorithms as data: which rank sends how many bytes to whom, step by step.

A schedule is a sequence of ``Step``; a step is a set of transfers that start together and
must all finish before the next step starts (the ranks of these algorithms move in
lockstep: a ring's step ``s`` on rank ``r`` needs what rank ``r-1`` sent in step ``s-1``).
The closed forms (``labsim.collectives``) sum the steps' times; the simulator
(``labsim.sim.collectives``) executes them over shared links.  Transfers of one step that
share the same sender/receiver pairs share one ``Pattern`` object, so their routes and rates
are computed once.

Buffers are split at byte granularity like ``numpy.array_split``: ``S`` bytes into ``p``
chunks gives ``S % p`` chunks of ``ceil(S/p)`` bytes and the rest of ``floor(S/p)``, so
sizes that do not divide evenly are exact.  Algorithms follow Thakur, Rabenseifner & Gropp,
"Optimization of collective communication operations in MPICH" (IJHPCA 2005).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import numpy as np

from labsim.cluster import Cluster

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall")
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical"),
    "reduce_scatter": ("ring", "recursive_halving"),
    "allgather": ("ring", "recursive_doubling"),
    "broadcast": ("ring", "tree"),
    "alltoall": ("pairwise",),
}
ALIASES = {"halving_doubling": "rabenseifner", "binomial": "tree", "pipeline": "ring",
           "chain": "ring"}
POWER_OF_TWO = ("recursive_doubling", "rabenseifner", "recursive_halving")
# NCCL's default NCCL_BUFFSIZE is 4 MiB, split into NCCL_STEPS = 8 slots: a pipelined step
# moves 512 KiB (NCCL src/include/device.h, src/init.cc).  Used to cut a broadcast into pieces.
PIPELINE_BYTES = 4 * 2**20 // 8


def normalize(op: str, algorithm: str, n: int, nbytes: float) -> tuple[str, str]:
    """Validate ``op``/``algorithm``/``n``/``nbytes``; return canonical names or raise."""
    if not isinstance(op, str):
        raise ValueError(f"op must be a collective's name ({', '.join(OPS)}), got {op!r}")
    op_key = op.lower().replace("-", "_")
    op_key = {"all_reduce": "allreduce", "all_gather": "allgather", "all_to_all": "alltoall",
              "reducescatter": "reduce_scatter"}.get(op_key, op_key)
    if op_key not in OPS:
        raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(OPS)}")
    if not isinstance(algorithm, str):
        raise ValueError(f"algorithm must be a name ({', '.join(ALGORITHMS[op_key])}), got "
                         f"{algorithm!r}")
    algo = ALIASES.get(algorithm.lower(), algorithm.lower())
    if op_key == "alltoall" and algo == "ring":
        algo = "pairwise"  # the rotating pairwise exchange is all-to-all's ring
    if algo not in ALGORITHMS[op_key]:
        raise ValueError(
            f"{op_key} has no algorithm {algorithm!r}; choose one of "
            f"{', '.join(ALGORITHMS[op_key])}"
        )
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"the number of ranks must be a whole number >= 1, got {n!r}")
    if algo in POWER_OF_TWO and n & (n - 1):
        raise ValueError(
            f"{algo} needs a power-of-two number of ranks, got {n}; use 'ring' (any n)"
        )
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or \
            not np.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"message size (nbytes) must be a finite number of bytes >= 0, got "
                         f"{nbytes!r}")
    if nbytes != int(nbytes):
        raise ValueError(f"message size must be a whole number of bytes, got {nbytes!r}")
    return op_key, algo


def split_sizes(total: int, parts: int) -> np.ndarray:
    """Sizes of ``numpy.array_split(range(total), parts)``: the first ``total % parts`` get one
    more byte."""
    q, r = divmod(int(total), int(parts))
    sizes = np.full(parts, q, dtype=np.int64)
    sizes[:r] += 1
    return sizes


class Pattern:
    """The sender -> receiver pairs of a step (global ranks), shared by steps alike."""

    __slots__ = ("src", "dst", "key", "routes")

    def __init__(self, src: np.ndarray, dst: np.ndarray, key: object) -> None:
        self.src = np.asarray(src, dtype=np.int64)
        self.dst = np.asarray(dst, dtype=np.int64)
        self.key = key
        self.routes: dict = {}  # cluster -> its pipes and alpha (labsim.collectives.estimate)

    def __len__(self) -> int:
        return len(self.src)


class Step:
    """Transfers ``pattern.src[i] -> pattern.dst[i]`` of ``nbytes[i]`` bytes, started
    together.  ``phase`` names the part of the algorithm ("reduce-scatter", "inter-node").

    ``nbytes`` may be given as a zero-argument function that builds the array: a ring step of
    4096 ranks knows its largest and total transfer without building 32 768 sizes, and the
    simulator builds them only when links are shared unevenly or a full trace is asked for.
    """

    __slots__ = ("pattern", "label", "phase", "max_bytes", "min_bytes", "total_bytes",
                 "_nbytes")

    def __init__(self, pattern: Pattern, nbytes: np.ndarray | Callable[[], np.ndarray],
                 label: str, phase: str, max_bytes: float | None = None,
                 total_bytes: float | None = None, min_bytes: float | None = None) -> None:
        self.pattern = pattern
        self.label = label
        self.phase = phase
        self._nbytes = nbytes
        if max_bytes is None or total_bytes is None or min_bytes is None:
            arr = self.nbytes
            max_bytes, total_bytes = float(arr.max()), float(arr.sum())
            min_bytes = float(arr.min())
        self.max_bytes = float(max_bytes)
        self.min_bytes = float(min_bytes)
        self.total_bytes = float(total_bytes)

    @property
    def nbytes(self) -> np.ndarray:
        """Bytes of each transfer (float array, built on first use)."""
        if callable(self._nbytes):
            self._nbytes = self._nbytes()
        if self._nbytes.dtype != np.float64:
            self._nbytes = self._nbytes.astype(np.float64)
        return self._nbytes

    def __len__(self) -> int:
        return len(self.pattern)

    def __repr__(self) -> str:
        return f"Step({self.label!r}, {len(self)} transfers, {self.total_bytes:g} B)"


def _ring_channels(cluster: Cluster | None, ranks: Sequence[int]) -> list[list[int]]:
    """Ring orders.  Inside one node: one ring.  Across nodes: as many rings as the group
    uses distinct NICs per node, each rotated to leave every node through a different NIC
    (what NCCL's channels do on a DGX)."""
    if cluster is None:
        return [list(ranks)]
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(cluster.node_of(r), []).append(r)
    if len(by_node) == 1:
        return [list(ranks)]
    counts = {len(v) for v in by_node.values()}
    nics = min(len({cluster.nic_of(r) for r in v}) for v in by_node.values())
    channels = nics if len(counts) == 1 else 1
    k = counts.pop() if channels > 1 else 0
    rings = []
    for c in range(channels):
        order: list[int] = []
        for node in sorted(by_node):
            local = by_node[node]
            off = c * k // channels
            order += local[off:] + local[:off]
        rings.append(order)
    return rings


def _window(ext: np.ndarray, lo: int, p: int) -> np.ndarray:
    return ext[:, lo:lo + p].ravel()


def _concat(steps: Sequence[Step]) -> np.ndarray:
    return np.concatenate([g.nbytes for g in steps])


def _ring_steps(op: str, nbytes: int, rings: list[list[int]], phase: str = "",
                ) -> Iterator[Step]:
    p = len(rings[0])
    src = np.concatenate([np.asarray(r) for r in rings])
    dst = np.concatenate([np.roll(np.asarray(r), -1) for r in rings])
    pattern = Pattern(src, dst, ("ring", len(rings), p))
    sizes = np.stack([split_sizes(part, p) for part in split_sizes(nbytes, len(rings))])
    # position i sends chunk (i - t + shift) % p: a window of the doubled size table
    ext = np.concatenate([sizes, sizes], axis=1).astype(float)
    biggest, smallest = float(sizes.max()), float(sizes.min())
    phases = {"allreduce": [("reduce-scatter", 0), ("all-gather", 1)],
              "reduce_scatter": [("reduce-scatter", 0)], "allgather": [("all-gather", 1)]}[op]
    total = (p - 1) * len(phases)
    s = 0
    for name, shift in phases:
        for t in range(p - 1):
            lo = (shift - t) % p
            # every step moves each chunk of each ring once: max and total are constant
            yield Step(pattern, partial(_window, ext, lo, p),
                       f"{phase}{name} step {s + 1}/{total}", phase or name, biggest, nbytes,
                       smallest)
            s += 1


def _tree_steps(nbytes: int, ranks: list[int], reduce: bool, bcast: bool) -> Iterator[Step]:
    """Binomial tree rooted at ``ranks[0]``: reduce towards it, then broadcast from it."""
    p = len(ranks)
    rounds = max(0, int(np.ceil(np.log2(p))))
    arr = np.asarray(ranks)
    pos = np.arange(p)
    if reduce:
        for j in range(rounds):
            d = 1 << j
            senders = pos[(pos % (2 * d)) == d]
            yield Step(Pattern(arr[senders], arr[senders - d], ("tree-up", j, p)),
                       np.full(len(senders), nbytes, dtype=np.int64),
                       f"reduce round {j + 1}/{rounds}", "reduce")
    if bcast:
        order = range(rounds - 1, -1, -1) if reduce else range(rounds)
        for idx, j in enumerate(order):
            d = 1 << j
            if reduce:
                senders = pos[((pos % (2 * d)) == 0) & (pos + d < p)]
            else:
                senders = pos[(pos < d) & (pos + d < p)]
            yield Step(Pattern(arr[senders], arr[senders + d], ("tree-down", j, p)),
                       np.full(len(senders), nbytes, dtype=np.int64),
                       f"broadcast round {idx + 1}/{rounds}", "broadcast")


def _halving_doubling_steps(nbytes: int, ranks: list[int], halve: bool, double: bool,
                            exchange_all: bool = False) -> Iterator[Step]:
    """Recursive halving (reduce-scatter) and/or doubling (all-gather), Thakur et al. 2005.
    ``exchange_all``: recursive-doubling all-reduce, every round swaps the whole buffer."""
    p = len(ranks)
    arr = np.asarray(ranks)
    pos = np.arange(p)
    lg = p.bit_length() - 1
    prefix = np.concatenate([[0], np.cumsum(split_sizes(nbytes, p))])
    if exchange_all:
        for j in range(lg):
            yield Step(Pattern(arr, arr[pos ^ (1 << j)], ("xor", 1 << j, p)),
                       np.full(p, nbytes, dtype=np.int64),
                       f"exchange round {j + 1}/{lg}", "recursive doubling")
        return
    if halve:
        for j in range(lg):
            d = p >> (j + 1)
            partner = pos ^ d
            lo = partner & ~(d - 1)  # the half the partner keeps: blocks [lo, lo + d)
            yield Step(Pattern(arr, arr[partner], ("xor", d, p)), prefix[lo + d] - prefix[lo],
                       f"halving round {j + 1}/{lg}", "reduce-scatter")
    if double:
        for j in range(lg):
            d = 1 << j
            lo = pos & ~(d - 1)  # what this rank holds: blocks [lo, lo + d)
            yield Step(Pattern(arr, arr[pos ^ d], ("xor", d, p)), prefix[lo + d] - prefix[lo],
                       f"doubling round {j + 1}/{lg}", "all-gather")


def _chain_steps(nbytes: int, ranks: list[int], piece_bytes: int) -> Iterator[Step]:
    """Pipelined chain broadcast from ``ranks[0]``: the buffer cut into pieces of at most
    ``piece_bytes`` that flow down the chain, one hop per step."""
    p = len(ranks)
    k = max(1, -(-nbytes // piece_bytes))
    pieces = split_sizes(nbytes, k)
    arr = np.asarray(ranks)
    total = p + k - 2
    patterns: dict[tuple[int, int], Pattern] = {}
    for s in range(total):
        lo, hi = max(0, s - k + 1), min(s, p - 2)  # hops i carry piece s - i
        if (lo, hi) not in patterns:
            hops = np.arange(lo, hi + 1)
            patterns[(lo, hi)] = Pattern(arr[hops], arr[hops + 1], ("chain", lo, hi, p))
        hops = np.arange(lo, hi + 1)
        yield Step(patterns[(lo, hi)], pieces[s - hops], f"pipeline step {s + 1}/{total}",
                   "broadcast")


def _pairwise_steps(nbytes: int, ranks: list[int]) -> Iterator[Step]:
    """All-to-all by pairwise exchange: in step k rank i sends its block for i+k."""
    p = len(ranks)
    arr = np.asarray(ranks)
    pos = np.arange(p)
    blocks = split_sizes(nbytes, p)
    for k in range(1, p):
        to = (pos + k) % p
        yield Step(Pattern(arr, arr[to], ("shift", k, p)), blocks[to],
                   f"exchange step {k}/{p - 1}", "all-to-all")


def _parallel_rings(op: str, sizes: Sequence[int], rings: list[list[int]], phase: str,
                    ) -> Iterator[Step]:
    """Independent rings at once (one per node, or one per local index), ring ``j`` reducing
    its own ``sizes[j]`` bytes: their steps advance together as one step."""
    per_ring = [list(_ring_steps(op, int(sizes[j]), [rings[j]], phase))
                for j in range(len(rings))]
    src = np.concatenate([np.asarray(r) for r in rings])
    dst = np.concatenate([np.roll(np.asarray(r), -1) for r in rings])
    pattern = Pattern(src, dst, (phase, op, len(rings), len(rings[0])))
    for group in zip(*per_ring):
        yield Step(pattern, partial(_concat, group), group[0].label, phase.strip(),
                   max(g.max_bytes for g in group), sum(g.total_bytes for g in group),
                   min(g.min_bytes for g in group))


def _hierarchical_steps(nbytes: int, ranks: list[int], cluster: Cluster) -> Iterator[Step]:
    """Intra-node ring reduce-scatter (every node at once), inter-node ring all-reduce of each
    shard (one ring per local index, all at once), intra-node ring all-gather."""
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(cluster.node_of(r), []).append(r)
    if len({len(v) for v in by_node.values()}) != 1:
        raise ValueError("hierarchical all-reduce needs the same number of ranks on each node")
    nodes = sorted(by_node)
    k = len(by_node[nodes[0]])
    local_rings = [by_node[n] for n in nodes]
    if k > 1:
        yield from _parallel_rings("reduce_scatter", [nbytes] * len(nodes), local_rings,
                                   "intra-node ")
    if len(nodes) > 1:
        # after the reduce-scatter, local rank j holds shard (j + 1) % k of the buffer
        shards = split_sizes(nbytes, k)
        owned = [int(shards[(j + 1) % k]) if k > 1 else nbytes for j in range(k)]
        rings = [[by_node[n][j] for n in nodes] for j in range(k)]
        yield from _parallel_rings("allreduce", owned, rings, "inter-node ")
    if k > 1:
        yield from _parallel_rings("allgather", [nbytes] * len(nodes), local_rings,
                                   "intra-node ")


def schedule(op: str, nbytes: float, ranks: Sequence[int], algorithm: str = "ring",
             cluster: Cluster | None = None, piece_bytes: int = PIPELINE_BYTES,
             ) -> Iterator[Step]:
    """The steps of ``op`` on ``nbytes`` over ``ranks`` (nccl-tests sizes: the whole buffer,
    for reduce-scatter the input, for all-gather the output).  Nothing to do (one rank or
    zero bytes) yields no step."""
    ranks = [int(r) for r in ranks]
    op, algo = normalize(op, algorithm, len(ranks), nbytes)
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be distinct, got {ranks}")
    nbytes = int(nbytes)
    if len(ranks) == 1 or nbytes == 0:
        return iter(())
    if algo == "ring" and op != "broadcast":
        return _ring_steps(op, nbytes, _ring_channels(cluster, ranks))
    if algo == "ring":
        return _chain_steps(nbytes, ranks, int(piece_bytes))
    if algo == "tree":
        return _tree_steps(nbytes, ranks, reduce=op == "allreduce", bcast=True)
    if algo == "recursive_doubling":
        return _halving_doubling_steps(nbytes, ranks, False, True, op == "allreduce")
    if algo == "recursive_halving":
        return _halving_doubling_steps(nbytes, ranks, True, False)
    if algo == "rabenseifner":
        return _halving_doubling_steps(nbytes, ranks, True, True)
    if algo == "pairwise":
        return _pairwise_steps(nbytes, ranks)
    if cluster is None:
        raise ValueError("hierarchical all-reduce needs a cluster: use "
                         "estimate_collective or simulate_collective")
    return _hierarchical_steps(nbytes, ranks, cluster)
