"""Memory explorer: model, precision, optimizer, data-parallel size -> ZeRO 0-3 stacked bars.

``memory_figure`` is the static face (a plain function of its arguments, tested without
widgets); ``memory_explorer`` puts controls around it and redraws on every change.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as w
from matplotlib.figure import Figure

from labsim.hardware import GPUS, gpu
from labsim.memory import OPTIMIZERS, PRECISIONS, RECOMPUTE, zero_stages
from labsim.plots.memory import memory_bars
from labsim.widgets._explorer import Explorer
from labsim.workload import Transformer


def memory_figure(
    model: str | Transformer | float = "llama2-7b",
    precision: str = "mixed",
    optimizer: str = "adam",
    dp: int = 8,
    micro_batch: int = 1,
    recompute: str = "none",
    device: str = "A100-80GB",
) -> Figure:
    """Stacked bars of bytes per GPU for ZeRO stages 0-3; a line marks ``device``'s memory.

    ``model``: a preset name, a ``Transformer`` or a parameter count (then without
    activations); ``micro_batch=0`` leaves activations out.
    """
    if isinstance(model, str):
        model = Transformer.preset(model)
    kwargs: dict[str, Any] = {}
    if isinstance(model, Transformer) and micro_batch > 0:
        kwargs = {"micro_batch": micro_batch, "recompute": recompute}
    bars = zero_stages(model, precision=precision, optimizer=optimizer, dp=dp, **kwargs)
    chip = gpu(device)
    fits = [k for k, v in bars.items() if v.fits(chip.memory_bytes)]
    name = model.name if isinstance(model, Transformer) else f"{float(model) / 1e9:.3g}B params"
    if fits:
        verdict = f"fits: {', '.join(fits)}"
    else:
        best = min(bars, key=lambda k: bars[k].total)
        verdict = (f"nothing fits (at best {best}, {bars[best].total / 1e9:,.0f} GB of "
                   f"{chip.memory_bytes / 1e9:,.0f})")
    return memory_bars(
        bars,
        capacities=[chip],
        title=f"{name}, {precision}, {optimizer}, dp={dp}: {verdict} on {chip.name}",
    )


def memory_explorer(**initial: Any) -> Explorer:
    """Controls over ``memory_figure``; ``initial`` sets starting values (same names)."""
    values = {
        "model": "llama2-7b", "precision": "mixed", "optimizer": "adam", "dp": 8,
        "micro_batch": 1, "recompute": "none", "device": "A100-80GB", **initial,
    }
    controls = {
        "model": w.Dropdown(options=list(Transformer.presets(dense=True)), value=values["model"],
                            description="model"),
        "precision": w.Dropdown(options=PRECISIONS, value=values["precision"],
                                description="precision"),
        "optimizer": w.Dropdown(options=OPTIMIZERS, value=values["optimizer"],
                                description="optimizer"),
        "dp": w.SelectionSlider(options=[2**i for i in range(11)], value=values["dp"],
                                description="dp GPUs"),
        "micro_batch": w.IntSlider(value=values["micro_batch"], min=0, max=16,
                                   description="micro-batch"),
        "recompute": w.Dropdown(options=RECOMPUTE, value=values["recompute"],
                                description="recompute"),
        "device": w.Dropdown(options=[g.name for g in GPUS.values()], value=values["device"],
                             description="GPU"),
    }
    return Explorer(memory_figure, controls, rows=(4,))
