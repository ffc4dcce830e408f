"""Closed-form model of an input pipeline feeding an accelerator (PyTorch ``DataLoader``).

The model, in the names PyTorch uses (``torch.utils.data.DataLoader``):

- ``num_workers`` = N loader processes; each makes one whole batch at a time (fetch, decode,
  augment, collate) in ``load_time_s`` = L seconds of one CPU core;
- the training step (the "GPU") takes ``step_time_s`` = S seconds per batch;
- the loader keeps at most N x ``prefetch_factor`` batches in flight (index sent to a worker,
  batch not yet handed to the training loop); batch k goes to worker k mod N (round robin)
  and batches are handed over in order;
- ``num_workers=0`` loads in the training process itself: load and step alternate.

Steady state with deterministic times (the period P between steps):

- N = 0: P = L + S, so the busy fraction is S / (L + S);
- N >= 1: the workers together deliver N / L batches/s and the step consumes 1 / S, so
  P = max(S, L / N) and the busy fraction is min(1, N * S / L).

The prefetch bound does not enter the steady state when times are constant: one batch in
flight per worker already keeps every worker busy (the next index is sent when a batch is
handed over, while the step runs).  What prefetching buys is slack against *variable* load
times (jitter, stragglers): ``labsim.sim.loading`` simulates that.  With ``cores`` given,
at most ``cores`` workers run at once (the step runs on the accelerator, not on a core), so
more workers than cores add nothing.  Memory in flight is N x prefetch_factor batches.

Sources: PyTorch ``torch/utils/data/dataloader.py`` (``_MultiProcessingDataLoaderIter``:
``_try_put_index``, ``prefetch_factor``, in-order delivery); the producer/consumer argument is
the classic one for a pipeline of two stages with rates N/L and 1/S.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check_times(load_time_s: float, step_time_s: float) -> None:
    if not (load_time_s >= 0 and math.isfinite(load_time_s)):
        raise ValueError(f"load_time_s={load_time_s!r} must be a finite number >= 0 seconds")
    if not (step_time_s > 0 and math.isfinite(step_time_s)):
        raise ValueError(f"step_time_s={step_time_s!r} must be a finite number > 0 seconds")


def _check_workers(num_workers: int, cores: int | None) -> None:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers={num_workers!r} must be an integer >= 0")
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int)
                              or cores < 1):
        raise ValueError(f"cores={cores!r} must be None (unlimited) or an integer >= 1")


def effective_workers(num_workers: int, cores: int | None = None) -> int:
    """Workers that can load at the same time: ``min(num_workers, cores)``."""
    _check_workers(num_workers, cores)
    return num_workers if cores is None else min(num_workers, cores)


def loader_step_period_s(num_workers: int, load_time_s: float, step_time_s: float,
                         cores: int | None = None) -> float:
    """Steady-state seconds between training steps (deterministic times).

    ``L + S`` for ``num_workers=0``, else ``max(S, L / N_eff)`` with ``N_eff`` the workers
    that fit on ``cores``.
    """
    _check_times(load_time_s, step_time_s)
    n = effective_workers(num_workers, cores)
    if num_workers == 0:
        return load_time_s + step_time_s
    return max(step_time_s, load_time_s / n)


def loader_busy_fraction(num_workers: int, load_time_s: float, step_time_s: float,
                         cores: int | None = None) -> float:
    """Steady-state fraction of time the step (the GPU) is busy.

    ``S / (L + S)`` in the main process (``num_workers=0``), else ``min(1, N * S / L)``.
    """
    return step_time_s / loader_step_period_s(num_workers, load_time_s, step_time_s, cores)


def workers_needed(load_time_s: float, step_time_s: float) -> int:
    """The fewest workers that keep the step fully busy: ``max(1, ceil(L / S))``."""
    _check_times(load_time_s, step_time_s)
    ratio = load_time_s / step_time_s
    # guard against 3.0000000000000004 -> 4 from float division
    return max(1, math.ceil(ratio - 1e-9 * max(1.0, ratio)))



DATA_BOUND_WAIT = 0.05
"""A run whose mean wait per step is at most this fraction of its mean step kept up with the
step: its period is S, and it says only that L <= N * S."""


def fit_loader_times(runs: list[tuple[int, float, float]]) -> tuple[float, float]:
    """Calibrate (L, S) from measured runs ``(num_workers, mean_wait_s, mean_step_s)``.

    S is the mean step over all runs.  Each *data-bound* run (wait above
    ``DATA_BOUND_WAIT`` of its step) gives one estimate of L: in-process the wait is the
    load (the loop loads, then steps), with N >= 1 workers the period ``wait + step`` is
    ``L / N``, so ``L = N * (wait + step)``; L is their mean.  A run that kept up with the
    step (wait about 0) bounds L only (``L <= N * S``) and is left out.
    """
    if not runs:
        raise ValueError("give at least one run (num_workers, mean_wait_s, mean_step_s)")
    for n, wait, step in runs:
        _check_workers(n, None)
        _check_times(wait, step)
    step_s = sum(step for _, _, step in runs) / len(runs)
    loads = [wait if n == 0 else n * (wait + step)
             for n, wait, step in runs if wait > DATA_BOUND_WAIT * step]
    if not loads:
        raise ValueError("no run waited for data, so none measures the load time: add a run "
                         "with fewer workers (num_workers=0 measures it directly)")
    return sum(loads) / len(loads), step_s


def calibrated_steps_per_s(runs: list[tuple[int, float, float]], num_workers: int,
                           cores: int | None = None) -> float:
    """Steps per second predicted for ``num_workers`` from L and S fitted to ``runs``.

    ``1 / loader_step_period_s(num_workers, L, S, cores)``: the slower of the loader
    (``min(N, cores) / L`` batches/s) and the step (``1 / S``) sets the pace.
    """
    load_s, step_s = fit_loader_times(runs)
    return 1.0 / loader_step_period_s(num_workers, load_s, step_s, cores)

def inflight_batches(num_workers: int, prefetch_factor: int) -> int:
    """The most batches the loader holds at once: ``N * prefetch_factor`` (0 in-process)."""
    _check_workers(num_workers, None)
    if prefetch_factor < 1:
        raise ValueError(f"prefetch_factor={prefetch_factor!r} must be >= 1")
    return num_workers * prefetch_factor


def loader_memory_bytes(num_workers: int, prefetch_factor: int, batch_nbytes: float,
                        worker_rss_bytes: float = 0.0) -> float:
    """Host memory the loader adds: batches in flight plus one resident copy per worker.

    ``N * prefetch_factor * batch_nbytes + N * worker_rss_bytes``.  For ImageNet-style
    batches (256 x 3 x 224 x 224 fp32 = 154 MB) 16 workers x prefetch 2 hold 4.9 GB.
    """
    return (inflight_batches(num_workers, prefetch_factor) * batch_nbytes
            + num_workers * worker_rss_bytes)


def steady_busy_fraction(step_start_s: tuple[float, ...] | list[float],
                         step_end_s: tuple[float, ...] | list[float],
                         skip: int | None = None) -> float:
    """Time in steps after the first ``skip`` / time from the end of step ``skip - 1``."""
    n = len(step_start_s)
    skip = n // 2 if skip is None else skip
    if not 0 <= skip < n:
        raise ValueError(f"skip={skip} must be in [0, {n})")
    busy = sum(e - s for s, e in zip(step_start_s[skip:], step_end_s[skip:]))
    t0 = step_end_s[skip - 1] if skip > 0 else 0.0
    return busy / (step_end_s[-1] - t0)


@dataclass(frozen=True)
class LoaderConfig:
    """One input-pipeline setting for ``simulate_dataloader`` (seconds; SI units).

    ``load_time_s``: one worker makes one batch in this time on a free core (mean).
    ``jitter``: coefficient of variation of load times (gamma distributed, mean kept).
    ``straggler_prob`` / ``straggler_factor``: a batch is that many times slower with that
    probability (a cold file, a huge image).  ``worker_start_s``: start-up of a worker
    (fork: ~0.05 s, spawn: seconds), paid every epoch unless ``persistent_workers``.
    ``cores``: CPU cores shared by the workers (and by the step when ``step_uses_cpu``, as in
    a CPU-only run); None = unlimited.  Cores are shared fairly (processor sharing).
    ``load_times_s`` / ``step_times_s``: replay measured per-batch times (one per step of
    every epoch) instead of drawing them: a trace-driven simulation of a real run.
    ``handover_s``: time the training loop spends taking a finished batch from a worker
    (unpickling, shared-memory hand-over, being scheduled); 0 in-process.
    """

    num_workers: int
    prefetch_factor: int
    load_time_s: float
    step_time_s: float
    steps: int
    seed: int = 0
    jitter: float = 0.0
    straggler_prob: float = 0.0
    straggler_factor: float = 1.0
    worker_start_s: float = 0.0
    epochs: int = 1
    persistent_workers: bool = False
    cores: int | None = None
    step_uses_cpu: bool = False
    load_times_s: tuple[float, ...] | None = None
    step_times_s: tuple[float, ...] | None = None
    handover_s: float = 0.0

    def __post_init__(self) -> None:
        _check_workers(self.num_workers, self.cores)
        _check_times(self.load_time_s, self.step_time_s)
        if self.num_workers > 0 and (not isinstance(self.prefetch_factor, int)
                                     or self.prefetch_factor < 1):
            raise ValueError(
                f"prefetch_factor={self.prefetch_factor!r} must be an integer >= 1 "
                "(PyTorch's default is 2)")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps={self.steps!r} must be an integer >= 1")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs={self.epochs!r} must be an integer >= 1")
        if not (0 <= self.jitter < 10):
            raise ValueError(f"jitter={self.jitter!r} is a coefficient of variation in [0, 10)")
        if not (0 <= self.straggler_prob <= 1):
            raise ValueError(f"straggler_prob={self.straggler_prob!r} must be in [0, 1]")
        if not (self.straggler_factor >= 1):
            raise ValueError(f"straggler_factor={self.straggler_factor!r} must be >= 1")
        if not (self.handover_s >= 0):
            raise ValueError(f"handover_s={self.handover_s!r} must be >= 0")
        if not (self.worker_start_s >= 0):
            raise ValueError(f"worker_start_s={self.worker_start_s!r} must be >= 0")
        n = self.steps * self.epochs
        for name in ("load_times_s", "step_times_s"):
            given = getattr(self, name)
            if given is not None:
                given = tuple(float(t) for t in given)
                object.__setattr__(self, name, given)
                if len(given) != n or min(given) < 0:
                    raise ValueError(f"{name} needs {n} times >= 0 (steps x epochs), "
                                     f"got {len(given)}")
        if self.num_workers == 0 and self.persistent_workers:
            raise ValueError("persistent_workers=True needs num_workers >= 1 (as in PyTorch)")

    @property
    def inflight(self) -> int:
        """Batches in flight at most (``num_workers * prefetch_factor``)."""
        return self.num_workers * self.prefetch_factor if self.num_workers else 0
