"""Explore ZeRO: model states per GPU for stages 0-3 at any model size and GPU count.

``zero_figure`` is the pure function (``labsim.training_memory`` drawn by
``labsim.plots.data_parallel.zero_bars``); ``explore_zero`` wraps it in two sliders.
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from labsim.hardware import gpu
from labsim.memory import training_memory
from labsim.plots.zero import zero_bars


def zero_rows(params: float, dp: int) -> list[dict[str, Any]]:
    """Per-GPU bytes of model states (mixed-precision Adam) for ZeRO stages 0-3."""
    names = ("DP (stage 0)", "P_os (1)", "P_os+g (2)", "P_os+g+p (3)")
    rows = []
    for s, name in enumerate(names):
        m = training_memory(params, zero_stage=s, dp=dp)
        rows.append({"label": name, "params": m.params, "grads": m.grads,
                     "optimizer": m.optimizer, "total": m.model_states})
    return rows


def zero_figure(params_b: float = 7.5, dp: int = 64, gpu_name: str = "A100-80GB") -> Figure:
    """Bars of ZeRO 0-3 model states per GPU for ``params_b`` billion parameters on ``dp``."""
    rows = zero_rows(params_b * 1e9, dp)
    return zero_bars(rows, gpu(gpu_name).memory_bytes,
                     title=f"{params_b:g}B parameters, {dp} GPUs (mixed-precision Adam, "
                           f"16 B/param before sharding)")


def explore_zero(**defaults: Any) -> Any:
    """Sliders over ``zero_figure``."""
    import ipywidgets as w

    from labsim.widgets._explorer import Explorer

    start = dict(params_b=7.5, dp=64)
    start.update(defaults)
    sizes = [0.125, 0.35, 1.5, 7.5, 13.0, 70.0, 175.0, 530.0, 1000.0]
    controls = {
        "params_b": w.SelectionSlider(options=sizes, value=start["params_b"],
                                      description="params (B)"),
        "dp": w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
                                value=start["dp"], description="GPUs"),
    }
    return Explorer(zero_figure, controls)
