"""Stacked memory bars: heights in GB equal the breakdown's parts, capacity lines drawn."""

from __future__ import annotations

import pytest

from labsim import MemoryBreakdown
from labsim.memory import zero_stages
from labsim.plots import memory_bars


def test_stacks_are_the_parts() -> None:
    bars = zero_stages(7.5e9, dp=64)
    fig = memory_bars(bars, capacities=["A100-40GB", "H100-SXM"])
    ax = fig.axes[0]
    tops = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), patch.get_y() + patch.get_height())
    assert [round(tops[i], 1) for i in range(4)] == [120.0, 31.4, 16.6, 1.9]
    assert len(ax.patches) == 4 * 4
    assert sorted(line.get_ydata()[0] for line in ax.get_lines()) == [40.0, 80.0]


def test_activations_on_top_and_empty_input() -> None:
    fig = memory_bars({"a": MemoryBreakdown(1e9, 1e9, 2e9, 3e9)}, capacities=[])
    ax = fig.axes[0]
    top = max(ax.patches, key=lambda p: p.get_y())
    assert (top.get_y(), top.get_height()) == (4.0, 3.0)
    with pytest.raises(ValueError):
        memory_bars({})


def test_timeline_stacks_the_categories_and_draws_the_marks() -> None:
    from labsim.plots.memory import memory_timeline

    times = [0.0, 1.0, 2.0, 3.0]
    by = {"activations": [0, 2e6, 0, 0], "parameters": [1e6, 1e6, 1e6, 1e6],
          "unknown": [0, 0, 0, 0]}
    fig = memory_timeline(times, by, phases=[("forward 1", 0.0, 1.5), ("tiny", 1.5, 1.51),
                                             ("backward 1", 1.51, 3.0)],
                          marks={"prediction": 2.5e6})
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["parameters", "activations"]  # stacked in order; never-used left out
    tops = ax.collections[-1].get_paths()[0].vertices[:, 1]
    assert max(tops) == pytest.approx(3.0)  # 1 MB of parameters + 2 MB of activations
    texts = [t.get_text() for t in ax.texts]
    assert "forward 1" in texts and "backward 1" in texts and "tiny" not in texts
    assert "prediction" in texts and "peak 3 MB" in texts
    assert [line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() == "--"] \
        == [2.5]
    with pytest.raises(ValueError):
        memory_timeline([0.0, 1.0], {"activations": [1.0]})
