"""The data-loading checks pass the reference and fail wrong answers (labsim.checks.loading)."""

import pytest

from labsim import checks as check
from labsim.checks import CheckFailed
from labsim.experiments.loading import time_loop
from labsim.loading import loader_busy_fraction


def test_references_pass(capsys):
    check.loading.time_loop(time_loop)
    check.loading.busy_fraction(loader_busy_fraction)
    out = capsys.readouterr().out.splitlines()
    assert out == ["PASS time_loop: 6/6 cases passed", "PASS busy_fraction: 8/8 cases passed"]


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
