"""Utilisation timeline, sweep and profiled-loop figures (labsim.plots.loading)."""

import pytest

from labsim.plots.loading import busy_curve, loop_timeline, sweep_figure, utilisation_timeline
from labsim.sim.loading import simulate_dataloader
from labsim.trace import Trace


def test_busy_curve_is_the_windowed_compute_share():
    trace = Trace()
    trace.add(0, "main", "wait", 0.0, 1.0)
    trace.add(0, "main", "compute", 1.0, 2.0)
    trace.add(0, "main", "wait", 2.0, 3.0)
    trace.add(0, "main", "compute", 3.0, 4.0)
    t, busy = busy_curve(trace, window_s=2.0, points=3)
    assert list(t) == [2.0, 3.0, 4.0]
    assert list(busy) == pytest.approx([0.5, 0.5, 0.5])
    t, busy = busy_curve(trace, window_s=1.0, points=4)
    assert list(busy) == pytest.approx([0.0, 1.0, 0.0, 1.0])


def test_timeline_draws_every_stream():
    r = simulate_dataloader(3, 2, 0.03, 0.01, 20)
    fig = utilisation_timeline(r.trace, title="t", max_workers_shown=2)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["main", "worker 0", "worker 1"]
    assert "1 workers not shown" in fig.axes[0].get_ylabel()


def test_sweep_figure():
    fig = sweep_figure([0, 1, 2], {"a": [0.1, 0.5, 1.0], "b": [0.2, 0.4, 0.6]},
                       xlabel="workers", ylabel="busy", percent=True)
    assert len(fig.axes[0].lines) == 2


def _run(shift):
    trace = Trace()
    trace.add(0, "main thread", "load", 0.0, 0.1 + shift)
    trace.add(0, "main thread", "compute", 0.1 + shift, 0.15 + shift)
    trace.add(0, "main thread", "idle", 0.15 + shift, 0.2 + shift)
    trace.add(0, "torch operators", "compute", 0.11 + shift, 0.14 + shift)
    return trace


def test_one_panel_per_run_on_one_time_axis():
    fig = loop_timeline({"a": _run(0.0), "b": _run(0.3)})
    axes = fig.axes
    assert [ax.get_title(loc="left") for ax in axes] == ["a", "b"]
    assert axes[0].get_xlim() == axes[1].get_xlim() == pytest.approx((0, 500))
    assert [t.get_text() for t in axes[0].get_yticklabels()] == ["main thread",
                                                                 "torch operators"]
    with pytest.raises(ValueError, match="at least one"):
        loop_timeline({})
