"""The running table of your GPT step as a figure: step time and step peak memory by technique.

Reads any object with ``plot_rows()`` (plain dicts: ``label``, ``step_s``, ``q1_s``, ``q3_s``,
``peak_bytes``, ``elsewhere``) and ``title`` -- ``labsim.experiments.my_step.Table``.  Each
time bar carries its quartiles as an error bar; rows measured on another device are hatched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from matplotlib.figure import Figure

from labsim.plots._figure import new_figure


class _Table(Protocol):
    title: str

    def plot_rows(self) -> Sequence[Mapping[str, Any]]: ...


def table_figure(table: _Table) -> Figure:
    """Two panels sharing the techniques: median step time (ms) with its quartiles, and the
    peak memory the step adds (MB).  A table with no measured row draws a note instead."""
    rows = list(table.plot_rows())
    fig = new_figure((10, 1.2 + 0.45 * max(len(rows), 2)))
    ax_t, ax_m = fig.subplots(1, 2, sharey=True)
    if not rows:
        ax_t.text(0.5, 0.5, "no row measured yet", ha="center", va="center",
                  transform=ax_t.transAxes)
        ax_m.set_axis_off()
        fig.suptitle(table.title)
        return fig
    ys = list(range(len(rows)))[::-1]
    step_ms = [r["step_s"] * 1e3 for r in rows]
    low = [max(0.0, (r["step_s"] - r["q1_s"]) * 1e3) for r in rows]
    high = [max(0.0, (r["q3_s"] - r["step_s"]) * 1e3) for r in rows]
    hatch = ["//" if r["elsewhere"] else "" for r in rows]
    bars = ax_t.barh(ys, step_ms, xerr=[low, high], color="tab:blue", capsize=3)
    mem = ax_m.barh(ys, [r["peak_bytes"] / 1e6 for r in rows], color="tab:orange")
    for group in (bars, mem):
        for bar, h in zip(group, hatch):
            bar.set_hatch(h)
    ax_t.set_yticks(ys, [r["label"] for r in rows])
    ax_t.set_xlabel("step time (ms): median, quartiles")
    ax_m.set_xlabel("step peak memory (MB)")
    if any(hatch):
        ax_m.text(1.0, -0.25, "hatched: measured on another device", ha="right",
                  transform=ax_m.transAxes, fontsize=8)
    fig.suptitle(table.title)
    fig.tight_layout()
    return fig
