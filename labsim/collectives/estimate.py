"""The closed-form face of a collective on a cluster: ``estimate_collective``.

Two models, chosen by ``protocol``:

* the **NCCL model** (``protocol`` = ``"auto"``, ``"LL"``, ``"LL128"``, ``"Simple"`` or an
  ``NCCL_PROTO`` list; ``algorithm`` = ``"auto"``, ``"ring"``, ``"tree"``, ``"nvls"``,
  ``"nvls_tree"``, ``"collnet_chain"``, ``"collnet_direct"``, ``"pat"`` or an ``NCCL_ALGO``
  list): ``labsim.collectives.nccl``;
* the **textbook alpha-beta model** (``protocol="alpha-beta"``; ``algorithm`` one of
  ``labsim.collectives.ALGORITHMS[op]``, "tree" being the binomial tree): the steps of
  ``labsim.collectives.schedule``, each lasting its largest alpha plus its most loaded pipe.

``labsim.simulate_collective`` (``labsim.sim.collectives``) is the simulated face with the
same arguments and result type; alone on the network the two agree (tested).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from labsim.cluster import Cluster
from labsim.collectives.bandwidth import algbw, busbw_factor
from labsim.collectives.group import group_of
from labsim.collectives.nccl import NCCL_OPS, CollectiveCost, plan_collective
from labsim.collectives.schedule import PIPELINE_BYTES, Step, normalize, schedule
from labsim.network import collective_flow
from labsim.trace import Trace
from labsim.units import fmt_bandwidth, fmt_bytes, fmt_time

TEXTBOOK = "alpha-beta"
MAX_TRANSFERS = 50_000_000  # a textbook schedule larger than this takes minutes to simulate


@dataclass(frozen=True, repr=False)
class CollectiveResult:
    """One collective on a cluster: time, nccl-tests bandwidths, what NCCL chose, link loads.

    ``algbw_Bps`` = S / t; ``busbw_Bps`` = algbw x nccl-tests factor (all-reduce 2(n-1)/n).
    ``algorithm`` / ``protocol``: NCCL's choice (``protocol == "alpha-beta"`` for the
    textbook model); ``channels``: channels the call ran on; ``pipe_bytes[i]``: bytes pipe
    ``i`` of ``cluster`` carried (``cluster.pipe_names()``); ``trace``: empty for the closed
    form; ``steps`` / ``transfers``: of a textbook schedule (1 / ranks for the NCCL model).
    """

    op: str
    algorithm: str
    protocol: str
    nbytes: float
    n: int
    time_s: float
    algbw_Bps: float
    busbw_Bps: float
    cluster: Cluster
    channels: int = 0
    steps: int = 0
    transfers: int = 0
    events: int = 0
    achieved: bool = True
    pipe_bytes: np.ndarray = field(default=None, compare=False)  # type: ignore[assignment]
    trace: Trace = field(default_factory=Trace, compare=False)

    def __repr__(self) -> str:
        return (f"CollectiveResult({self.op} {self.algorithm}/{self.protocol}, "
                f"{fmt_bytes(self.nbytes)} on {self.n} GPUs of {self.cluster.name}: "
                f"{fmt_time(self.time_s)}, algbw {fmt_bandwidth(self.algbw_Bps)}, busbw "
                f"{fmt_bandwidth(self.busbw_Bps)})")

    def link_utilisation(self) -> dict[str, float]:
        """Fraction of the run each used pipe was busy at its full bandwidth."""
        cap = self.cluster.pipe_capacities(self.achieved)
        names = self.cluster.pipe_names()
        if self.time_s <= 0 or self.pipe_bytes is None:
            return {}
        util = self.pipe_bytes / (cap * self.time_s)
        return {names[i]: float(util[i]) for i in np.flatnonzero(self.pipe_bytes)}


def check_nbytes(nbytes: object) -> float:
    """``nbytes`` as a float, or ValueError naming the fix (bools, strings, NaN refused)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or not math.isfinite(
            nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number of bytes >= 0, got {nbytes!r}")
    if nbytes != int(nbytes):
        raise ValueError(f"nbytes must be a whole number of bytes, got {nbytes!r}")
    if nbytes > 2**50:
        raise ValueError(f"nbytes={nbytes:g} is more than 1 PiB (2**50), the most a collective "
                         "here may move; use a smaller message")
    return float(nbytes)


def resolve(op: str, nbytes: object, cluster: Cluster, ranks: object) -> tuple[str, float, list]:
    """Canonical op name, checked size and the member ranks (a list)."""
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a labsim.Cluster (e.g. labsim.dgx_h100(2)), got "
                         f"{type(cluster).__name__}")
    size = check_nbytes(nbytes)
    group = group_of(cluster, ranks)  # validates ranks
    if ranks is None:
        members = list(range(cluster.world_size))
    elif isinstance(ranks, int):
        members = list(range(ranks))
    else:
        members = [int(r) for r in ranks]  # type: ignore[union-attr]
    op_key, _ = normalize(op, "pairwise" if str(op).replace("-", "_").lower() in (
        "alltoall", "all_to_all") else "ring", max(group.nranks, 1), size)
    return op_key, size, members


def textbook_steps(op: str, nbytes: float, members: list, cluster: Cluster, algorithm: str,
                   piece_bytes: int = PIPELINE_BYTES) -> list[Step]:
    """The textbook schedule's steps, refusing ones too large to simulate."""
    _, algo = normalize(op, algorithm, len(members), nbytes)
    p = len(members)
    steps_bound = {"ring": 2 * p, "pairwise": p}.get(algo, 4 * max(1, p.bit_length()))
    if steps_bound * p > MAX_TRANSFERS:
        raise ValueError(f"{algo} {op} over {p} ranks moves about {steps_bound * p:,} "
                         f"transfers, more than the {MAX_TRANSFERS:,} simulated here; use "
                         "fewer ranks or the NCCL model (protocol='auto')")
    return list(schedule(op, nbytes, members, algo, cluster, piece_bytes))


def step_pipes(step: Step, cluster: Cluster) -> tuple[np.ndarray, np.ndarray, float]:
    """(pipes, bytes on each, alpha) of one textbook step."""
    pattern = step.pattern
    route = pattern.routes.get(cluster)
    if route is None:  # steps alike share a pattern: route it once per cluster
        paths = cluster.paths(pattern.src, pattern.dst).ravel()
        alpha = float(cluster.latencies(pattern.src, pattern.dst).max())
        pipes, counts = np.unique(paths, return_counts=True)
        route = pattern.routes[cluster] = (paths, alpha, pipes, bool(counts.max() == 1))
    paths, alpha, pipes, distinct = route
    if distinct and step.min_bytes == step.max_bytes:  # every pipe carries one transfer
        return pipes, np.full(len(pipes), step.max_bytes), alpha
    if distinct:
        loads = np.empty(cluster.n_pipes)
        loads[paths] = np.repeat(step.nbytes, 2)
        return pipes, loads[pipes], alpha
    per_pipe = np.bincount(paths, np.repeat(step.nbytes, 2), minlength=cluster.n_pipes)
    return pipes, per_pipe[pipes], alpha


def estimate_collective(op: str, nbytes: float, cluster: Cluster, algorithm: str = "auto",
                        ranks: object = None, *, protocol: str = "auto",
                        achieved: bool = True,
                        piece_bytes: int = PIPELINE_BYTES) -> CollectiveResult:
    """Closed-form time of ``op`` on ``nbytes`` (nccl-tests size) among ``ranks`` (None: every
    GPU; an int n: ranks 0..n-1; or a list) of ``cluster``: the NCCL model by default, the
    textbook model with ``protocol="alpha-beta"`` (module doc)."""
    op, size, members = resolve(op, nbytes, cluster, ranks)
    n = len(members)
    cap = cluster.pipe_capacities(achieved)
    if protocol == TEXTBOOK:
        if algorithm == "auto":
            algorithm = "ring" if op != "alltoall" else "pairwise"
        steps = textbook_steps(op, size, members, cluster, algorithm, piece_bytes)
        t = 0.0
        pipe_bytes = np.zeros(cluster.n_pipes)
        for step in steps:
            pipes, loads, alpha = step_pipes(step, cluster)
            t += alpha + (float(np.max(loads / cap[pipes])) if len(pipes) else 0.0)
            pipe_bytes[pipes] += loads
        _, algo = normalize(op, algorithm, n, size)
        return _result(op, algo, TEXTBOOK, size, n, t, cluster, 0, len(steps),
                       sum(len(s) for s in steps), achieved, pipe_bytes)
    if op not in NCCL_OPS:
        raise ValueError(f"{op} has no NCCL model; use protocol='alpha-beta'")
    cost = plan_collective(op, size, group_of(cluster, members), algorithm, protocol)
    t = time_on(cost, cluster, members, achieved)
    pipes, loads = collective_flow(cluster, members, cost)
    pipe_bytes = np.zeros(cluster.n_pipes)
    np.add.at(pipe_bytes, pipes, loads * size)
    return _result(op, cost.algorithm, cost.protocol, size, n, t, cluster, cost.channels, 1, n,
                   achieved, pipe_bytes)


def time_on(cost: CollectiveCost, cluster: Cluster, members: list, achieved: bool) -> float:
    """Seconds of ``cost`` alone on ``cluster``'s pipes (line rate when not ``achieved``)."""
    if cost.nbytes == 0 or len(members) < 2:
        return 0.0
    if achieved:
        return cost.time_s
    pipes, loads = collective_flow(cluster, members, cost)
    cap = cluster.pipe_capacities(False)
    rate = min([cost.cap_Bps] + [float(c / ld) for c, ld in zip(cap[pipes], loads)])
    return cost.latency_s + cost.nbytes / rate


def _result(op: str, algo: str, proto: str, size: float, n: int, t: float, cluster: Cluster,
            channels: int, steps: int, transfers: int, achieved: bool, pipe_bytes: np.ndarray,
            trace: Trace | None = None, events: int = 0) -> CollectiveResult:
    bw = algbw(size, t)
    return CollectiveResult(op, algo, proto, size, n, t, bw, bw * busbw_factor(op, n), cluster,
                            channels, steps, transfers, events, achieved, pipe_bytes,
                            trace if trace is not None else Trace())
