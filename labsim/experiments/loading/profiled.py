"""A training loop fed by a ``DataLoader``, under ``torch.profiler``: where its time goes.

``profile_loop`` runs a few steps of a real loop the way a profiled training script does
(PyTorch's "Profiler" recipe and ``torch.profiler.schedule``): the loader's workers start
before the profiler, the profiler skips one step and warms up on the next, then records
``steps`` steps; ``prof.step()`` marks each iteration (the trace's ``ProfilerStep#k``
ranges).  Each batch fetch is labelled ``"data"`` and each training step ``"step"`` with
``torch.profiler.record_function``; every ``checkpoint_every`` steps the loop also saves a
checkpoint into memory, unlabelled, as real loops do between steps (checkpoints, logging,
evaluation).  On a CUDA device the step ends with ``sync()`` inside its range, so the range
covers the kernels' work, and the profiler records the GPU's kernels too.

The profiler only sees the process it runs in: a worker's decoding happens in another
process and is not in the trace; what the training process shows during ``"data"`` is
``DataLoader.__next__`` (PyTorch labels it ``enumerate(DataLoader)#...__next__``) and, with
``num_workers=0``, the loading itself (``__getitem__``'s and ``collate``'s operators).

``loop_split`` is the reference of the lab's exercise: from the profiler's events, the
seconds the loop's thread spent in ``"data"`` ranges, in ``"step"`` ranges and in neither,
over the window from the first labelled range's start to the last one's end.
"""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labsim.lab.profile import quiet_profiler
from labsim.trace import Trace

DATA = "data"
"""The ``record_function`` label of a batch fetch (``next(iterator)``)."""
STEP = "step"
"""The ``record_function`` label of a training step (``step(batch)`` and ``sync()``)."""
MAIN = "main thread"
OPERATORS = "torch operators"
KERNELS = "GPU kernels"

Record = tuple[str, int, float, float, str]
"""One profiler event as plain data: ``(name, thread, start_us, end_us, device)``, device
``"cpu"`` for what ran on a host thread, ``"cuda"`` for a GPU kernel (its "thread" is the
stream)."""


def merged_length(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def split_records(records: Sequence[Record], data: str = DATA, step: str = STEP
                  ) -> dict[str, float]:
    """Seconds in ``data`` ranges, in ``step`` ranges and in neither, on the loop's thread.

    The window runs from the start of the first labelled range to the end of the last; the
    labels' ranges do not overlap one another (one loop, one thread), so ``idle_s`` is the
    window less the two.  Other events (the operators inside the ranges, other threads,
    ``ProfilerStep#k``, work outside the window) do not count.
    """
    ranges = {label: [(s, e) for name, _, s, e, device in records
                      if name == label and device == "cpu"]
              for label in (data, step)}
    spans = ranges[data] + ranges[step]
    if not spans:
        raise ValueError(f"no {data!r} or {step!r} range among the events")
    window_us = max(e for _, e in spans) - min(s for s, _ in spans)
    data_us, step_us = merged_length(ranges[data]), merged_length(ranges[step])
    return {"data_s": data_us / 1e6, "compute_s": step_us / 1e6,
            "idle_s": max(0.0, window_us - data_us - step_us) / 1e6}


def records_of(events: Iterable[Any]) -> list[Record]:
    """Every profiler event as a ``Record`` (plain data)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name, int(e.thread), float(e.time_range.start), float(e.time_range.end),
             "cuda" if e.device_type == cuda else "cpu") for e in events]


def loop_split(events: Iterable[Any]) -> dict[str, float]:
    """``split_records`` of the profiler's events (``prof.events()``)."""
    return split_records(records_of(events))


def _top_operators(events: Sequence[Any], thread: int) -> list[tuple[float, float]]:
    """(start_us, end_us) of the ATen operators on ``thread`` not called by another one."""
    out = []
    for e in events:
        if e.thread != thread or not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            out.append((float(e.time_range.start), float(e.time_range.end)))
    return out


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def timeline(events: Sequence[Any]) -> Trace:
    """The loop's thread as a ``Trace`` (seconds from the window's start): stream
    ``"main thread"`` with ``load`` spans for ``"data"``, ``compute`` for ``"step"`` and
    ``idle`` for neither; stream ``"torch operators"`` (kind ``compute``) where a top-level
    ATen operator ran on that thread; on a GPU, stream ``"GPU kernels"`` where a kernel ran."""
    labelled = [e for e in events if e.name in (DATA, STEP)
                and e.device_type == torch.autograd.DeviceType.CPU]
    if not labelled:
        raise ValueError(f"no {DATA!r} or {STEP!r} range among the events")
    labelled.sort(key=lambda e: e.time_range.start)
    t0, t1 = labelled[0].time_range.start, max(e.time_range.end for e in labelled)
    trace = Trace(rank_label="run")
    reach = t0
    for k, e in enumerate(labelled):
        start, end = e.time_range.start, e.time_range.end
        if start > reach:
            trace.add(0, MAIN, "idle", (reach - t0) / 1e6, (start - t0) / 1e6, "neither")
        kind = "load" if e.name == DATA else "compute"
        trace.add(0, MAIN, kind, (start - t0) / 1e6, (end - t0) / 1e6, f"{e.name} {k // 2}")
        reach = max(reach, end)
    for start, end in _union(_top_operators(events, labelled[0].thread)):
        if end > t0 and start < t1:
            trace.add(0, OPERATORS, "compute", (max(start, t0) - t0) / 1e6,
                      (min(end, t1) - t0) / 1e6)
    kernels = [(float(e.time_range.start), float(e.time_range.end)) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    for start, end in _union(kernels):
        if end > t0 and start < t1:
            trace.add(0, KERNELS, "compute", (max(start, t0) - t0) / 1e6,
                      (min(end, t1) - t0) / 1e6)
    return trace


@dataclass(frozen=True)
class ProfiledLoop:
    """The profiler's record of ``steps`` steps of one loop.

    ``events``: ``prof.events()`` (``torch.autograd.profiler_util.EventList``: each event has
    ``name``, ``thread``, ``time_range`` in µs, ``cpu_parent``, ``cpu_children``...);
    ``chrome``: the Chrome trace-event JSON ``prof.export_chrome_trace`` wrote.
    """

    label: str
    num_workers: int
    steps: int
    events: Any = field(repr=False)
    chrome: dict = field(repr=False)

    def to_chrome(self, path: str | Path) -> Path:
        """Write the Chrome trace to ``path`` (open it in ui.perfetto.dev or chrome://tracing)."""
        path = Path(path)
        if not path.parent.is_dir():
            raise ValueError(f"the folder {str(path.parent)!r} does not exist")
        path.write_text(json.dumps(self.chrome), encoding="utf-8")
        return path

    def timeline(self) -> Trace:
        return timeline(self.events)


def profile_loop(dataset: Any, step: Callable[[Any], Any], *, batch_size: int,
                 num_workers: int, steps: int = 8, checkpoint_every: int = 3,
                 sync: Callable[[], None] = lambda: None,
                 device: torch.device | str = "cpu", label: str = "") -> ProfiledLoop:
    """Profile ``steps`` steps of ``step`` fed by ``DataLoader(dataset, num_workers=...)``.

    Iteration ``k`` (after the profiler's skipped and warm-up iterations) saves
    ``step.model``'s state into memory first when ``k`` is a multiple of
    ``checkpoint_every`` (not at 0), then fetches a batch under ``"data"`` and runs
    ``step(batch)`` and ``sync()`` under ``"step"``.
    """
    import multiprocessing as mp

    from torch.profiler import ProfilerActivity, profile, record_function, schedule
    from torch.utils.data import DataLoader, Subset

    if steps < 1 or checkpoint_every < 1:
        raise ValueError("steps and checkpoint_every must be >= 1")
    skipped = 2  # the schedule's wait and warm-up iterations
    subset = Subset(dataset, range(min(len(dataset), (steps + skipped) * batch_size)))
    context = "fork" if num_workers and "fork" in mp.get_all_start_methods() else None
    loader = DataLoader(subset, batch_size=batch_size, num_workers=num_workers,
                        multiprocessing_context=context, drop_last=True)
    on_gpu = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    model = getattr(step, "model", None)
    iterator = iter(loader)  # workers start here, before the profiler
    try:
        with quiet_profiler(), profile(activities=activities,
                                       schedule=schedule(wait=1, warmup=1, active=steps)
                                       ) as prof:
            for i in range(steps + skipped):
                k = i - skipped
                if model is not None and k > 0 and k % checkpoint_every == 0:
                    torch.save(model.state_dict(), io.BytesIO())
                with record_function(DATA):
                    batch = next(iterator)
                with record_function(STEP):
                    step(batch)
                    sync()
                prof.step()
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        chrome = json.loads(path.read_text(encoding="utf-8"))
    name = label or f"num_workers={num_workers}"
    return ProfiledLoop(name, num_workers, steps, prof.events(), chrome)
