"""The simulated DataLoader (labsim.sim.loading) against hand timelines and the closed form."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labsim.loading import LoaderConfig, loader_busy_fraction
from labsim.sim.loading import load_times, run_loader, simulate_dataloader


def test_two_workers_by_hand():
    # L=3, S=1, 2 workers, prefetch 1: batches 0,1 load 0-3; 2 is sent at 3 (hand-over of 0)
    # and loads 3-6; 3 is sent at 4 and loads 4-7.
    r = simulate_dataloader(2, 1, 3.0, 1.0, 4)
    assert r.step_start_s == (3.0, 4.0, 6.0, 7.0)
    assert r.step_end_s == (4.0, 5.0, 7.0, 8.0)
    assert r.wait_s == (3.0, 0.0, 1.0, 0.0)
    assert r.total_time_s == 8.0
    assert r.gpu_busy_fraction == pytest.approx(0.5)
    loads = r.trace.filter(stream="worker 0", kind="load")
    assert [(s.start_s, s.end_s) for s in loads] == [(0.0, 3.0), (3.0, 6.0)]
    assert [(s.start_s, s.end_s) for s in r.trace.filter(stream="worker 1")] == [
        (0.0, 3.0), (4.0, 7.0)]


def test_prefetch_sends_indices_early():
    r = simulate_dataloader(2, 2, 3.0, 1.0, 4)
    loads = r.trace.filter(stream="worker 1", kind="load")
    assert [(s.start_s, s.end_s) for s in loads] == [(0.0, 3.0), (3.0, 6.0)]
    assert r.total_time_s == 8.0


def test_main_process_loading():
    r = simulate_dataloader(0, 2, 3.0, 1.0, 2)
    assert r.step_start_s == (3.0, 7.0)
    assert r.total_time_s == 8.0
    assert r.gpu_busy_fraction == pytest.approx(0.25)
    assert r.mean_wait_s == 3.0
    assert {s.kind for s in r.trace} == {"load", "compute"}


def test_prefetch_bound_holds_in_flight_batches():
    # batch k + N*pf may only start loading once batch k was handed over
    n, pf = 3, 2
    r = simulate_dataloader(n, pf, 1.0, 2.0, 30)
    starts = {}
    for s in r.trace.filter(kind="load"):
        starts[int(s.label.split()[1])] = s.start_s
    for k in range(30 - n * pf):
        assert starts[k + n * pf] >= r.step_start_s[k] - 1e-12


def test_worker_startup_and_persistent_workers():
    kw = dict(worker_start_s=5.0, epochs=2)
    assert simulate_dataloader(1, 2, 1.0, 1.0, 2, **kw).total_time_s == 16.0
    assert simulate_dataloader(1, 2, 1.0, 1.0, 2, persistent_workers=True,
                               **kw).total_time_s == 11.0


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 6])
@pytest.mark.parametrize("load, step", [(0.03, 0.01), (0.005, 0.01), (0.02, 0.02)])
@pytest.mark.parametrize("pf", [1, 2, 4])
def test_steady_state_equals_closed_form(n, load, step, pf):
    r = simulate_dataloader(n, pf, load, step, 240)
    assert r.steady_busy_fraction(120) == pytest.approx(
        loader_busy_fraction(n, load, step), rel=1e-9)


def test_cores_shared_by_workers():
    r = simulate_dataloader(3, 2, 2.0, 1.0, 120, cores=1)
    assert r.steady_busy_fraction(60) == pytest.approx(
        loader_busy_fraction(3, 2.0, 1.0, cores=1), rel=1e-9)


def test_cpu_step_shares_cores_with_workers():
    # many workers, step on the CPU too: throughput is the fluid bound cores / (L + S)
    r = simulate_dataloader(4, 2, 3.0, 1.0, 200, cores=2, step_uses_cpu=True)
    period = (r.step_end_s[149] - r.step_end_s[49]) / 100  # away from both ends
    assert period == pytest.approx(2.0, rel=0.02)
    # one worker and the step each have a core: no contention
    r = simulate_dataloader(1, 2, 3.0, 1.0, 40, cores=2, step_uses_cpu=True)
    assert r.steady_busy_fraction(20) == pytest.approx(1 / 3)


def test_jitter_is_seeded_and_keeps_the_mean():
    cfg = LoaderConfig(2, 2, 0.02, 0.01, 4000, seed=3, jitter=0.5)
    a, b = load_times(cfg), load_times(cfg)
    assert (a == b).all()
    assert a.mean() == pytest.approx(0.02, rel=0.03)
    assert a.std() / a.mean() == pytest.approx(0.5, rel=0.05)


def test_replay_uses_the_given_times():
    r = simulate_dataloader(1, 1, 0.0, 1.0, 3, load_times_s=(1.0, 2.0, 0.5),
                            step_times_s=(1.0, 1.0, 3.0))
    # b0 0-1, step 1-2; b1 sent at 1, 1-3, step 3-4; b2 sent at 3, 3-3.5, step 4-7
    assert r.step_start_s == (1.0, 3.0, 4.0)
    assert r.step_end_s == (2.0, 4.0, 7.0)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 5), load=st.floats(0.001, 0.1), step=st.floats(0.001, 0.1))
def test_more_workers_never_hurt_deterministic(n, load, step):
    a = simulate_dataloader(n, 2, load, step, 40)
    b = simulate_dataloader(n + 1, 2, load, step, 40)
    assert b.total_time_s <= a.total_time_s * (1 + 1e-9)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 4), pf=st.integers(1, 4), jitter=st.floats(0.0, 1.5),
       seed=st.integers(0, 100))
def test_more_prefetch_never_hurts(n, pf, jitter, seed):
    kw = dict(jitter=jitter, seed=seed, straggler_prob=0.05, straggler_factor=5.0)
    a = simulate_dataloader(n, pf, 0.02, 0.01, 60, **kw)
    b = simulate_dataloader(n, pf + 1, 0.02, 0.01, 60, **kw)
    assert b.total_time_s <= a.total_time_s * (1 + 1e-9)


def test_prefetch_absorbs_jitter_but_not_a_slow_mean():
    kw = dict(jitter=0.6, seed=1)
    pf1 = simulate_dataloader(2, 1, 0.019, 0.01, 2000, **kw).steady_busy_fraction()
    pf8 = simulate_dataloader(2, 8, 0.019, 0.01, 2000, **kw).steady_busy_fraction()
    assert pf8 > pf1 + 0.05
    slow = [simulate_dataloader(2, pf, 0.04, 0.01, 400).steady_busy_fraction()
            for pf in (1, 8)]
    assert slow[0] == pytest.approx(0.5) and slow[1] == pytest.approx(0.5)


def test_repr_and_run_loader():
    r = run_loader(LoaderConfig(2, 2, 0.02, 0.01, 10))
    assert "workers=2" in repr(r) and "gpu_busy" in repr(r)
    assert r.steps_per_s == pytest.approx(10 / r.total_time_s)


def test_handover_adds_to_every_wait():
    # compute-bound: each batch is ready early, the loop still spends 0.5 taking it
    r = simulate_dataloader(2, 2, 1.0, 2.0, 40, handover_s=0.5)
    assert r.steady_busy_fraction(20) == pytest.approx(2.0 / 2.5)
    assert r.wait_s[10] == pytest.approx(0.5)
