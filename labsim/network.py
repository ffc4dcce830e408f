"""How flows share a cluster's links: max-min fair rates of transfer patterns (values only).

Every transfer crosses pipes (one link direction each, ``Cluster.paths``); flows on one pipe
split its bandwidth max-min fairly (``maxmin_rates``: two flows alone on one direction get
half each, a flow alone gets the slowest pipe on its path).  ``PatternRates`` caches, per
transfer pattern of a collective step, each flow's rate and the step's latency, so that the
closed forms on a cluster (``labsim.collectives.collective_time_on``) and the simpy engine
(``labsim.sim.network``) agree by construction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only annotations: labsim.collectives itself imports this module
    from labsim.cluster import Cluster
    from labsim.collectives.schedule import Pattern, Step


def maxmin_rates(paths: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rate (bytes/s) of each flow; ``paths[i]`` lists the pipes flow i crosses.

    Progressive filling (Bertsekas & Gallager, *Data Networks*, sec. 6.5.2): raise every
    unfrozen flow's rate together until a pipe is full, freeze the flows through it, repeat.
    Two flows alone on one pipe get half of it each; a flow alone gets the slowest pipe on
    its path.
    """
    paths = np.asarray(paths, dtype=np.int64)
    m = len(paths)
    rate = np.zeros(m)
    if m == 0:
        return rate
    left = np.asarray(capacity, dtype=float).copy()
    active = np.ones(m, dtype=bool)
    while active.any():
        counts = np.bincount(paths[active].ravel(), minlength=len(left))
        used = counts > 0
        share = np.full(len(left), np.inf)
        share[used] = left[used] / counts[used]
        inc = share.min()
        rate[active] += inc
        left -= inc * counts
        full = used & (share <= inc * (1 + 1e-12))
        active &= ~full[paths].any(axis=1)
    return rate


class PatternRates:
    """Latency and max-min fair rates of a pattern alone on a cluster's network (cached)."""

    def __init__(self, cluster: Cluster, achieved: bool) -> None:
        self.cluster = cluster
        self.capacity = cluster.pipe_capacities(achieved)
        self._cache: dict[int, tuple[Pattern, np.ndarray, float, np.ndarray, float]] = {}

    def _entry(self, pattern: Pattern) -> tuple[Pattern, np.ndarray, float, np.ndarray, float]:
        hit = self._cache.get(id(pattern))
        if hit is None or hit[0] is not pattern:
            paths = self.cluster.paths(pattern.src, pattern.dst)
            alpha = float(self.cluster.latencies(pattern.src, pattern.dst).max())
            rates = maxmin_rates(paths, self.capacity)
            uniform = float(rates[0]) if len(rates) and rates.min() == rates.max() else 0.0
            hit = (pattern, paths, alpha, rates, uniform)
            self._cache[id(pattern)] = hit
        return hit

    def get(self, pattern: Pattern) -> tuple[np.ndarray, float, np.ndarray]:
        """(pipes (m, 2), alpha of the step, rates alone)."""
        hit = self._entry(pattern)
        return hit[1], hit[2], hit[3]

    def uniform_rate(self, pattern: Pattern) -> float:
        """The common rate when every transfer of ``pattern`` alone gets the same, else 0."""
        return self._entry(pattern)[4]


def step_time(step: Step, rates: PatternRates) -> float:
    """One step alone on the network: its largest alpha plus its slowest transfer."""
    _, alpha, rate = rates.get(step.pattern)
    uniform = rates.uniform_rate(step.pattern)
    if uniform > 0:
        return alpha + step.max_bytes / uniform
    if step.min_bytes == step.max_bytes:  # equal transfers: the slowest rate decides
        return alpha + step.max_bytes / float(rate.min())
    return alpha + float(np.max(step.nbytes / rate))


def steps_time(steps: Iterable[Step], rates: PatternRates) -> float:
    """Sum over steps of (the step's largest alpha + its slowest transfer at fair rates)."""
    return sum(step_time(step, rates) for step in steps)


