"""The DataLoader explorer's pure function and widget (labsim.widgets.loading)."""

import pytest

from labsim.widgets.loading import dataloader_figure, explore_dataloader


def test_figure_matches_the_simulation():
    result, fig = dataloader_figure(num_workers=1, load_ms=30, step_ms=10, steps=30)
    assert result.steady_busy_fraction() == pytest.approx(1 / 3)
    assert "formula 33%" in fig.axes[0].get_title()
    assert len(fig.axes) == 2


@pytest.mark.slow
def test_widget_builds_with_its_defaults():
    pytest.importorskip("ipywidgets")
    widget = explore_dataloader(num_workers=3, load_ms=20)
    assert widget.values["num_workers"] == 3 and widget.values["load_ms"] == 20
    first = widget.png
    assert first and widget._repr_mimebundle_()["image/png"] == first  # static fallback
    widget.controls["num_workers"].value = 1
    assert widget.png != first
