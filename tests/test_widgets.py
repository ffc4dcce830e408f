"""Every explorer is an ``Explorer``: live controls, and a static PNG of the same figure for
front ends without widgets (GitHub, nbviewer, nbval)."""

from __future__ import annotations

import inspect

import pytest

import labsim.widgets as widgets
from labsim.widgets._explorer import Explorer

EXPLORERS = [name for name, fn in inspect.getmembers(widgets, inspect.isfunction)
             if name.startswith("explore_") or name.endswith("_explorer")]


def test_there_are_explorers() -> None:
    assert len(EXPLORERS) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPLORERS)
def test_explorer_shows_a_static_figure_and_redraws_on_change(name: str) -> None:
    explorer = getattr(widgets, name)()
    assert isinstance(explorer, Explorer)
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["image/png"] == explorer.png != ""
    before = explorer.png
    slider = next(c for c in explorer.controls.values() if "Slider" in type(c).__name__)
    options = getattr(slider, "options", None)
    slider.value = options[-1] if options else slider.max
    assert explorer.png != before, f"{name} did not redraw when {slider.description} moved"
