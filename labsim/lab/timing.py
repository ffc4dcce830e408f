"""Timing that survives a busy machine: one thread, interleaved rounds, and verdicts that say
"too noisy to tell" instead of a wrong conclusion.

A timing on a shared laptop or a Binder pod is disturbed by whatever else runs: another
process takes a core for a while, the clock drops, the OS moves threads between cores.  Three
habits keep a comparison honest:

* **one thread** (``one_thread``): an op timed on all cores measures the OS scheduler as much
  as the op whenever a core is busy elsewhere; on one thread it measures the op;
* **interleaved rounds** (``time_interleaved``): time the contenders in rounds, one call of
  each per round, so a load that comes and goes slows all of them alike, and compare them round
  by round;
* **a verdict with its spread** (``compare``): the ratio of two contenders in each round; if
  the middle half of those ratios sits on one side of 1, say which is faster and by how much,
  and if it straddles 1 say "too noisy to tell" -- never a verdict the next run may reverse.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from labsim.lab.device import Timing, synchronize


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(1)``, the old setting restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    *,
    device: torch.device | str = "cpu",
    warmup: int = 1,
    rounds: int = 7,
    max_seconds: float | None = None,
) -> dict[str, Timing]:
    """Time each of ``fns`` in ``rounds`` rounds, one synchronised call of each per round (the
    order rotating from round to round), after ``warmup`` untimed calls of each.  Round ``i`` of
    every returned ``Timing`` was measured at about the same moment, so ``compare`` can pair
    them.  ``max_seconds`` stops after the round that passes it (at least one round runs)."""
    if not fns:
        raise ValueError("time_interleaved needs at least one function to time")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    start_all = time.perf_counter()
    for r in range(rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            start = time.perf_counter()
            fns[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
        if max_seconds is not None and time.perf_counter() - start_all > max_seconds:
            break
    return {name: Timing(tuple(ts)) for name, ts in times.items()}


def spread(values: tuple[float, ...] | list[float]) -> tuple[float, float]:
    """The lower and upper quartiles of ``values`` (both the value itself for one value)."""
    if len(values) == 1:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


@dataclass(frozen=True)
class Comparison:
    """How much longer ``slow`` takes than ``fast``, round by round.

    ``ratio`` is the median over rounds of (time of ``slow``) / (time of ``fast``), ``low`` and
    ``high`` its quartiles.  ``settled`` is False when the quartiles straddle the threshold
    band around 1: the rounds disagree on which is faster, and no verdict is printed."""

    fast: str
    slow: str
    ratio: float
    low: float
    high: float
    rounds: int
    threshold: float

    @property
    def settled(self) -> bool:
        return self.low > self.threshold or self.high < 1 / self.threshold \
            or (self.low >= 1 / self.threshold and self.high <= self.threshold)

    @property
    def same_speed(self) -> bool:
        """Every middle-half ratio lies within the threshold band: neither is faster."""
        return self.low >= 1 / self.threshold and self.high <= self.threshold

    @property
    def verdict(self) -> str:
        band = f"{self.low:.2f}-{self.high:.2f}x over {self.rounds} rounds"
        if not self.settled:
            return (f"too noisy to tell: {self.slow} / {self.fast} ranged {band} -- rerun, "
                    f"ideally with nothing else running")
        if self.same_speed:
            pct = (self.threshold - 1) * 100
            return f"{self.fast} and {self.slow} take the same time within {pct:.0f} % ({band})"
        return f"{self.fast} is {self.ratio:.2f}x faster than {self.slow} ({band})"

    def __str__(self) -> str:
        return self.verdict


def compare(timings: Mapping[str, Timing], a: str, b: str, *,
            threshold: float = 1.1) -> Comparison:
    """Compare ``timings[a]`` with ``timings[b]`` round by round (both from one
    ``time_interleaved`` call).  The returned ``Comparison`` names the faster one by the median
    ratio; its ``verdict`` says "too noisy to tell" when the middle half of the per-round
    ratios does not sit clearly on one side (beyond ``threshold``) or clearly within it."""
    if threshold <= 1:
        raise ValueError(f"threshold must be > 1 (e.g. 1.1 for 10 %), got {threshold}")
    ta, tb = timings[a].times_s, timings[b].times_s
    n = min(len(ta), len(tb))
    if n == 0:
        raise ValueError("no rounds to compare")
    ratios = [tb[i] / ta[i] for i in range(n)]  # > 1: a is faster
    med = statistics.median(ratios)
    if med >= 1:
        fast, slow = a, b
    else:
        fast, slow, ratios, med = b, a, [1 / r for r in ratios], 1 / med
    low, high = spread(ratios)
    return Comparison(fast, slow, med, low, high, n, threshold)
