"""The timeline of a profiled training loop: one panel per run, on one time axis.

Reads ``Trace``s only (``labsim.experiments.loading.profiled.timeline`` makes them from
``torch.profiler`` events): each panel has the loop's thread ("main thread": ``load`` spans
for the batch fetches, ``compute`` for the steps, ``idle`` for neither), the moments a torch
operator ran on that thread ("torch operators") and, from a GPU run, its kernels.
"""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from labsim.plots._figure import new_figure
from labsim.trace import Trace

_ROWS = ("main thread", "torch operators", "GPU kernels")
_COLOURS = {"load": "#d62728", "compute": "#2ca02c", "idle": "#bbbbbb"}
_OPERATOR_COLOUR = "#1f4e79"
_WORDS = {"load": "data (fetching or waiting for a batch)", "compute": "step",
          "idle": "neither"}


def loop_timeline(runs: Mapping[str, Trace], *, title: str = "") -> Figure:
    """One panel per run (its name as the panel's title), time in ms from the first labelled
    range; every panel on the x range of the longest run, so lengths compare by eye."""
    if not runs:
        raise ValueError("give at least one run's trace")
    end_ms = max(trace.end_s for trace in runs.values()) * 1e3
    fig = new_figure((9.5, 0.4 + 1.25 * len(runs)))
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, trace) in zip(axes, runs.items()):
        rows = [r for r in _ROWS if trace.filter(stream=r).spans]
        for y, row in enumerate(rows):
            spans = trace.filter(stream=row)
            for kind in sorted({s.kind for s in spans}):
                bars = [(s.start_s * 1e3, s.duration_s * 1e3) for s in spans if s.kind == kind]
                colour = _COLOURS[kind] if row == "main thread" else _OPERATOR_COLOUR
                ax.broken_barh(bars, (y - 0.38, 0.76), facecolors=colour, linewidth=0)
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_title(name, fontsize=9, loc="left")
        ax.set_xlim(0, end_ms)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("time from the first fetch (ms)")
    handles = [Patch(color=_COLOURS[k], label=w) for k, w in _WORDS.items()]
    handles.append(Patch(color=_OPERATOR_COLOUR, label="an operator (or kernel) running"))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8,
               bbox_to_anchor=(0.5, 1.0 if not title else 0.97))
    if title:
        fig.suptitle(title, fontsize=10, y=1.06)
    fig.tight_layout()
    return fig
