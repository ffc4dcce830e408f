"""The data-loading checks pass the reference and fail wrong answers (labsim.checks.loading)."""

import pytest

from labsim import checks as check
from labsim.checks import CheckFailed
from labsim.experiments import loading as reference
from labsim.loading import loader_busy_fraction


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


def busy_fraction(num_workers, load_time_s, step_time_s):
    if num_workers == 0:
        return step_time_s / (load_time_s + step_time_s)
    return 1.0 if load_time_s == 0 else min(1.0, num_workers * step_time_s / load_time_s)


def test_solutions_pass(capsys):
    check.loading.time_loop(time_loop)
    check.loading.busy_fraction(busy_fraction)
    out = capsys.readouterr().out.splitlines()
    assert out == ["PASS time_loop: 6/6 cases passed", "PASS busy_fraction: 8/8 cases passed"]


@pytest.mark.parametrize(("name", "ref"), [("time_loop", reference.time_loop),
                                          ("busy_fraction", loader_busy_fraction)])
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

    for fn in (check.loading.time_loop, check.loading.busy_fraction):
        with pytest.raises(CheckFailed, match="not implemented"):
            fn(stub)


def test_ignoring_the_main_process_case_fails():
    def no_serial(n, load, step):
        return min(1.0, n * step / load) if load else 1.0

    with pytest.raises(CheckFailed, match="main process"):
        check.loading.busy_fraction(no_serial)


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
