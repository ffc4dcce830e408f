"""Explore a DataLoader feeding a GPU: workers, prefetch, load and step time -> utilisation.

``dataloader_figure`` is the pure function (simulate, then draw the utilisation timeline);
it is the static figure a notebook shows where widgets cannot run.  ``explore_dataloader``
wraps it in sliders.
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from labsim.loading import loader_busy_fraction
from labsim.plots.loading import utilisation_timeline
from labsim.sim.loading import LoaderResult, simulate_dataloader


def dataloader_figure(num_workers: int = 2, prefetch_factor: int = 2, load_ms: float = 30.0,
                      step_ms: float = 10.0, jitter: float = 0.0, steps: int = 60,
                      seed: int = 0) -> tuple[LoaderResult, Figure]:
    """Simulate the setting and draw it; the title compares with the closed form."""
    result = simulate_dataloader(num_workers, prefetch_factor, load_ms / 1e3, step_ms / 1e3,
                                 steps, seed=seed, jitter=jitter)
    formula = loader_busy_fraction(num_workers, load_ms / 1e3, step_ms / 1e3)
    title = (f"{num_workers} workers, prefetch {prefetch_factor}, load {load_ms:g} ms, "
             f"step {step_ms:g} ms, jitter {jitter:g}: busy {result.gpu_busy_fraction:.0%} "
             f"(steady {result.steady_busy_fraction():.0%}, formula {formula:.0%})")
    return result, utilisation_timeline(result.trace, title=title)


def explore_dataloader(**defaults: Any) -> Any:
    """Sliders over ``dataloader_figure`` (``defaults`` sets their starting values)."""
    import ipywidgets as w

    from labsim.widgets._explorer import Explorer

    start = dict(num_workers=2, prefetch_factor=2, load_ms=30.0, step_ms=10.0, jitter=0.0,
                 steps=60)
    start.update(defaults)
    controls = {
        "num_workers": w.IntSlider(value=start["num_workers"], min=0, max=16,
                                   description="workers"),
        "prefetch_factor": w.IntSlider(value=start["prefetch_factor"], min=1, max=8,
                                       description="prefetch"),
        "load_ms": w.FloatSlider(value=start["load_ms"], min=1, max=200, step=1,
                                 description="load ms"),
        "step_ms": w.FloatSlider(value=start["step_ms"], min=1, max=100, step=1,
                                 description="step ms"),
        "jitter": w.FloatSlider(value=start["jitter"], min=0, max=2, step=0.1,
                                description="jitter (cv)"),
        "steps": w.IntSlider(value=start["steps"], min=10, max=300, step=10,
                             description="steps"),
    }
    return Explorer(lambda **values: dataloader_figure(**values)[1], controls, rows=(3,))
