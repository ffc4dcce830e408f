"""Activation checkpointing: the memory-versus-time trade-off of measured plans, and the
activation memory of a transformer with recompute none / selective / full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from matplotlib.figure import Figure

from labsim.plots._figure import new_figure


class _Measured(Protocol):
    label: str
    saved_bytes: int
    peak_bytes: int
    step_s: float


def recompute_tradeoff(
    measured: Sequence[_Measured],
    modelled: Mapping[str, float] | None = None,
    *,
    model_name: str = "",
) -> Figure:
    """Left: measured peak and saved bytes against step time for each plan.  Right (if
    ``modelled`` is given): activation bytes per recompute mode, e.g. from
    ``labsim.activation_memory``, for ``model_name``."""
    if not measured:
        raise ValueError("give at least one measured plan")
    panels = 2 if modelled else 1
    fig = new_figure((6 * panels, 4.2))
    axes = fig.subplots(1, panels, squeeze=False)[0]
    ax = axes[0]
    base = measured[0].step_s
    for m in measured:
        ax.scatter([m.step_s / base], [m.peak_bytes / 1e6], s=40)
        ax.scatter([m.step_s / base], [m.saved_bytes / 1e6], s=40, marker="x", color="grey")
        ax.annotate(m.label, (m.step_s / base, m.peak_bytes / 1e6),
                    textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel(f"step time relative to '{measured[0].label}'")
    ax.set_ylabel("MB (dot: peak during the step, x: saved after forward)")
    ax.set_title("Measured: memory vs time")
    ax.grid(alpha=0.3)
    if modelled:
        bx = axes[1]
        names = list(modelled)
        values = [modelled[k] / 1e9 for k in names]
        bars = bx.bar(names, values, color=["tab:blue", "tab:orange", "tab:green"][: len(names)])
        for bar, v in zip(bars, values):
            bx.annotate(f"{v:.3g} GB", (bar.get_x() + bar.get_width() / 2, v),
                        ha="center", va="bottom", fontsize=8)
        bx.set_ylabel("activation memory (GB)")
        bx.set_title(f"Modelled (Korthikanti et al. 2022): {model_name}")
    fig.tight_layout()
    return fig
