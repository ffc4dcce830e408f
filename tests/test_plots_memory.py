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
