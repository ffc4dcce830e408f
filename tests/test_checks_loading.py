"""The data-loading checks pass the reference and fail wrong answers (labsim.checks.loading)."""

import pytest

from labsim import checks as check
from labsim.checks import CheckFailed
from labsim.experiments import loading as reference
from labsim.loading import calibrated_steps_per_s


def time_loop(batches, step, *, sync=lambda: None, clock=None):
    wait_s, step_s = [], []
    t = clock()
    for batch in batches:
        got = clock()
        step(batch)
        sync()
        done = clock()
        wait_s.append(got - t)
        step_s.append(done - got)
        t = done
    return wait_s, step_s


def predict(runs, num_workers, free_cores):
    """The exercise: fit L and S to the runs, then the slower side sets the pace."""
    step = sum(s for _, _, s in runs) / len(runs)
    loads = [w if n == 0 else n * (w + s) for n, w, s in runs if w > 0.05 * s]
    load = sum(loads) / len(loads)
    if num_workers == 0:
        return 1 / (load + step)
    return 1 / max(step, load / min(num_workers, free_cores))


def test_solutions_pass(capsys):
    check.loading.time_loop(time_loop)
    check.loading.calibrated_prediction(predict)
    out = capsys.readouterr().out.splitlines()
    assert out == ["PASS time_loop: 6/6 cases passed",
                   "PASS calibrated_prediction: 8/8 cases passed"]


@pytest.mark.parametrize(("name", "ref"), [("time_loop", reference.time_loop),
                                          ("calibrated_prediction", calibrated_steps_per_s)])
def test_the_reference_itself_or_a_wrapper_of_it_fails(name, ref):
    for fn in (ref, lambda *a, **k: ref(*a, **k)):
        with pytest.raises(CheckFailed, match="calls labsim's own reference"):
            getattr(check.loading, name)(fn)


def test_forgetting_sync_fails():
    def no_sync(batches, step, *, sync=lambda: None, clock=None):
        return time_loop(batches, step, clock=clock)

    with pytest.raises(CheckFailed, match="asynchronous device"):
        check.loading.time_loop(no_sync)


def test_counting_wait_from_the_step_start_fails():
    def wrong(batches, step, *, sync=lambda: None, clock=None):
        waits, steps = [], []
        for batch in batches:
            t0 = clock()
            step(batch)
            sync()
            steps.append(clock() - t0)
            waits.append(0.0)
        return waits, steps

    with pytest.raises(CheckFailed, match="late"):
        check.loading.time_loop(wrong)


def test_stub_fails():
    def stub(*args, **kwargs):
        raise NotImplementedError

    for fn in (check.loading.time_loop, check.loading.calibrated_prediction):
        with pytest.raises(CheckFailed, match="not implemented"):
            fn(stub)


def _variant(*, loads=None, pace=None, step=None):
    """The exercise with one piece replaced by a wrong model."""
    def fn(runs, num_workers, free_cores):
        s = step(runs) if step else sum(r[2] for r in runs) / len(runs)
        est = loads(runs) if loads else [w if n == 0 else n * (w + st)
                                         for n, w, st in runs if w > 0.05 * st]
        load = sum(est) / len(est)
        if pace:
            return pace(load, s, num_workers, free_cores)
        if num_workers == 0:
            return 1 / (load + s)
        return 1 / max(s, load / min(num_workers, free_cores))
    return fn


WRONG_MODELS = {
    # the period of a worker run taken as L whatever the number of workers
    "ignores the workers in the fit": _variant(
        loads=lambda runs: [w + s if n else w for n, w, s in runs if w > 0.05 * s]),
    # every run's period used, also those that kept up with the step (they only bound L)
    "fits runs that did not wait": _variant(
        loads=lambda runs: [w if n == 0 else n * (w + s) for n, w, s in runs]),
    # the wait alone taken as L, as in the main process
    "wait as the load time": _variant(
        loads=lambda runs: [w for n, w, s in runs if w > 0.05 * s]),
    # only the first run
    "calibrates on the first run only": _variant(
        loads=lambda runs: [runs[0][1] if runs[0][0] == 0
                            else runs[0][0] * (runs[0][1] + runs[0][2])]),
    # the loader's rate alone: the step never limits
    "ignores that the step sets the pace": _variant(
        pace=lambda load, s, n, c: 1 / (load + s) if n == 0 else min(n, c) / load),
    # a worker per core assumed, whatever the cores
    "ignores the free cores": _variant(
        pace=lambda load, s, n, c: 1 / (load + s) if n == 0 else 1 / max(s, load / n)),
    # workers overlap loading with the step even without workers
    "no special case for the main process": _variant(
        pace=lambda load, s, n, c: 1 / max(s, load / max(1, min(n, c)))),
    # the prediction does not depend on the workers asked for
    "predicts the measured rate": _variant(
        pace=lambda load, s, n, c: 1 / (load + s)),
}


@pytest.mark.parametrize("name", WRONG_MODELS)
def test_wrong_loader_models_fail(name):
    with pytest.raises(CheckFailed, match="cases passed"):
        check.loading.calibrated_prediction(WRONG_MODELS[name])


def test_hard_coded_or_echoed_answers_fail():
    for fn in (lambda runs, n, c: 10.0, lambda runs, n, c: runs[0][2],
               lambda runs, n, c: 1 / runs[-1][2], lambda runs, n, c: n):
        with pytest.raises(CheckFailed, match="cases passed"):
            check.loading.calibrated_prediction(fn)


class _Sharded:
    """The exercise's IterableDataset: worker w of W yields items w, w + W, ..."""

    def __init__(self, n_items):
        self.n_items = n_items

    def __iter__(self):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n_items, step))


class _DocsChunks(_Sharded):
    """PyTorch's documented split (``torch.utils.data.IterableDataset``): contiguous chunks
    of ``ceil(n / W)`` items, the last one shorter."""

    def __iter__(self):
        import math

        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is None:
            return iter(range(self.n_items))
        per = int(math.ceil(self.n_items / info.num_workers))
        start = info.id * per
        return iter(range(start, min(start + per, self.n_items)))


class _BalancedChunks(_Sharded):
    """Contiguous shares within one item of each other, written as a generator."""

    def __iter__(self):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        w, n_w = (0, 1) if info is None else (info.id, info.num_workers)
        lo, hi = w * self.n_items // n_w, (w + 1) * self.n_items // n_w
        yield from range(lo, hi)


class _Islice(_Sharded):
    def __iter__(self):
        import itertools

        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is None:
            return iter(range(self.n_items))
        return itertools.islice(range(self.n_items), info.id, None, info.num_workers)


class _EveryWorkerEverything(_Sharded):
    def __iter__(self):
        return iter(range(self.n_items))


class _FirstWorkerOnly(_Sharded):
    def __iter__(self):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        return iter(range(self.n_items) if info is None or info.id == 0 else [])


class _StrideTwo(_Sharded):
    """Written for two workers: the stride is 2 whatever the number of workers."""

    def __iter__(self):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        return iter(range(self.n_items) if info is None else range(info.id, self.n_items, 2))


class _FloorChunks(_Sharded):
    """Contiguous chunks of ``n // W`` items: the remainder is dropped."""

    def __iter__(self):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is None:
            return iter(range(self.n_items))
        per = self.n_items // info.num_workers
        return iter(range(info.id * per, (info.id + 1) * per))


class _NoMainProcess(_Sharded):
    """Forgets that ``get_worker_info()`` is None without workers."""

    def __iter__(self):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        return iter(range(info.id, self.n_items, info.num_workers))


class _OneShot(_Sharded):
    """Keeps its iterator on the dataset: a second epoch in the same process finds it spent."""

    def __iter__(self):
        if not hasattr(self, "_it"):
            self._it = iter(super().__iter__())
        return self._it


class _StubStream(_Sharded):
    def __iter__(self):
        raise NotImplementedError


def _as_iterable(cls):
    from torch.utils.data import IterableDataset

    return type(cls.__name__, (cls, IterableDataset), {})


@pytest.mark.slow
@pytest.mark.parametrize("honest", [_Sharded, _DocsChunks, _BalancedChunks, _Islice])
def test_sharded_stream_passes_every_honest_split(honest, capsys):
    check.loading.sharded_stream(_as_iterable(honest))
    assert "PASS sharded_stream: 9/9" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize(("cheat", "message"), [
    (_EveryWorkerEverything, "came more than once"),  # the duplicate-data bug
    (_FirstWorkerOnly, "more than a fair share"),
    (_StrideTwo, "never came"),
    (_FloorChunks, "never came"),
    (_NoMainProcess, "raised AttributeError"),
    (_OneShot, "never came per epoch"),
    (_StubStream, "0/9 cases passed"),
])
def test_sharded_stream_shortcuts_fail(cheat, message):
    with pytest.raises(CheckFailed, match=message):
        check.loading.sharded_stream(_as_iterable(cheat))


# --------------------------------------------------------------------------------------
# the split of a profiled loop's time

def _labelled(events):
    """The loop's labelled ranges on the host (on a GPU the labels also annotate the kernels
    they launched, on the GPU's own timeline)."""
    from torch.autograd import DeviceType

    return [e for e in events if e.name in ("data", "step") and e.device_type == DeviceType.CPU]


def split_by_events(events):
    """The exercise: sum each label's ranges, the window from the labelled ranges."""
    ranges = _labelled(events)
    start = min(e.time_range.start for e in ranges)
    end = max(e.time_range.end for e in ranges)
    data = sum(e.time_range.elapsed_us() for e in ranges if e.name == "data") / 1e6
    step = sum(e.time_range.elapsed_us() for e in ranges if e.name == "step") / 1e6
    return {"data_s": data, "compute_s": step, "idle_s": (end - start) / 1e6 - data - step}


def split_by_key_averages(events):
    """Honest too: totals per name from ``key_averages()`` (CPU time *with* children)."""
    from torch.autograd import DeviceType

    totals = {k.key: k.cpu_time_total for k in events.key_averages()
              if k.device_type == DeviceType.CPU}  # a GPU's annotations have rows of their own
    ranges = _labelled(events)
    window = (max(e.time_range.end for e in ranges)
              - min(e.time_range.start for e in ranges))
    return {"data_s": totals["data"] / 1e6, "compute_s": totals["step"] / 1e6,
            "idle_s": (window - totals["data"] - totals["step"]) / 1e6}


def split_by_gaps(events):
    """Honest too: walk the labelled ranges in time order and add up the gaps between them."""
    ranges = sorted(_labelled(events), key=lambda e: e.time_range.start)
    out = {"data_s": 0.0, "compute_s": 0.0, "idle_s": 0.0}
    for before, e in zip([None, *ranges], ranges):
        key = "data_s" if e.name == "data" else "compute_s"
        out[key] += e.cpu_time_total / 1e6
        if before is not None:
            out["idle_s"] += (e.time_range.start - before.time_range.end) / 1e6
    return out


@pytest.mark.parametrize("honest", [split_by_events, split_by_key_averages, split_by_gaps])
def test_loop_split_passes_honest_readings(honest, capsys):
    check.loading.loop_split(honest)
    assert capsys.readouterr().out.strip() == "PASS loop_split: 6/6 cases passed"


def _with(**changes):
    """``split_by_events`` with one of its pieces replaced by a misreading of the trace."""
    def fn(events):
        ranges = changes.get("ranges", _labelled)(events)
        window = changes.get("window", lambda ev, r: (
            max(e.time_range.end for e in r) - min(e.time_range.start for e in r)))(events,
                                                                                   ranges)
        length = changes.get("length", lambda e: e.time_range.elapsed_us())
        data = sum(length(e) for e in ranges if "data" in e.name.lower())
        step = sum(length(e) for e in ranges if "step" in e.name.lower())
        scale = changes.get("scale", 1e6)
        return {"data_s": data / scale, "compute_s": step / scale,
                "idle_s": changes.get("idle", lambda w, d, s: w - d - s)(window, data, step)
                / scale}
    return fn


def _union_us(intervals):
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _idle_where_nothing_runs(events):
    out = split_by_events(events)
    ranges = _labelled(events)
    start = min(e.time_range.start for e in ranges)
    end = max(e.time_range.end for e in ranges)
    busy = _union_us((max(e.time_range.start, start), min(e.time_range.end, end))
                     for e in events if e.time_range.end > start and e.time_range.start < end)
    out["idle_s"] = (end - start - busy) / 1e6
    return out


MISREADINGS = {
    # every event whose name mentions data or step: ProfilerStep#k, Optimizer.step, the
    # DataLoader's own __next__ range inside "data"
    "names matched loosely": _with(ranges=lambda ev: list(ev)),
    # self time: the ranges' children (DataLoader.__next__, the operators) taken out
    "self time of the labels": _with(length=lambda e: e.self_cpu_time_total),
    # the window from every event of the trace (operators outside, kernels that outlast)
    "window from every event": _with(window=lambda ev, r: (
        max(e.time_range.end for e in ev) - min(e.time_range.start for e in ev))),
    # idle as the time no event at all covers (the checkpoint's operators count as busy)
    "idle where no event runs": lambda events: _idle_where_nothing_runs(events),
    # the labels' annotations on the GPU's timeline counted as host ranges
    "labels on the GPU's timeline too": _with(ranges=lambda ev: [
        e for e in ev if e.name in ("data", "step")]),
    # the profiler's microseconds taken for seconds
    "microseconds as seconds": _with(scale=1.0),
    # milliseconds instead of seconds
    "milliseconds": _with(scale=1e3),
    # the labelled ranges assumed to fill the window
    "no idle": _with(idle=lambda w, d, s: 0.0),
    # the window from the ProfilerStep#k ranges, which also hold the time around the labels
    "window from ProfilerStep": _with(window=lambda ev, r: (
        max(e.time_range.end for e in ev if e.name.startswith("ProfilerStep"))
        - min(e.time_range.start for e in ev if e.name.startswith("ProfilerStep")))),
    # only top-level events: "data" and "step" sit inside ProfilerStep#k
    "top-level events only": _with(ranges=lambda ev: [
        e for e in _labelled(ev) if e.cpu_parent is None]),
}


@pytest.mark.parametrize("name", MISREADINGS)
def test_loop_split_misreadings_fail(name):
    with pytest.raises(CheckFailed, match="cases passed"):
        check.loading.loop_split(MISREADINGS[name])


def test_loop_split_hard_coded_or_reference_answers_fail():
    from labsim.experiments.loading.profiled import loop_split

    fixed = {"data_s": 0.6, "compute_s": 0.15, "idle_s": 0.0002}
    with pytest.raises(CheckFailed, match="cases passed"):
        check.loading.loop_split(lambda events: fixed)
    with pytest.raises(CheckFailed, match="calls labsim's own reference"):
        check.loading.loop_split(loop_split)
    with pytest.raises(CheckFailed, match="not implemented"):
        check.loading.loop_split(lambda events: (_ for _ in ()).throw(NotImplementedError))
