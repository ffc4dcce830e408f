"""The profiled loop's timeline figure (labsim.plots.profile)."""

import pytest

from labsim.plots.profile import loop_timeline
from labsim.trace import Trace


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
