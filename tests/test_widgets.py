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


def _memory_explorer() -> Explorer:
    return widgets.memory_explorer()


def test_a_drag_reports_where_it_ends_and_draws_no_pyplot_figure() -> None:
    import matplotlib.pyplot as plt

    explorer = _memory_explorer()
    sliders = [c for c in explorer.controls.values() if "Slider" in type(c).__name__]
    assert sliders and all(not s.continuous_update for s in sliders)
    slider = sliders[0]
    options = list(getattr(slider, "options", None) or range(slider.min, slider.max + 1))
    for value in options[:24]:
        slider.value = value
    assert plt.get_fignums() == []  # no figure left registered with pyplot, none leaked


def test_quick_changes_draw_once_with_the_latest_values(monkeypatch) -> None:
    """In a kernel, changes that arrive together are drawn once, for the last state."""
    import time

    from labsim.widgets import _explorer

    explorer = _memory_explorer()
    monkeypatch.setattr(_explorer, "_in_kernel", lambda: True)
    # changes 'together': well inside the debounce even on a loaded machine
    monkeypatch.setattr(_explorer, "DEBOUNCE_S", 1.0)
    slider = next(c for c in explorer.controls.values() if "Slider" in type(c).__name__)
    options = list(getattr(slider, "options", None) or range(slider.min, slider.max + 1))
    before = explorer.draws
    for value in options[-5:]:
        slider.value = value
    deadline = time.monotonic() + 10
    while explorer.draws == before and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # no further figure comes
    assert explorer.draws == before + 1
    name = next(k for k, c in explorer.controls.items() if c is slider)
    assert explorer.values[name] == options[-1]
    assert len(explorer.out.outputs) == 1  # one figure on show
