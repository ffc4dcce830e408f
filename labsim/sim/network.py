"""Flows over a cluster's links, executed in simpy, with max-min fair sharing.

A *bundle* is the set of transfers of one collective step (``labsim.collective_schedule``):
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
from dataclasses import dataclass, field

import numpy as np
import simpy

from labsim.cluster import Cluster, maxmin_rates
from labsim.collective_schedule import Pattern
from labsim.collectives import PatternRates


@dataclass(eq=False)
class _Bundle:
    pattern: Pattern
    paths: np.ndarray
    remaining: np.ndarray
    rate: np.ndarray = field(default_factory=lambda: np.zeros(0))
    first_rate: np.ndarray | None = None


class Network:
    """The pipes of ``cluster`` inside ``env``; ``transfer`` runs one bundle as a process.

    ``achieved=True`` gives links the bandwidth NCCL reaches, ``False`` their line rate.
    ``pipe_bytes`` accumulates the bytes every pipe carried (for utilisation plots);
    ``events`` counts the simpy events the network scheduled.
    """

    def __init__(self, env: simpy.Environment, cluster: Cluster, achieved: bool = True) -> None:
        self.env = env
        self.cluster = cluster
        self.achieved = achieved
        self.patterns = PatternRates(cluster, achieved)
        self.capacity = self.patterns.capacity
        self.events = 0
        self._sent: dict[int, tuple[Pattern, np.ndarray]] = {}
        self._active: list[_Bundle] = []
        self._last = 0.0
        self._changed = env.event()
        self._rate_cache: dict[tuple[int, ...], tuple[list[Pattern], list[np.ndarray]]] = {}

    def transfer(self, pattern: Pattern, nbytes: np.ndarray) -> simpy.Process:
        """Start the transfers of ``pattern`` (``nbytes[i]`` from ``src[i]`` to ``dst[i]``);
        the process's value is the rates (bytes/s) each transfer started with."""
        return self.env.process(self._run(pattern, np.asarray(nbytes, dtype=float)))

    @property
    def pipe_bytes(self) -> np.ndarray:
        """Bytes each pipe has carried so far (index as ``cluster.pipe_names()``)."""
        total = np.zeros(self.cluster.n_pipes)
        for pattern, sent in self._sent.values():
            paths = self.patterns.get(pattern)[0]
            total += np.bincount(paths[:, 0], sent, minlength=len(total))
            total += np.bincount(paths[:, 1], sent, minlength=len(total))
        return total

    # -- internals ------------------------------------------------------------------------
    def _run(self, pattern: Pattern, nbytes: np.ndarray) -> Generator:
        paths, alpha, _ = self.patterns.get(pattern)
        sent = self._sent.get(id(pattern))
        if sent is None or sent[0] is not pattern:
            self._sent[id(pattern)] = (pattern, nbytes.copy())
        else:
            np.add(sent[1], nbytes, out=sent[1])
        if alpha > 0:
            self.events += 1
            yield self.env.timeout(alpha)
        bundle = _Bundle(pattern, paths, nbytes.copy())
        self._admit(bundle)
        while True:
            left = float(np.max(bundle.remaining / bundle.rate))  # rates are > 0
            changed = self._changed
            self.events += 2
            yield self.env.timeout(left) | changed
            if not changed.triggered:  # nothing else moved: our bytes are through
                break
            if not (bundle.remaining > 0).any():
                break
        self._remove(bundle)
        return bundle.first_rate

    def _advance(self) -> None:
        dt = self.env.now - self._last
        self._last = self.env.now
        if dt > 0:
            for b in self._active:
                np.maximum(b.remaining - b.rate * dt, 0.0, out=b.remaining)

    def _admit(self, bundle: _Bundle) -> None:
        self._advance()
        self._active.append(bundle)
        self._reallocate()
        bundle.first_rate = bundle.rate.copy()

    def _remove(self, bundle: _Bundle) -> None:
        self._advance()
        self._active.remove(bundle)
        bundle.remaining[:] = 0.0
        self._reallocate()

    def _reallocate(self) -> None:
        key = tuple(id(b.pattern) for b in self._active)
        hit = self._rate_cache.get(key)
        if hit is None or any(p is not b.pattern for p, b in zip(hit[0], self._active)):
            if len(self._active) == 1:
                rates = [self.patterns.get(self._active[0].pattern)[2]]
            else:
                allpaths = np.concatenate([b.paths for b in self._active]) if self._active \
                    else np.zeros((0, 2), dtype=np.int64)
                flat = maxmin_rates(allpaths, self.capacity)
                cuts = np.cumsum([len(b.paths) for b in self._active])[:-1]
                rates = np.split(flat, cuts)
            hit = ([b.pattern for b in self._active], rates)
            self._rate_cache[key] = hit
        for b, r in zip(self._active, hit[1]):
            b.rate = r
        old, self._changed = self._changed, self.env.event()
        old.succeed()
