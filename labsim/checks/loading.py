"""Checks for the data-loading lab: timing a training loop, a loader model calibrated from
measured runs that predicts an unmeasured number of workers, an
IterableDataset sharded across DataLoader workers (each item once: the duplicate-data bug).

``time_loop`` runs the learner's loop timer on scripted loaders with a fake clock, so every
case is exact and instant: the loader advances the clock when it hands over a batch, the step
when it launches work, ``sync`` when it waits for an asynchronous device to finish.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from labsim.checks._core import Case, Spec, call_each, close
from labsim.experiments.loading import time_loop as reference_time_loop
from labsim.loading import calibrated_steps_per_s, loader_step_period_s

FORBID = ("labsim.experiments.loading:*", "labsim.loading:*", "labsim.sim.loading:*")


class _Script:
    """A fake clock, loader, step and sync that advance time as scripted."""

    def __init__(self, waits: Sequence[float], launch: Sequence[float],
                 finish: Sequence[float], tail_s: float = 0.0) -> None:
        self.t = 100.0
        self.waits, self.launch, self.finish, self.tail_s = waits, launch, finish, tail_s
        self.steps = 0

    def clock(self) -> float:
        return self.t

    def batches(self) -> Iterator[int]:
        for i, w in enumerate(self.waits):
            self.t += w
            yield i
        self.t += self.tail_s  # shutting workers down after the last batch

    def step(self, batch: Any) -> None:
        self.t += self.launch[batch]
        self.steps += 1

    def sync(self) -> None:
        if self.steps:
            self.t += self.finish[self.steps - 1]
            self.finish = list(self.finish)
            self.finish[self.steps - 1] = 0.0  # a second sync finds nothing left to wait for


def _loop_case(name: str, waits: Sequence[float], launch: Sequence[float],
               finish: Sequence[float] | None = None, tail_s: float = 0.0) -> Case:
    finish = finish if finish is not None else [0.0] * len(waits)
    ref = _Script(waits, launch, finish, tail_s)
    expected = reference_time_loop(ref.batches(), ref.step, sync=ref.sync, clock=ref.clock)
    return Case(name, args=(waits, launch, finish, tail_s), expected=list(expected))


def _time_loop_cases() -> list[Case]:
    return [
        _loop_case("three batches, the second one late", [0.5, 0.0, 2.0], [1.0, 1.0, 1.0]),
        _loop_case("no batches at all", [], []),
        _loop_case("one batch already waiting", [0.0], [0.25]),
        _loop_case("asynchronous device: the step returns before its work is done",
                   [0.1, 0.3, 0.0, 0.2], [0.001, 0.001, 0.002, 0.001],
                   [0.8, 0.8, 1.6, 0.8]),
        _loop_case("the loader takes 5 s to shut down after the last batch",
                   [1.0, 0.0], [0.5, 0.5], tail_s=5.0),
        _loop_case("long run with a straggler", [0.1] * 5 + [3.0] + [0.1] * 4,
                   [0.2] * 10, [0.3] * 10),
    ]


def _run_script(fn: Callable[..., Any], waits: Sequence[float], launch: Sequence[float],
                finish: Sequence[float], tail_s: float) -> Any:
    script = _Script(waits, launch, finish, tail_s)
    got = fn(script.batches(), script.step, sync=script.sync, clock=script.clock)
    if script.steps != len(waits):
        return f"step was called {script.steps} times for {len(waits)} batches"
    if isinstance(got, tuple):
        got = list(got)
    return got


def _drive_loop(fns, cases, spec):  # noqa: ANN001, ANN202
    return call_each([lambda *a: _run_script(fns[0], *a)], cases, spec)


time_loop = Spec("time_loop", _time_loop_cases, drive=_drive_loop,
                 compare=close(rtol=1e-9, atol=1e-12), forbid=FORBID, ops=False)
"""``fn(batches, step, sync=..., clock=...) -> (wait_s, step_s)`` on scripted loaders."""


def _runs(load_s: float, step_s: float, workers: Sequence[int],
          cores: int | None = None) -> list[tuple[int, float, float]]:
    """Synthetic measurements ``(N, mean wait, mean step)`` of a loader with known L and S."""
    out = []
    for n in workers:
        period = loader_step_period_s(n, load_s, step_s, cores)
        out.append((n, round(period - step_s, 12), step_s))
    return out


def _prediction_cases() -> list[Case]:
    settings = [  # name, measured runs, workers to predict, free cores
        ("only an in-process run: its wait is the load time L",
         _runs(0.21, 0.097, [0]), 1, 4),
        ("one worker that kept the loop waiting: its period is L; predict three",
         _runs(0.15, 0.1, [1]), 3, 8),
        ("two workers, still too slow: their period is L / 2",
         _runs(0.24, 0.05, [2]), 3, 8),
        ("a run that kept up with the step says nothing about L",
         _runs(0.03, 0.01, [0, 4]), 2, 8),
        ("the waiting run comes second", _runs(0.05, 0.02, [3, 1]), 2, 4),
        ("more workers than free cores: they share the cores",
         _runs(0.15, 0.05, [1]), 4, 2),
        ("predict loading in the main process from a worker run",
         _runs(0.12, 0.04, [2]), 0, 4),
        ("three runs from starving to fed, predict six workers",
         _runs(0.4, 0.06, [0, 1, 2, 8]), 6, 16),
    ]
    return [Case(name, args=(runs, n, cores),
                 expected=calibrated_steps_per_s(runs, n, cores))
            for name, runs, n, cores in settings]


def _drive_prediction(fns, cases, spec):  # noqa: ANN001, ANN202
    return call_each([lambda runs, n, cores: fns[0]([tuple(r) for r in runs], n, cores)],
                     cases, spec)


calibrated_prediction = Spec("calibrated_prediction", _prediction_cases,
                             drive=_drive_prediction, compare=close(rtol=1e-6),
                             forbid=FORBID, ops=False)
"""``fn(runs, num_workers, free_cores) -> steps per second``: calibrate L and S from measured
runs ``(num_workers, mean_wait_s, mean_step_s)`` and predict another number of workers."""


# --------------------------------------------------------------------------------------
# an IterableDataset sharded across DataLoader workers

SHARD_SETTINGS = [("no workers: the main process yields everything", 10, 0),
                  ("one worker", 10, 1),
                  ("two workers", 10, 2),
                  ("three workers, 7 items (uneven shares)", 7, 3),
                  ("more workers than items", 2, 3),
                  ("an empty dataset", 0, 2)]


def _tag(item: Any) -> tuple[int, Any]:
    """collate_fn run inside the worker (batch_size=None): which worker produced ``item``."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (-1 if info is None else info.id), item


def stream_items(cls: Callable[[int], Any], n_items: int, num_workers: int) -> dict[str, Any]:
    """Everything a real ``DataLoader(cls(n_items), num_workers=...)`` yields, items sorted
    (duplicates kept), and how many items each worker produced."""
    import multiprocessing as mp

    from torch.utils.data import DataLoader

    context = "fork" if num_workers and "fork" in mp.get_all_start_methods() else None
    with warnings.catch_warnings():  # more workers than cores on purpose: PyTorch says so
        warnings.filterwarnings("ignore", message=".*DataLoader will create", category=UserWarning)
        loader = DataLoader(cls(n_items), batch_size=None, num_workers=num_workers,
                            collate_fn=_tag, multiprocessing_context=context)
        pairs = list(loader)
    counts = [sum(1 for w, _ in pairs if w == k) for k in range(num_workers)]
    items = sorted(int(x) for _, x in pairs)
    return {"items": items, "balanced": max(counts, default=0) - min(counts, default=0) <= 1}


def _shard_cases() -> list[Case]:
    return [Case(name, args=(n, w), expected={"items": list(range(n)), "balanced": True})
            for name, n, w in SHARD_SETTINGS]


def _drive_shards(fns, cases, spec):  # noqa: ANN001, ANN202
    return call_each([lambda n, w: stream_items(fns[0], n, w)], cases, spec)


def _same_items(got: Any, expected: dict[str, Any]) -> str | None:
    if not isinstance(got, dict) or set(got) != set(expected):
        return f"expected a summary of what the loader yielded, got {got!r}"
    items, want = got["items"], expected["items"]
    if items != want:
        dup = sorted({x for x in items if items.count(x) > 1})
        lost = sorted(set(want) - set(items))
        what = (f"items {dup[:6]} came more than once (every worker iterates the whole "
                "dataset unless it takes its own share)" if dup else f"items {lost[:6]} never came")
        return f"{len(items)} items for {len(want)}: {what}"
    if not got["balanced"]:
        return "one worker produced most items: split them evenly (worker w takes w, w + W, ...)"
    return None


sharded_stream = Spec("sharded_stream", _shard_cases, drive=_drive_shards,
                      compare=_same_items, forbid=FORBID, ops=False)
"""``cls(n_items)``: an ``IterableDataset`` of the ints ``0 .. n_items - 1``; through a real
``DataLoader`` with 0 to 3 workers every item comes exactly once, the workers' shares within
one item of each other."""
