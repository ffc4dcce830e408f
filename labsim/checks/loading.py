"""Checks for the data-loading lab: timing a training loop, a loader model calibrated from
measured runs that predicts an unmeasured number of workers, the split of a profiled loop's
time read from ``torch.profiler``'s events, and an IterableDataset sharded across DataLoader
workers (each item once: the duplicate-data bug).

``time_loop`` runs the learner's loop timer on scripted loaders with a fake clock, so every
case is exact and instant: the loader advances the clock when it hands over a batch, the step
when it launches work, ``sync`` when it waits for an asynchronous device to finish.
``loop_split`` hands the learner's function traces the check builds (``_loop_records``) as the
profiler's own ``EventList`` of ``FunctionEvent``s, so the answer is in no trace the lab shows.
``sharded_stream`` runs the learner's dataset through a real ``DataLoader`` and records which
worker produced every item.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from labsim.checks._core import Case, Spec, call_each, close
from labsim.experiments.loading import time_loop as reference_time_loop
from labsim.experiments.loading.profiled import DATA, STEP
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

SHARD_SETTINGS = [  # name, items, workers, epochs
    ("no workers: the main process yields everything", 10, 0, 1),
    ("one worker", 10, 1, 1),
    ("two workers", 10, 2, 1),
    ("three workers, 7 items (who gets item 6?)", 7, 3, 1),
    ("four workers, 10 items (uneven shares)", 10, 4, 1),
    ("more workers than items", 2, 3, 1),
    ("an empty dataset", 0, 2, 1),
    ("two epochs in the main process: the second yields everything again", 5, 0, 2),
    ("two epochs, two workers, 5 items", 5, 2, 2),
]


def _tag(item: Any) -> tuple[int, Any]:
    """collate_fn run inside the worker (batch_size=None): which worker produced ``item``."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (-1 if info is None else info.id), item


def _shut_down(iterator: Any) -> None:
    """Stop a DataLoader iterator's workers now and wait for its queues' feeder threads: a
    feeder that is still ending when the case ends would read as a thread left running."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is None:  # no workers: nothing runs beside the loop
        return
    shutdown()
    for queue in getattr(iterator, "_index_queues", []):
        feeder = getattr(queue, "_thread", None)
        if feeder is not None:
            feeder.join(timeout=5.0)


def stream_items(cls: Callable[[int], Any], n_items: int, num_workers: int,
                 epochs: int = 1) -> dict[str, Any]:
    """Everything ``epochs`` passes of a real ``DataLoader(cls(n_items), num_workers=...)``
    yield: the items sorted (duplicates kept) and the largest number of items one worker
    produced in one epoch."""
    import multiprocessing as mp

    from torch.utils.data import DataLoader

    context = "fork" if num_workers and "fork" in mp.get_all_start_methods() else None
    items: list[int] = []
    largest = 0
    with warnings.catch_warnings():  # more workers than cores on purpose: PyTorch says so
        warnings.filterwarnings("ignore", message=".*DataLoader will create", category=UserWarning)
        loader = DataLoader(cls(n_items), batch_size=None, num_workers=num_workers,
                            collate_fn=_tag, multiprocessing_context=context)
        for _ in range(epochs):
            iterator = iter(loader)
            try:
                pairs = list(iterator)
            finally:  # a worker's error leaves no worker behind to be joined later
                _shut_down(iterator)
                del iterator
            items += [int(x) for _, x in pairs]
            shares = [sum(1 for w, _ in pairs if w == k) for k in {w for w, _ in pairs}]
            largest = max([largest, *shares])
    return {"items": sorted(items), "largest_share": largest}


def fair_share(n_items: int, num_workers: int) -> int:
    """The most items one worker may yield in an epoch when every worker takes its share:
    ``ceil(n / W)`` (all of them in the main process)."""
    return n_items if num_workers == 0 else -(-n_items // num_workers)


def _shard_cases() -> list[Case]:
    return [Case(name, args=(n, w, epochs),
                 expected={"items": sorted(list(range(n)) * epochs),
                           "largest_share": fair_share(n, w)})
            for name, n, w, epochs in SHARD_SETTINGS]


def _drive_shards(fns, cases, spec):  # noqa: ANN001, ANN202
    return call_each([lambda n, w, epochs: stream_items(fns[0], n, w, epochs)], cases, spec)


def _same_items(got: Any, expected: dict[str, Any]) -> str | None:
    if not isinstance(got, dict) or set(got) != set(expected):
        return f"expected a summary of what the loader yielded, got {got!r}"
    items, want = got["items"], expected["items"]
    if items != want:
        counts = {x: want.count(x) for x in set(want)}
        extra = sorted({x for x in items if items.count(x) > counts.get(x, 0)})
        lost = sorted({x for x in want if items.count(x) < counts[x]})
        per = " per epoch" if len(want) > len(counts) else ""
        what = (f"items {extra[:6]} came more than once{per} (every worker iterates its own "
                "copy of the dataset: each must take only its share)" if extra
                else f"items {lost[:6]} never came{per} (no worker took them)")
        return f"{len(items)} items for {len(want)}: {what}"
    if got["largest_share"] > expected["largest_share"]:
        return (f"one worker produced {got['largest_share']} items in an epoch, more than a "
                f"fair share ({expected['largest_share']}): split them so every worker "
                "takes part")
    return None


sharded_stream = Spec("sharded_stream", _shard_cases, drive=_drive_shards,
                      compare=_same_items, forbid=FORBID, ops=False)
"""``cls(n_items)``: an ``IterableDataset`` of the ints ``0 .. n_items - 1``; through a real
``DataLoader`` with 0 to 4 workers, over one or two epochs, every item comes exactly once per
epoch and no worker yields more than ``ceil(n / W)`` of them."""


# --------------------------------------------------------------------------------------
# reading a profiler trace: where the loop's time went

def _loop_records(seed: int, steps: int, *, workers: int, data_ms: tuple[float, float],
                  step_ms: tuple[float, float], checkpoint_every: int = 0,
                  checkpoint_ms: float = 0.0, gpu: bool = False, outside: bool = False,
                  offset_us: float = 0.0) -> list[list[Any]]:
    """A profiled training loop as the profiler records it, in plain data: one row
    ``[name, thread, start_us, end_us, device]`` per event, the loop on thread 1.

    Every iteration is a ``ProfilerStep*`` range (``ProfilerStep#k`` in the Chrome trace)
    holding, every ``checkpoint_every`` iterations, a checkpoint's operators; then a ``data``
    range around ``DataLoader.__next__`` (with ``workers=0`` the items' and the collate's
    operators inside, with workers the batch rebuilt from shared memory); then a ``step``
    range with its forward, backward and optimizer operators.  ``gpu``: the backward's
    operators also run on autograd's device thread (2), kernels on a CUDA stream (7) outlast
    the step's launches and the ``step`` label annotates them on the GPU's timeline too;
    ``outside``: operators before the first fetch and after the last step.
    """
    import random

    rng = random.Random(seed)
    rows: list[list[Any]] = []

    def add(name: str, start: float, end: float, thread: int = 1, device: str = "cpu") -> None:
        rows.append([name, thread, round(offset_us + start, 3), round(offset_us + end, 3),
                     device])

    t = 40.0
    if outside:
        add("aten::empty", 3.0, 9.0)
        add("aten::zeros", 12.0, 31.0)
    it = "_SingleProcessDataLoaderIter" if workers == 0 else "_MultiProcessingDataLoaderIter"
    for k in range(steps):
        begin = t
        if checkpoint_every and k and k % checkpoint_every == 0:
            gap = checkpoint_ms * 1e3 * rng.uniform(0.8, 1.2)
            for j in range(4):
                add("aten::detach", t + 30 + j * gap / 4, t + 60 + j * gap / 4)
            t += gap
        t += rng.uniform(5, 20)
        data = rng.uniform(*data_ms) * 1e3
        add("data", t, t + data)
        add(f"enumerate(DataLoader)#{it}.__next__", t + 3, t + data - 2)
        if workers == 0:  # the items' operators, then the collate's
            for j in range(4):
                at = t + (j + 0.5) * data / 5
                add("aten::div", at, at + 25)
            add("aten::stack", t + data - 60, t + data - 8)
        else:  # the batch's tensors rebuilt from the worker's shared memory
            add("aten::set_", t + data - 30, t + data - 12)
        t += data + rng.uniform(10, 40)
        step = rng.uniform(*step_ms) * 1e3
        add("step", t, t + step)
        add("aten::linear", t + 5, t + 0.3 * step)
        add("aten::addmm", t + 8, t + 0.3 * step - 4)
        add("autograd::engine::evaluate_function: AddmmBackward0", t + 0.32 * step,
            t + 0.85 * step)
        add("aten::mm", t + 0.33 * step, t + 0.84 * step)
        add("Optimizer.step#SGD.step", t + 0.87 * step, t + step - 6)
        add("aten::add_", t + 0.88 * step, t + step - 9)
        if gpu:
            add("aten::mm", t + 0.34 * step, t + 0.6 * step, thread=2)
            add("ampere_sgemm_128x64_nn", t + 0.1 * step, t + 1.3 * step, thread=7,
                device="cuda")
            add("step", t + 0.1 * step, t + 1.3 * step, thread=7, device="cuda")  # annotation
        t += step + rng.uniform(5, 15)
        add("ProfilerStep*", begin, t)  # prof.events() names every ProfilerStep#k so
    if outside:
        add("aten::zeros", t + 50, t + 900)
        add("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", t + 950, t + 4000)
    return rows


LOOP_TRACES = [  # name, the loop's settings
    ("loading in the training process: the data ranges hold the loading's operators",
     dict(seed=1, steps=4, workers=0, data_ms=(120, 180), step_ms=(30, 50))),
    ("one worker that keeps up, a checkpoint every 2 steps between the ranges",
     dict(seed=2, steps=6, workers=1, data_ms=(0.05, 0.4), step_ms=(40, 60),
          checkpoint_every=2, checkpoint_ms=25)),
    ("a GPU run: backward operators on autograd's thread, kernels on a CUDA stream",
     dict(seed=3, steps=5, workers=2, data_ms=(5, 30), step_ms=(8, 12), gpu=True,
          checkpoint_every=3, checkpoint_ms=12)),
    ("operators before the first fetch and after the last step",
     dict(seed=4, steps=3, workers=1, data_ms=(40, 90), step_ms=(20, 30), outside=True,
          offset_us=2.5e6)),
    ("one step only", dict(seed=5, steps=1, workers=0, data_ms=(60, 60), step_ms=(15, 15))),
    ("workers far behind, a long checkpoint every 3 steps",
     dict(seed=6, steps=7, workers=4, data_ms=(200, 400), step_ms=(10, 14),
          checkpoint_every=3, checkpoint_ms=150, offset_us=7.25e5)),
]


def _split_cases() -> list[Case]:
    from labsim.experiments.loading.profiled import split_records

    cases = []
    for name, settings in LOOP_TRACES:
        rows = _loop_records(**settings)
        expected = split_records([(n, t, s, e, d) for n, t, s, e, d in rows])
        cases.append(Case(name, args=(rows,), expected=expected))
    return cases


def profiler_events(rows: Sequence[Sequence[Any]]) -> Any:
    """The rows as the profiler's own ``EventList`` of ``FunctionEvent``s (what
    ``prof.events()`` returns), parents and children linked as the profiler links them."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    def event(i: int, name: str, thread: int, start: float, end: float, device: str) -> Any:
        kernel = device == "cuda" and name not in (DATA, STEP)
        return FunctionEvent(
            id=i, name=name, thread=thread, start_us=start, end_us=end, stack=[],
            input_shapes=[], device_type=DeviceType.CUDA if device == "cuda" else DeviceType.CPU,
            is_user_annotation=not kernel and not name.startswith(("aten::", "autograd::")))

    events = EventList([event(i, str(name), int(thread), float(start), float(end), str(device))
                        for i, (name, thread, start, end, device) in enumerate(rows)])
    events._build_tree()
    return events


def _drive_split(fns, cases, spec):  # noqa: ANN001, ANN202
    return call_each([lambda rows: fns[0](profiler_events(rows))], cases, spec)


def _same_split(got: Any, expected: dict[str, float]) -> str | None:
    reason = close(rtol=1e-6, atol=1e-9)(got, expected)
    if reason is None or not isinstance(got, dict) or set(got) != set(expected):
        return reason
    try:
        values = {k: float(got[k]) for k in expected}
    except (TypeError, ValueError):
        return reason
    window = sum(expected.values())
    if any(abs(v) > 1e3 * window for v in values.values()) and window > 0:
        return reason + " (the profiler's times are in microseconds; the split is in seconds)"
    if abs(sum(values.values()) - window) > 1e-6 * window:
        return (reason + f" (the three add up to {sum(values.values()):.6g} s, the window from "
                f"the first labelled range to the end of the last is {window:.6g} s)")
    return reason


loop_split = Spec("loop_split", _split_cases, drive=_drive_split, compare=_same_split,
                  forbid=(*FORBID, "labsim.experiments.loading.profiled:*"), ops=False)
"""``fn(events) -> {"data_s", "compute_s", "idle_s"}`` from a profiled loop's events (the
profiler's ``EventList``): seconds in ``"data"`` ranges, in ``"step"`` ranges and in neither,
over the window from the first labelled range's start to the last one's end."""
