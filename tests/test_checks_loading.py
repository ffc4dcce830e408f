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


class _EveryWorkerEverything(_Sharded):
    def __iter__(self):
        return iter(range(self.n_items))


class _FirstWorkerOnly(_Sharded):
    def __iter__(self):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        return iter(range(self.n_items) if info is None or info.id == 0 else [])


class _StubStream(_Sharded):
    def __iter__(self):
        raise NotImplementedError


def _as_iterable(cls):
    from torch.utils.data import IterableDataset

    return type(cls.__name__, (cls, IterableDataset), {})


@pytest.mark.slow
def test_sharded_stream_passes_and_its_shortcuts_fail(capsys):
    check.loading.sharded_stream(_as_iterable(_Sharded))
    assert "PASS sharded_stream: 6/6" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="came more than once"):  # the duplicate-data bug
        check.loading.sharded_stream(_as_iterable(_EveryWorkerEverything))
    with pytest.raises(CheckFailed, match="split them evenly"):
        check.loading.sharded_stream(_as_iterable(_FirstWorkerOnly))
    with pytest.raises(CheckFailed, match="0/6 cases passed"):
        check.loading.sharded_stream(_as_iterable(_StubStream))
