"""Timing a real training loop fed by a ``DataLoader``: how long it waits, how long it works.

``time_loop`` is the reference for the lab's exercise: for each batch it records the wait
(from the end of the previous step until the batch arrives) and the step (until the step's
work is done: ``sync`` waits for an asynchronous device).  ``measure_loader`` builds a
``DataLoader`` for one setting and times it; ``LoopTimes`` turns the numbers into the busy
fraction and a ``Trace`` for the utilisation timeline.  ``sweep_rounds`` runs several settings
in interleaved rounds and ``Rounds`` hands their per-round rates to
``labsim.lab.timing.compare``, so a verdict says "too noisy to tell" when the rounds disagree.
The loop under ``torch.profiler`` is ``labsim.experiments.loading.profiled``.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from labsim.lab.device import Timing
from labsim.lab.models import TrainStep
from labsim.loading import steady_busy_fraction
from labsim.trace import Trace

TimerFn = Callable[..., tuple[list[float], list[float]]]


def time_loop(batches: Iterable[Any], step: Callable[[Any], Any], *,
              sync: Callable[[], None] = lambda: None,
              clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], list[float]]:
    """Run ``step(batch)`` for every batch; return ``(wait_s, step_s)`` lists, one per batch.

    ``wait_s[i]``: from the end of step i-1 (or the call) until batch i is in hand;
    ``step_s[i]``: from then until ``step`` returned and ``sync()`` finished.
    """
    wait_s: list[float] = []
    step_s: list[float] = []
    iterator = iter(batches)
    t = clock()
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            break
        got = clock()
        step(batch)
        sync()
        done = clock()
        wait_s.append(got - t)
        step_s.append(done - got)
        t = done
    return wait_s, step_s


@dataclass(frozen=True)
class LoopTimes:
    """Per-step waits and step times of one run (seconds); steps follow each other.

    ``load_s`` (optional): what each batch cost to make where it was made (sum of its items'
    decode times, from a ``timed`` dataset).  ``handover_s`` (optional): per batch, from the
    later of "batch made" and "loop asked for it" until the loop had it -- the cost of moving
    a batch between processes (pickling, shared memory, scheduling); 0 in-process.
    """

    wait_s: tuple[float, ...]
    step_s: tuple[float, ...]
    label: str = ""
    load_s: tuple[float, ...] = ()
    handover_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.wait_s) != len(self.step_s) or not self.wait_s:
            raise ValueError("wait_s and step_s must be non-empty and of equal length")
        if self.load_s and len(self.load_s) != len(self.step_s):
            raise ValueError("load_s needs one entry per step")

    def mean_step_s(self, skip: int = 0) -> float:
        return statistics.fmean(self.step_s[skip:])

    def mean_load_s(self, skip: int = 0) -> float:
        if not self.load_s:
            raise ValueError("no load times recorded: use a dataset made with timed=True")
        return statistics.fmean(self.load_s[skip:])

    def mean_handover_s(self, skip: int = 0) -> float:
        return statistics.fmean(self.handover_s[skip:]) if self.handover_s else 0.0

    @property
    def total_s(self) -> float:
        return sum(self.wait_s) + sum(self.step_s)

    @property
    def busy_fraction(self) -> float:
        return sum(self.step_s) / self.total_s

    @property
    def mean_wait_s(self) -> float:
        return sum(self.wait_s) / len(self.wait_s)

    @property
    def steps_per_s(self) -> float:
        return len(self.step_s) / self.total_s

    def step_bounds(self) -> tuple[list[float], list[float]]:
        """(start, end) of every step, the clock starting at 0 when the loop began."""
        starts, ends, t = [], [], 0.0
        for w, s in zip(self.wait_s, self.step_s):
            starts.append(t + w)
            t += w + s
            ends.append(t)
        return starts, ends

    def steady_busy_fraction(self, skip: int | None = None) -> float:
        """Busy fraction after the first ``skip`` steps (default half): warm-up left out."""
        starts, ends = self.step_bounds()
        return steady_busy_fraction(starts, ends, skip)

    def measured(self, num_workers: int, skip: int | None = None) -> tuple[int, float, float]:
        """``(num_workers, mean wait, mean step)`` after the warm-up: what a loader model is
        calibrated on.  ``skip`` defaults to the prefetch depth plus two (at most half)."""
        skip = min(len(self.step_s) // 2, 2 * num_workers + 2) if skip is None else skip
        return (num_workers, statistics.fmean(self.wait_s[skip:]),
                statistics.fmean(self.step_s[skip:]))

    def to_trace(self) -> Trace:
        """Spans "wait" and "compute" on stream "main", as ``simulate_dataloader`` makes."""
        trace = Trace()
        t = 0.0
        for i, (w, s) in enumerate(zip(self.wait_s, self.step_s)):
            if w > 0:
                trace.add(0, "main", "wait", t, t + w, f"batch {i}")
            trace.add(0, "main", "compute", t + w, t + w + s, f"step {i}")
            t += w + s
        return trace

    def __repr__(self) -> str:
        return (f"LoopTimes({self.label + ': ' if self.label else ''}{len(self.step_s)} steps, "
                f"total={self.total_s:.3g} s, busy={self.busy_fraction:.1%}, "
                f"mean_wait={self.mean_wait_s * 1e3:.3g} ms)")


def measure_loader(dataset: Any, step: Callable[[Any], Any], *, batch_size: int,
                   num_workers: int = 0, prefetch_factor: int | None = None,
                   pin_memory: bool = False, persistent_workers: bool = False,
                   epochs: int = 1, steps: int | None = None, timer: TimerFn = time_loop,
                   sync: Callable[[], None] = lambda: None,
                   multiprocessing_context: str | None = None, label: str = "") -> LoopTimes:
    """Time ``epochs`` passes (``steps`` batches each, default all) of a real DataLoader.

    The clock runs across epochs, so worker start-up (every epoch unless
    ``persistent_workers``) shows up as wait.  ``timer`` is ``time_loop`` or a learner's
    function with the same contract.
    """
    from torch.utils.data import DataLoader, Subset

    if steps is not None:  # an epoch of exactly `steps` batches ends as a real epoch does
        dataset = Subset(dataset, range(min(len(dataset), steps * batch_size)))
    if num_workers == 0:
        prefetch_factor, persistent_workers, multiprocessing_context = None, False, None
    with warnings.catch_warnings():
        # more workers than this machine's cores is what some settings set out to show; the
        # lab says so, PyTorch's "suggested max number of worker" warning is noise there
        warnings.filterwarnings("ignore", message=".*DataLoader will create", category=UserWarning)
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False,
                            num_workers=num_workers, prefetch_factor=prefetch_factor,
                            pin_memory=pin_memory, persistent_workers=persistent_workers,
                            multiprocessing_context=multiprocessing_context, drop_last=True)
    iterators: list[Any] = []

    def all_epochs() -> Iterable[Any]:
        for _ in range(epochs):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*DataLoader will create",
                                        category=UserWarning)
                it = iter(loader)
            iterators.append(it)
            yield from it

    loads: list[float] = []
    handovers: list[float] = []
    last_end = [time.perf_counter()]

    def recorded_step(batch: Any) -> Any:
        arrived = time.perf_counter()
        if isinstance(batch, (tuple, list)) and len(batch) == 3:  # a timed dataset
            timing = batch[2]
            loads.append(float(timing[:, 0].sum()))
            ready = float(timing[:, 1].max())
            handovers.append(max(0.0, arrived - max(ready, last_end[0]))
                             if num_workers else 0.0)
        out = step(batch)
        last_end[0] = time.perf_counter()
        return out

    batches = all_epochs()
    try:
        wait_s, step_s = timer(batches, recorded_step, sync=sync)
    finally:  # an interrupted cell leaves no worker process behind
        batches.close()
        for it in iterators:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
    timed = len(loads) == len(step_s)
    return LoopTimes(tuple(wait_s), tuple(step_s), label, tuple(loads) if timed else (),
                     tuple(handovers) if timed else ())


@dataclass(frozen=True)
class Comparison:
    """A real run beside simulations of the same setting (steady state: warm-up skipped).

    ``replay_busy``: the simulation replays the run's own per-batch load and step times
    (trace-driven) and its mean hand-over time, so a machine slowed by other work slows both
    sides alike; contention is already inside those times.  ``sim_busy``: the simulation with
    only the run's *mean* load and step times, deterministic, no hand-over (what a prediction
    from two numbers gives); ``closed_form_busy`` its formula.
    """

    label: str
    num_workers: int
    prefetch_factor: int
    load_time_s: float
    step_time_s: float
    handover_s: float
    real_busy: float
    replay_busy: float
    sim_busy: float
    closed_form_busy: float

    @property
    def replay_error(self) -> float:
        return abs(self.real_busy - self.replay_busy) / self.replay_busy

    @property
    def sim_error(self) -> float:
        return abs(self.real_busy - self.sim_busy) / self.sim_busy

    def row(self) -> str:
        return (f"{self.label:<24} {self.load_time_s * 1e3:6.1f} {self.step_time_s * 1e3:6.1f}"
                f" {self.handover_s * 1e3:5.1f} {self.real_busy:6.1%} {self.replay_busy:7.1%}"
                f" {self.replay_error:6.1%} {self.sim_busy:6.1%} {self.sim_error:6.1%}")


HEADER = (f"{'setting':<24} {'L ms':>6} {'S ms':>6} {'h ms':>5} {'real':>6} {'replay':>7}"
          f" {'diff':>6} {'mean':>6} {'diff':>6}")


def compare(times: LoopTimes, num_workers: int, prefetch_factor: int = 2,
            skip: int | None = None) -> Comparison:
    """Simulate the setting of ``times`` with its measured costs; compare busy fractions."""
    from labsim.loading import loader_busy_fraction
    from labsim.sim.loading import simulate_dataloader

    n = len(times.step_s)
    skip = min(n // 2, num_workers * prefetch_factor + 2) if skip is None else skip
    load, step = times.mean_load_s(skip), times.mean_step_s(skip)
    handover = times.mean_handover_s(skip)
    replay = simulate_dataloader(num_workers, prefetch_factor, load, step, n,
                                 load_times_s=times.load_s, step_times_s=times.step_s,
                                 handover_s=handover)
    mean = simulate_dataloader(num_workers, prefetch_factor, load, step, n)
    return Comparison(times.label, num_workers, prefetch_factor, load, step, handover,
                      times.steady_busy_fraction(skip), replay.steady_busy_fraction(skip),
                      mean.steady_busy_fraction(skip),
                      loader_busy_fraction(num_workers, load, step))


def sweep(dataset: Any, step: Callable[[Any], Any], settings: list[dict[str, Any]], *,
          batch_size: int, steps: int, timer: TimerFn = time_loop,
          sync: Callable[[], None] = lambda: None, progress: bool = True) -> list[LoopTimes]:
    """``measure_loader`` for each dict of DataLoader settings, with a progress bar.

    Each dict holds ``num_workers`` and optionally ``prefetch_factor``,
    ``persistent_workers``, ``pin_memory``, ``epochs``, ``label`` (and ``dataset`` to use
    another dataset for that run).
    """
    from tqdm.auto import tqdm

    out = []
    for setting in tqdm(settings, desc="DataLoader settings", disable=not progress):
        kwargs = dict(setting)
        data = kwargs.pop("dataset", dataset)
        kwargs.setdefault("label", f"workers={kwargs['num_workers']}")
        out.append(measure_loader(data, step, batch_size=batch_size, steps=steps,
                                  timer=timer, sync=sync, **kwargs))
    return out


@dataclass(frozen=True)
class Rounds:
    """DataLoader settings run in interleaved rounds: ``runs[label][r]`` is round ``r`` of
    the setting ``label`` (``workers[label]`` workers).  Each round ran every setting once, in
    an order rotating from round to round, so a load that comes and goes slows every setting
    alike (``labsim.lab.timing``'s rule, here with whole DataLoader runs as the calls)."""

    runs: dict[str, tuple[LoopTimes, ...]]
    workers: dict[str, int]

    def periods_s(self, label: str) -> tuple[float, ...]:
        """Steady seconds per step of each round (warm-up skipped as ``LoopTimes.measured``
        skips it): the wait plus the step, averaged over the round's later steps."""
        n = self.workers[label]
        return tuple(wait + step for _, wait, step in
                     (run.measured(n) for run in self.runs[label]))

    def steps_per_s(self, label: str) -> tuple[float, float, float]:
        """Median steps per second over the rounds, with the lower and upper quartiles."""
        from labsim.lab.timing import spread

        rates = sorted(1 / p for p in self.periods_s(label))
        low, high = spread(rates)
        return statistics.median(rates), low, high

    def measured(self, label: str) -> tuple[int, float, float]:
        """``(num_workers, mean wait, mean step)`` over every round's steady steps: what a
        loader model is calibrated on."""
        n = self.workers[label]
        each = [run.measured(n) for run in self.runs[label]]
        return (n, statistics.fmean(w for _, w, _ in each),
                statistics.fmean(s for _, _, s in each))

    def timings(self) -> dict[str, Timing]:
        """Each setting's per-round steady period as a ``Timing``, round ``r`` of every
        setting measured in the same round: what ``labsim.lab.timing.compare`` pairs."""
        return {label: Timing(self.periods_s(label)) for label in self.runs}

    def restart_timings(self, steps: int) -> dict[str, Timing]:
        """For runs of several epochs of ``steps`` steps: each setting's first wait of every
        epoch but the first (the epoch's restart), round after round, as a ``Timing``."""
        out = {}
        for label, runs in self.runs.items():
            waits = [run.wait_s[e * steps] for run in runs
                     for e in range(1, len(run.wait_s) // steps)]
            out[label] = Timing(tuple(waits))
        return out


def sweep_rounds(dataset: Any, step: Callable[[Any], Any], settings: list[dict[str, Any]], *,
                 rounds: int, batch_size: int, steps: int, timer: TimerFn = time_loop,
                 sync: Callable[[], None] = lambda: None, progress: bool = True) -> Rounds:
    """``measure_loader`` for every dict of ``settings`` (as ``sweep`` takes them), in
    ``rounds`` rounds, the order rotating by one setting each round, with a progress bar."""
    from tqdm.auto import tqdm

    if rounds < 1 or not settings:
        raise ValueError("need rounds >= 1 and at least one setting")
    labelled = []
    for setting in settings:
        kwargs = dict(setting)
        kwargs.setdefault("label", f"workers={kwargs['num_workers']}")
        labelled.append(kwargs)
    labels = [s["label"] for s in labelled]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two settings have the same label: {labels}")
    runs: dict[str, list[LoopTimes]] = {label: [] for label in labels}
    with tqdm(total=rounds * len(labelled), desc="DataLoader rounds",
              disable=not progress) as bar:
        for r in range(rounds):
            for k in range(len(labelled)):
                kwargs = dict(labelled[(r + k) % len(labelled)])
                data = kwargs.pop("dataset", dataset)
                runs[kwargs["label"]].append(measure_loader(
                    data, step, batch_size=batch_size, steps=steps, timer=timer, sync=sync,
                    **kwargs))
                bar.update()
    return Rounds({label: tuple(r) for label, r in runs.items()},
                  {s["label"]: s["num_workers"] for s in labelled})


@dataclass(frozen=True)
class Calibration:
    """Median seconds to make one batch in this process and to run one step on it."""

    load_time_s: float
    step_time_s: float
    batch_size: int

    def __repr__(self) -> str:
        return (f"Calibration(load={self.load_time_s * 1e3:.1f} ms/batch, "
                f"step={self.step_time_s * 1e3:.1f} ms, batch_size={self.batch_size})")


def calibrate(dataset: torch.utils.data.Dataset, step: TrainStep, batch_size: int,
              repeats: int = 5, start: int = 0) -> Calibration:
    """Time making a batch (items ``start`` ...) and one step, in this process, median.

    Run it with the thread count the workers use (``torch.set_num_threads(1)``) so the
    numbers mean "one core".
    """
    from torch.utils.data import default_collate

    from labsim.lab.device import synchronize

    loads, steps = [], []
    batch = None
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        first = start + r * batch_size
        batch = default_collate([dataset[(first + i) % len(dataset)]
                                 for i in range(batch_size)])
        t1 = time.perf_counter()
        step(batch)
        synchronize(step.device)
        t2 = time.perf_counter()
        if r:  # the first round warms caches and allocators
            loads.append(t1 - t0)
            steps.append(t2 - t1)
    return Calibration(float(np.median(loads)), float(np.median(steps)), batch_size)


IMAGENET_BATCH_BYTES = 256 * 3 * 224 * 224 * 4  # 256 images of 3 x 224 x 224 in fp32


def copy_overlap(device: torch.device, timer: Callable[..., float], *,
                 nbytes: int = IMAGENET_BATCH_BYTES, side: int = 8192) -> dict[str, Any]:
    """Host-to-device copies of ``nbytes`` from pageable and from pinned memory, and a pinned
    copy issued on a side stream while the default stream runs a bf16 ``side`` x ``side``
    matmul: what lab 06 shows and ``benchmarks/gpu_record.py`` records (one function, so the
    two measure the same thing).  ``timer(fn, warmup, repeat)`` returns the median seconds of
    ``fn``; on a CPU only the two copies are timed (both are plain copies there)."""
    cuda = device.type == "cuda"
    hosts = {"pageable": torch.empty(nbytes // 4)}
    if cuda:
        hosts["pinned"] = torch.empty(nbytes // 4).pin_memory()
    out: dict[str, Any] = {}
    for name, host in hosts.items():
        t = timer(lambda host=host: host.to(device, non_blocking=True), 2, 10)
        out[name] = {"bytes": nbytes, "time_s": t, "bandwidth_Bps": nbytes / t}
    if not cuda:
        return out
    a = torch.randn(side, side, device=device, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    compute = timer(lambda: a @ a, 2, 5)
    pinned = hosts["pinned"]

    def both() -> None:
        with torch.cuda.stream(stream):
            x = pinned.to(device, non_blocking=True)
        a @ a
        torch.cuda.current_stream().wait_stream(stream)
        x.record_stream(torch.cuda.current_stream())

    out["overlap"] = {"compute_s": compute, "copy_s": out["pinned"]["time_s"],
                      "both_s": timer(both, 2, 5)}
    return out
