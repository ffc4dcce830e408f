"""Closed-form input-pipeline model (labsim.loading)."""

import math

import pytest

from labsim.loading import (
    LoaderConfig,
    effective_workers,
    inflight_batches,
    loader_busy_fraction,
    loader_memory_bytes,
    loader_step_period_s,
    steady_busy_fraction,
    workers_needed,
)


def test_main_process_loading_alternates_load_and_step():
    assert loader_step_period_s(0, 0.03, 0.01) == pytest.approx(0.04)
    assert loader_busy_fraction(0, 0.03, 0.01) == pytest.approx(0.25)
    assert loader_busy_fraction(0, 0.0, 0.01) == 1.0


@pytest.mark.parametrize("n, expected", [(1, 1 / 3), (2, 2 / 3), (3, 1.0), (8, 1.0)])
def test_workers_overlap_loading_with_the_step(n, expected):
    assert loader_busy_fraction(n, 0.03, 0.01) == pytest.approx(expected)


def test_one_worker_beats_the_main_process_only_by_overlap():
    # one worker: max(L, S) per step instead of L + S
    assert loader_step_period_s(1, 0.02, 0.01) == pytest.approx(0.02)
    assert loader_step_period_s(1, 0.005, 0.01) == pytest.approx(0.01)


def test_cores_cap_the_useful_workers():
    assert effective_workers(8, cores=2) == 2
    assert loader_busy_fraction(8, 0.04, 0.01, cores=2) == pytest.approx(0.5)
    assert loader_busy_fraction(8, 0.04, 0.01) == 1.0


def test_workers_needed():
    assert workers_needed(0.03, 0.01) == 3  # exact ratio: no spurious extra worker
    assert workers_needed(0.031, 0.01) == 4
    assert workers_needed(0.001, 0.01) == 1
    assert workers_needed(0.0, 0.01) == 1
    n = workers_needed(0.07, 0.01)
    assert loader_busy_fraction(n, 0.07, 0.01) == 1.0
    assert loader_busy_fraction(n - 1, 0.07, 0.01) < 1.0


def test_memory_in_flight():
    assert inflight_batches(0, 2) == 0
    assert inflight_batches(4, 2) == 8
    batch = 256 * 3 * 224 * 224 * 4  # ImageNet fp32 batch, 154 MB
    assert loader_memory_bytes(16, 2, batch) == pytest.approx(32 * batch)
    assert loader_memory_bytes(16, 2, batch) / 1e9 == pytest.approx(4.93, abs=0.01)
    assert loader_memory_bytes(2, 1, 100.0, worker_rss_bytes=10.0) == 220.0


def test_steady_busy_fraction_uses_whole_periods():
    starts, ends = [3, 4, 6, 7], [4, 5, 7, 8]
    assert steady_busy_fraction(starts, ends, 0) == pytest.approx(4 / 8)
    assert steady_busy_fraction(starts, ends, 2) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        steady_busy_fraction(starts, ends, 4)


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_workers=-1), "num_workers"),
    (dict(prefetch_factor=0), "prefetch_factor"),
    (dict(step_time_s=0.0), "step_time_s"),
    (dict(load_time_s=math.inf), "load_time_s"),
    (dict(steps=0), "steps"),
    (dict(jitter=-0.1), "jitter"),
    (dict(straggler_factor=0.5), "straggler_factor"),
    (dict(cores=0), "cores"),
    (dict(num_workers=0, persistent_workers=True), "persistent_workers"),
    (dict(load_times_s=(0.1,)), "load_times_s"),
])
def test_config_validation_names_the_fix(kwargs, words):
    base = dict(num_workers=2, prefetch_factor=2, load_time_s=0.02, step_time_s=0.01, steps=4)
    with pytest.raises(ValueError, match=words):
        LoaderConfig(**{**base, **kwargs})


def test_in_process_loading_ignores_prefetch_factor():
    cfg = LoaderConfig(0, 0, 0.02, 0.01, 4)
    assert cfg.inflight == 0


def test_fit_recovers_the_costs_from_runs_that_waited():
    from labsim.loading import calibrated_steps_per_s, fit_loader_times, loader_step_period_s

    load, step = 0.2, 0.05
    runs = [(n, loader_step_period_s(n, load, step) - step, step) for n in (0, 1, 3, 8)]
    assert fit_loader_times(runs) == pytest.approx((load, step))
    # the 8-worker run kept up (wait 0): used for L it would give 8 * 0.05 = 0.4
    assert runs[-1][1] == pytest.approx(0.0)
    assert calibrated_steps_per_s(runs, 2, cores=1) == pytest.approx(1 / load)
    assert calibrated_steps_per_s(runs, 0) == pytest.approx(1 / (load + step))


def test_fit_refuses_runs_that_never_waited():
    from labsim.loading import fit_loader_times

    with pytest.raises(ValueError, match="none measures the load time"):
        fit_loader_times([(4, 0.0, 0.05), (2, 0.001, 0.05)])
    with pytest.raises(ValueError, match="at least one run"):
        fit_loader_times([])
    with pytest.raises(ValueError, match="num_workers"):
        fit_loader_times([(-1, 0.1, 0.05)])
