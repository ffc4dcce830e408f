"""The network in time: flows over shared pipes, executed in simpy.

``Network(env, capacity)`` holds pipes (one link direction each, bytes/s).  ``flow(nbytes,
pipes, loads, cap, latency)`` starts a flow: after ``latency`` seconds it moves ``nbytes`` of
payload, putting ``loads[i]`` wire bytes per payload byte on ``pipes[i]``, at a rate that
``labsim.network.fair_rates`` recomputes whenever a flow that shares a pipe with it starts or
ends (weighted max-min fairness; a flow alone runs at ``labsim.network.alone_rate``).  The
returned event fires when the last byte is through; its value is the ``Flow``.

Only flows connected through shared pipes are re-rated, so independent traffic costs one
event per flow, whatever else runs; a flow that starts on an idle network is not even
registered on its pipes until a second flow starts (a textbook collective's steps, one
after another over thousands of pipes, then cost a few vector operations each).
Everything a training step moves -- tensor-parallel collectives, pipeline sends,
data-parallel and ZeRO collectives -- goes through one ``Network``, so traffic of different
groups slows down exactly where it meets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import numpy as np
import simpy

from labsim.network import fair_rates


class Flow:
    """A flow in flight (bytes, rates and times; internal state of ``Network``)."""

    __slots__ = ("nbytes", "left", "rate", "pipes", "loads", "cap", "done", "version",
                 "since", "start_s", "admit_s", "end_s", "tag", "seq")

    def __init__(self, nbytes: float, pipes: tuple[int, ...], loads: tuple[float, ...],
                 cap: float, done: simpy.Event, tag: object, seq: int = 0) -> None:
        self.nbytes = self.left = float(nbytes)
        self.rate = 0.0
        self.pipes, self.loads, self.cap = pipes, loads, cap
        self.done, self.tag = done, tag
        self.seq = seq  # creation order: ties between flows admitted together break by it
        self.version = 0
        self.since = self.start_s = self.admit_s = self.end_s = 0.0


class Network:
    """Pipes of ``capacity`` (bytes/s) inside ``env``; see the module docstring."""

    def __init__(self, env: simpy.Environment, capacity: Sequence[float],
                 track_bytes: bool = True) -> None:
        self.env = env
        self.capacity = np.asarray(capacity, dtype=float)
        if self.capacity.ndim != 1 or not np.all(self.capacity > 0):
            raise ValueError("every pipe needs a bandwidth > 0 bytes/s")
        self.moved = np.zeros(len(self.capacity))  # wire bytes per pipe (if tracked)
        self.track_bytes = track_bytes
        self.events = 0
        self._created = 0  # flows created so far
        self._on: dict[int, set[Flow]] = {}
        self._cap = [float(c) for c in self.capacity]
        self._active = 0  # flows admitted and not ended
        self._solo: Flow | None = None  # the one active flow, not registered on its pipes

    def flow(self, nbytes: float, pipes: Sequence[int] = (), loads: Sequence[float] = (),
             cap: float = math.inf, latency: float = 0.0, tag: object = None) -> simpy.Event:
        """Start a flow now (module doc); the event's value is its ``Flow``."""
        done = self.env.event()
        if isinstance(pipes, np.ndarray):
            loads = np.asarray(loads, dtype=float)
        elif not isinstance(pipes, tuple):
            pipes, loads = tuple(int(p) for p in pipes), tuple(float(x) for x in loads)
        self._created += 1
        f = Flow(nbytes, pipes, loads, cap, done, tag, self._created)  # type: ignore[arg-type]
        f.start_s = self.env.now
        if latency > 0:
            self.events += 1
            self.env.timeout(latency).callbacks.append(partial(self._admit_cb, f))
        else:
            self._admit(f)
        return done

    # -- internals ------------------------------------------------------------------------
    def _admit_cb(self, f: Flow, _event: simpy.Event) -> None:
        self._admit(f)

    def _admit(self, f: Flow) -> None:
        now = self.env.now
        f.admit_s = f.since = now
        if f.nbytes <= 0 or not len(f.pipes) and f.cap == math.inf:
            self._finish(f)
            return
        self._active += 1
        if self._active == 1:  # alone on an idle network: vector arithmetic, no registration
            pipes = np.asarray(f.pipes, dtype=np.int64)
            loads = np.asarray(f.loads, dtype=float)
            if self.track_bytes:
                np.add.at(self.moved, pipes, loads * f.nbytes)
            used = loads > 0
            f.rate = min(f.cap, float(np.min(self.capacity[pipes[used]] / loads[used]))
                         if used.any() else math.inf)
            self._solo = f
            self._schedule(f)
            return
        if self._solo is not None:
            self._register(self._solo)
        if isinstance(f.pipes, np.ndarray):
            f.pipes = tuple(int(p) for p in f.pipes)
            f.loads = tuple(float(x) for x in f.loads)
        if self.track_bytes:
            for p, ld in zip(f.pipes, f.loads):
                self.moved[p] += ld * f.nbytes
        on = self._on
        alone = True
        for p in f.pipes:
            flows = on.get(p)
            if flows:
                alone = False
            else:
                flows = on[p] = set()
            flows.add(f)
        if alone:
            rate = f.cap
            for p, ld in zip(f.pipes, f.loads):
                if ld > 0:
                    rate = min(rate, self._cap[p] / ld)
            f.rate = rate
            self._schedule(f)
            return
        self._rerate(self._component(f) | {f})

    def _register(self, f: Flow) -> None:
        """Put the solo flow ``f`` on its pipes, now that another flow starts."""
        self._solo = None
        if isinstance(f.pipes, np.ndarray):
            f.pipes = tuple(int(p) for p in f.pipes)
            f.loads = tuple(float(x) for x in f.loads)
        for p in f.pipes:
            self._on.setdefault(p, set()).add(f)

    def _component(self, f: Flow) -> set[Flow]:
        """Active flows connected to ``f``'s pipes through shared pipes."""
        seen: set[Flow] = set()
        todo = [p for p in f.pipes if self._on.get(p)]
        done_pipes: set[int] = set()
        while todo:
            p = todo.pop()
            if p in done_pipes:
                continue
            done_pipes.add(p)
            for g in self._on.get(p, ()):
                if g not in seen:
                    seen.add(g)
                    todo.extend(q for q in g.pipes if q not in done_pipes)
        return seen

    def _rerate(self, flows: set[Flow]) -> None:
        now = self.env.now
        ordered = sorted(flows, key=lambda g: (g.admit_s, g.seq))
        for g in ordered:  # bring every flow up to now at its old rate
            g.left = max(0.0, g.left - g.rate * (now - g.since))
            g.since = now
        rates = fair_rates([(g.pipes, g.loads, g.cap) for g in ordered], self.capacity)
        for g, r in zip(ordered, rates):
            if r != g.rate or g.version == 0:
                g.rate = r
                self._schedule(g)

    def _schedule(self, f: Flow) -> None:
        f.version += 1
        delay = f.left / f.rate if f.rate > 0 else math.inf
        if delay == math.inf:
            raise ValueError("a flow got no bandwidth: every pipe it uses must have capacity")
        self.events += 1
        self.env.timeout(delay).callbacks.append(partial(self._end_cb, f, f.version))

    def _end_cb(self, f: Flow, version: int, _event: simpy.Event) -> None:
        self._end(f, version)

    def _end(self, f: Flow, version: int) -> None:
        if version != f.version:
            return  # re-rated since: a later timeout ends it
        self._active -= 1
        if f is self._solo:
            self._solo = None
            f.left = 0.0
            self._finish(f)
            return
        for p in f.pipes:
            on = self._on.get(p)
            if on is not None:
                on.discard(f)
        f.left = 0.0
        neighbours = self._component(f) if any(self._on.get(p) for p in f.pipes) else set()
        self._finish(f)
        if neighbours:
            self._rerate(neighbours)

    def _finish(self, f: Flow) -> None:
        f.end_s = self.env.now
        f.done.succeed(f)
