"""labsim.plots.series: log-log series with guide slopes."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from labsim.plots import scaling  # noqa: E402


def test_one_line_per_series_plus_guides() -> None:
    fig = scaling([1, 2, 4], {"a": [1, 4, 16], "b": [1, 2, float("nan")]}, xlabel="n",
                  ylabel="t", guides=(1, 2))
    ax = fig.axes[0]
    assert len(ax.lines) == 4
    assert list(ax.lines[1].get_xdata()) == [1.0, 2.0]  # the NaN point is left out
    assert ax.get_xscale() == "log" and ax.get_ylabel() == "t"


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError, match="series"):
        scaling([1, 2], {"a": [1.0]}, xlabel="n", ylabel="t")
    with pytest.raises(ValueError):
        scaling([1, 2], {}, xlabel="n", ylabel="t")
