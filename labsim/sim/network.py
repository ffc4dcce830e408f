"""Flows over a cluster's links, executed in simpy, with max-min fair sharing.

A *bundle* is the set of transfers of one collective step (``labsim.collectives.schedule``):
they start together, wait the step's latency (alpha), then move their bytes at max-min fair
rates over the pipes they cross (``labsim.cluster``: one pipe per link direction; two flows on
one direction get half each, opposite directions do not interact).  Whenever a bundle starts
or finishes moving bytes, every active bundle's remaining bytes are advanced at the old rates
and the rates are recomputed, so concurrent collectives (tensor- and data-parallel traffic in
a training step) slow each other down exactly where they share a link.

Lockstep ranks advance together: one bundle is a few simpy events however many transfers it
holds, which is what lets a 1024-GPU ring run in well under a second.  Inside a bundle each
transfer keeps its own byte count and rate; the bundle ends when its last transfer ends.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import numpy as np
import simpy

from labsim.cluster import Cluster
from labsim.collectives.schedule import Pattern, Step
from labsim.network import PatternRates, maxmin_rates


@dataclass(eq=False)
class _Bundle:
    """One step in flight.  While every transfer has moved the same bytes (``done``) the
    per-transfer array is never built: a lockstep step of 32 768 equal transfers costs O(1)."""

    step: Step
    paths: np.ndarray
    done: float = 0.0  # bytes each transfer has moved (scalar mode)
    remaining: np.ndarray | None = None  # per transfer (array mode)
    rate: float | np.ndarray = 0.0
    rate_min: float = 0.0
    first_rate: np.ndarray | None = None

    def time_left(self) -> float:
        if self.remaining is None:  # all equal progress; the slowest rate ends last
            return max(self.step.max_bytes - self.done, 0.0) / self.rate_min
        return float(np.max(self.remaining / self.rate))  # rates are > 0

    def advance(self, dt: float) -> None:
        if self.remaining is None and np.ndim(self.rate) == 0:
            self.done += self.rate * dt
            return
        if self.remaining is None:
            self.remaining = np.maximum(self.step.nbytes - self.done, 0.0)
        np.maximum(self.remaining - self.rate * dt, 0.0, out=self.remaining)

    def set_rate(self, rates: np.ndarray, uniform: float) -> None:
        if self.remaining is None and uniform > 0:
            self.rate = self.rate_min = uniform
            return
        equal_sizes = self.step.min_bytes == self.step.max_bytes
        if self.remaining is None and not (equal_sizes and self.done == 0):
            self.remaining = np.maximum(self.step.nbytes - self.done, 0.0)
        self.rate = rates  # (array mode, or equal sizes not started: slowest rate decides)
        self.rate_min = float(rates.min())


class Network:
    """The pipes of ``cluster`` inside ``env``; ``transfer`` runs one step as a process.

    ``achieved=True`` gives links the bandwidth NCCL reaches, ``False`` their line rate.
    ``pipe_bytes`` is the bytes every pipe carried (for utilisation plots); ``events`` counts
    the simpy events the network scheduled.
    """

    def __init__(self, env: simpy.Environment, cluster: Cluster, achieved: bool = True) -> None:
        self.env = env
        self.cluster = cluster
        self.achieved = achieved
        self.patterns = PatternRates(cluster, achieved)
        self.capacity = self.patterns.capacity
        self.events = 0
        self._steps: list[Step] = []
        self._active: list[_Bundle] = []
        self._last = 0.0
        self._changed = env.event()
        self._rate_cache: dict[tuple[int, ...],
                               tuple[list[Pattern], list[tuple[np.ndarray, float]]]] = {}

    def transfer(self, step: Step | Pattern, nbytes: np.ndarray | None = None,
                 ) -> simpy.Process:
        """Start the transfers of ``step`` (or of ``pattern`` with ``nbytes``); the process's
        value is the rates (bytes/s) each transfer started with."""
        if isinstance(step, Pattern):
            step = Step(step, np.asarray(nbytes, dtype=float), "", "")
        return self.env.process(self._run(step))

    @property
    def pipe_bytes(self) -> np.ndarray:
        """Bytes each pipe has carried so far (index as ``cluster.pipe_names()``)."""
        total = np.zeros(self.cluster.n_pipes)
        sent: dict[int, tuple[Pattern, np.ndarray]] = {}
        for step in self._steps:
            hit = sent.get(id(step.pattern))
            if hit is None:
                sent[id(step.pattern)] = (step.pattern, step.nbytes.copy())
            else:
                hit[1].__iadd__(step.nbytes)
        for pattern, nbytes in sent.values():
            paths = self.patterns.get(pattern)[0]
            total += np.bincount(paths[:, 0], nbytes, minlength=len(total))
            total += np.bincount(paths[:, 1], nbytes, minlength=len(total))
        return total

    # -- internals ------------------------------------------------------------------------
    def _run(self, step: Step) -> Generator:
        paths, alpha, _ = self.patterns.get(step.pattern)
        self._steps.append(step)
        if alpha > 0:
            self.events += 1
            yield self.env.timeout(alpha)
        bundle = _Bundle(step, paths)
        self._admit(bundle)
        while True:
            changed = self._changed
            self.events += 2
            yield self.env.timeout(bundle.time_left()) | changed
            if not changed.triggered or bundle.time_left() <= 0:
                break  # nothing else moved (or we are through anyway)
        self._remove(bundle)
        return bundle.first_rate

    def _advance(self) -> None:
        dt = self.env.now - self._last
        self._last = self.env.now
        if dt > 0:
            for b in self._active:
                b.advance(dt)

    def _admit(self, bundle: _Bundle) -> None:
        self._advance()
        self._active.append(bundle)
        rates = self._reallocate()
        bundle.first_rate = rates[-1][0]

    def _remove(self, bundle: _Bundle) -> None:
        self._active.remove(bundle)  # it is through: no need to advance it
        self._advance()
        self._reallocate()

    def _reallocate(self) -> list[tuple[np.ndarray, float]]:
        key = tuple(id(b.step.pattern) for b in self._active)
        hit = self._rate_cache.get(key)
        if hit is None or any(p is not b.step.pattern for p, b in zip(hit[0], self._active)):
            if len(self._active) == 1:
                pattern = self._active[0].step.pattern
                rates = [(self.patterns.get(pattern)[2], self.patterns.uniform_rate(pattern))]
            elif not self._active:
                rates = []
            else:
                flat = maxmin_rates(np.concatenate([b.paths for b in self._active]),
                                    self.capacity)
                cuts = np.cumsum([len(b.paths) for b in self._active])[:-1]
                rates = [(r, float(r[0]) if r.min() == r.max() else 0.0)
                         for r in np.split(flat, cuts)]
            hit = ([b.step.pattern for b in self._active], rates)
            self._rate_cache[key] = hit
        for b, (r, uniform) in zip(self._active, hit[1]):
            b.set_rate(r, uniform)
        old, self._changed = self._changed, self.env.event()
        old.succeed()
        return hit[1]
