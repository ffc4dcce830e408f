"""Stacked bars of training memory per GPU: weights, gradients, optimizer state, activations.

Input is a mapping from a bar label to a ``labsim.MemoryBreakdown``; horizontal lines mark GPU
capacities so "does it fit?" can be read off the chart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from labsim.hardware import GPU, gpu
from labsim.memory import MemoryBreakdown
from labsim.plots._figure import new_figure

PARTS = ("params", "grads", "optimizer", "activations")
COLOURS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868",
           "activations": "#c44e52"}


def memory_bars(
    bars: Mapping[str, MemoryBreakdown],
    *,
    capacities: Iterable[str | GPU] = ("A100-80GB",),
    title: str = "Training memory per GPU",
    ax: Axes | None = None,
) -> Figure:
    """One stacked bar per entry of ``bars`` (in GB, 1e9 bytes), GPU memory sizes as lines."""
    if not bars:
        raise ValueError("memory_bars needs at least one MemoryBreakdown")
    if ax is None:
        fig = new_figure((max(5.0, 1.2 * len(bars) + 2), 4.5))
        ax = fig.subplots()
    else:
        fig = ax.figure
    labels = list(bars)
    bottoms = [0.0] * len(labels)
    for part in PARTS:
        heights = [getattr(bars[k], part) / 1e9 for k in labels]
        ax.bar(labels, heights, bottom=bottoms, color=COLOURS[part], label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for i, total in enumerate(bottoms):
        ax.annotate(f"{total:.3g} GB", (i, total), ha="center", va="bottom", fontsize=8)
    for chip in capacities:
        chip = gpu(chip)
        ax.axhline(chip.memory_bytes / 1e9, color="black", ls="--", lw=1)
        ax.annotate(f"{chip.name} {chip.memory_bytes / 1e9:.0f} GB",
                    (len(labels) - 0.5, chip.memory_bytes / 1e9), ha="right", va="bottom",
                    fontsize=8)
    ax.set_ylabel("GB per GPU")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper right")
    ax.tick_params(axis="x", labelsize=8)
    if len(labels) > 4:
        for tick in ax.get_xticklabels():
            tick.set_rotation(20)
            tick.set_horizontalalignment("right")
    fig.tight_layout()
    return fig
