"""A PyTorch ``DataLoader`` feeding a training step, as simpy processes.

What is modelled (``torch/utils/data/dataloader.py``, ``_MultiProcessingDataLoaderIter``):

- ``num_workers`` worker processes, each with its own index queue; batch k goes to worker
  k mod N (round robin) and batches reach the training loop in order;
- when the iterator starts it sends N x ``prefetch_factor`` batch indices; every time the
  training loop takes a batch, one more index is sent (so at most N x prefetch_factor batches
  are in flight);
- the training loop waits for batch k (a "wait" span, including ``handover_s`` to take it
  from the worker), then runs the step ("compute");
- ``num_workers=0``: the training process loads each batch itself ("load" on its own
  stream), then steps;
- worker start-up at the start of each epoch (only the first with ``persistent_workers``);
  a new epoch's first indices are sent when its iterator is created, so the pipeline drains
  at every epoch boundary;
- load times with seeded jitter (gamma, mean kept) and stragglers; optional CPU contention:
  ``cores`` shared fairly by busy workers (and the step, if ``step_uses_cpu``).

The closed form of the deterministic steady state is ``labsim.loading.loader_busy_fraction``.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np
import simpy

from labsim.loading import LoaderConfig, steady_busy_fraction
from labsim.trace import Trace

MAIN = "main"


class _SharedCPU:
    """Processor sharing: n busy jobs on ``cores`` cores each run at ``min(1, cores / n)``."""

    def __init__(self, env: simpy.Environment, cores: int | None) -> None:
        self.env = env
        self.cores = cores
        self._jobs: dict[int, list] = {}  # id -> [remaining core-seconds, done event]
        self._ids = itertools.count()
        self._last = env.now
        self._version = 0

    def _rate(self) -> float:
        n = len(self._jobs)
        return 1.0 if self.cores is None or n <= self.cores else self.cores / n

    def _advance(self) -> None:
        done = (self.env.now - self._last) * self._rate()
        for job in self._jobs.values():
            job[0] -= done
        self._last = self.env.now

    def run(self, work_s: float) -> Generator:
        """``yield from cpu.run(w)``: returns when ``w`` core-seconds of work are done."""
        if self.cores is None:
            yield self.env.timeout(work_s)
            return
        self._advance()
        done = self.env.event()
        self._jobs[next(self._ids)] = [work_s, done]
        self._reschedule()
        yield done

    def _reschedule(self) -> None:
        finished = [k for k, (rem, _) in self._jobs.items() if rem <= 1e-12]
        for k in finished:
            self._jobs.pop(k)[1].succeed()
        self._version += 1
        if self._jobs:
            dt = min(rem for rem, _ in self._jobs.values()) / self._rate()
            self.env.process(self._wake(dt, self._version))

    def _wake(self, dt: float, version: int) -> Generator:
        yield self.env.timeout(dt)
        if version == self._version:
            self._advance()
            self._reschedule()


@dataclass(frozen=True)
class LoaderResult:
    """What a simulated run did.

    ``total_time_s``: from the start (workers starting) to the end of the last step.
    ``gpu_busy_fraction``: time in the step / total time.  ``mean_wait_s``: mean time the
    training loop waited for each batch (in-process loading counts as waiting).
    ``step_start_s`` / ``step_end_s`` / ``wait_s``: per step, in order over all epochs.
    ``trace``: spans on stream "main" (wait, load, compute) and "worker i" (load, idle).
    """

    config: LoaderConfig
    total_time_s: float
    gpu_busy_fraction: float
    mean_wait_s: float
    step_start_s: tuple[float, ...]
    step_end_s: tuple[float, ...]
    wait_s: tuple[float, ...]
    trace: Trace

    @property
    def steps_per_s(self) -> float:
        return len(self.step_end_s) / self.total_time_s

    def steady_busy_fraction(self, skip: int | None = None) -> float:
        """Busy fraction of the steps after the first ``skip`` (warm-up left out).

        The window runs from the end of step ``skip - 1`` to the end of the last step, so
        it holds whole periods; ``skip`` defaults to half the steps.
        """
        return steady_busy_fraction(self.step_start_s, self.step_end_s, skip)

    def __repr__(self) -> str:
        c = self.config
        return (f"LoaderResult(workers={c.num_workers}, prefetch={c.prefetch_factor}, "
                f"steps={len(self.step_end_s)}, total={self.total_time_s:.4g} s, "
                f"gpu_busy={self.gpu_busy_fraction:.1%}, "
                f"mean_wait={self.mean_wait_s * 1e3:.3g} ms)")


def load_times(config: LoaderConfig) -> np.ndarray:
    """Per-batch load times (seconds of one free core), all epochs in order, seeded."""
    n = config.steps * config.epochs
    if config.load_times_s is not None:
        return np.asarray(config.load_times_s, dtype=float)
    rng = np.random.default_rng(config.seed)
    times = np.full(n, config.load_time_s)
    if config.jitter > 1e-6:  # below that the gamma shape overflows; no visible effect
        shape = 1.0 / config.jitter**2
        times = times * rng.gamma(shape, 1.0 / shape, size=n)
    if config.straggler_prob > 0:
        times = np.where(rng.random(n) < config.straggler_prob,
                         times * config.straggler_factor, times)
    return times


def simulate_dataloader(num_workers: int, prefetch_factor: int, load_time_s: float,
                        step_time_s: float, steps: int, seed: int = 0,
                        **options: object) -> LoaderResult:
    """Simulate ``steps`` training steps (per epoch) fed by a DataLoader.

    Options are the other fields of ``LoaderConfig``: ``jitter``, ``straggler_prob``,
    ``straggler_factor``, ``worker_start_s``, ``epochs``, ``persistent_workers``, ``cores``,
    ``step_uses_cpu``, ``load_times_s``, ``step_times_s``, ``handover_s``.
    """
    config = LoaderConfig(num_workers, prefetch_factor, load_time_s, step_time_s, steps,
                          seed, **options)  # type: ignore[arg-type]
    return run_loader(config)


def run_loader(config: LoaderConfig) -> LoaderResult:
    """Run one ``LoaderConfig`` in a fresh simpy environment."""
    env = simpy.Environment()
    cpu = _SharedCPU(env, config.cores)
    trace = Trace()
    durations = load_times(config)
    starts: list[float] = []
    ends: list[float] = []
    waits: list[float] = []

    step_times = (config.step_times_s if config.step_times_s is not None
                  else (config.step_time_s,) * (config.steps * config.epochs))

    def step() -> Generator:
        work = step_times[len(starts) - 1]
        if config.step_uses_cpu:
            yield from cpu.run(work)
        else:
            yield env.timeout(work)

    def worker(w: int, queue: simpy.Store, ready: dict[int, simpy.Event],
               start_s: float) -> Generator:
        if start_s > 0:
            t0 = env.now
            yield env.timeout(start_s)
            trace.add(0, f"worker {w}", "idle", t0, env.now, "start-up")
        while True:
            k = yield queue.get()
            if k is None:
                return
            t0 = env.now
            yield from cpu.run(float(durations[k]))
            trace.add(0, f"worker {w}", "load", t0, env.now, f"batch {k}")
            ready[k].succeed()

    def training_loop() -> Generator:
        n, per_epoch = config.num_workers, config.steps
        for epoch in range(config.epochs):
            first = epoch * per_epoch
            batches = range(first, first + per_epoch)
            if n == 0:
                for k in batches:
                    t0 = env.now
                    yield from cpu.run(float(durations[k]))
                    trace.add(0, MAIN, "load", t0, env.now, f"batch {k}")
                    waits.append(env.now - t0)
                    starts.append(env.now)
                    yield from step()
                    trace.add(0, MAIN, "compute", starts[-1], env.now, f"step {k}")
                    ends.append(env.now)
                continue
            start_s = config.worker_start_s
            if config.persistent_workers and epoch > 0:
                start_s = 0.0
            queues = [simpy.Store(env) for _ in range(n)]
            ready = {k: env.event() for k in batches}
            for w in range(n):
                env.process(worker(w, queues[w], ready, start_s))
            sent = first
            for _ in range(min(config.inflight, per_epoch)):
                queues[(sent - first) % n].put(sent)
                sent += 1
            for k in batches:
                t0 = env.now
                yield ready[k]
                if config.handover_s > 0:
                    yield env.timeout(config.handover_s)
                if env.now > t0:
                    trace.add(0, MAIN, "wait", t0, env.now, f"batch {k}")
                waits.append(env.now - t0)
                if sent < first + per_epoch:  # handing over batch k frees one slot
                    queues[(sent - first) % n].put(sent)
                    sent += 1
                starts.append(env.now)
                yield from step()
                trace.add(0, MAIN, "compute", starts[-1], env.now, f"step {k}")
                ends.append(env.now)
            for q in queues:
                q.put(None)

    env.process(training_loop())
    env.run()
    total = ends[-1]
    busy = sum(e - s for s, e in zip(starts, ends))
    return LoaderResult(config, total, busy / total, float(np.mean(waits)),
                        tuple(starts), tuple(ends), tuple(waits), trace)
