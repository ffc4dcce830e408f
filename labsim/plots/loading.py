"""Utilisation over time: which stream was busy when, and the GPU's busy fraction in a window.

Reads a ``Trace`` only (simulated by ``labsim.sim.loading`` or measured by
``labsim.experiments.loading.LoopTimes.to_trace``): the top panel draws one row per stream (the
training loop "main", then "worker i"), the bottom panel the fraction of each sliding window
the training loop spent in "compute" -- what ``nvidia-smi`` reports as GPU utilisation
(the share of time a kernel was running, averaged over its sample period).
``loop_timeline`` draws profiled loops (``labsim.experiments.loading.profiled.timeline``):
one panel per run with the loop's thread ("main thread": ``load`` spans for the batch fetches,
``compute`` for the steps, ``idle`` for neither), the moments a torch operator ran on that
thread ("torch operators") and, from a GPU run, its kernels.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from labsim.plots._figure import new_figure
from labsim.trace import Trace

COLOURS = {"compute": "#2ca02c", "wait": "#d62728", "load": "#1f77b4", "idle": "#bbbbbb"}


def _stream_order(name: str) -> tuple[int, int, str]:
    if name == "main":
        return (0, 0, name)
    if name.startswith("worker "):
        return (1, int(name.split()[1]), name)
    return (2, 0, name)


def busy_curve(trace: Trace, window_s: float, points: int = 400,
               stream: str = "main", kind: str = "compute") -> tuple[np.ndarray, np.ndarray]:
    """(t, fraction of [t - window_s, t] that ``stream`` spent in ``kind``) on a grid."""
    spans = [(s.start_s, s.end_s) for s in trace.filter(stream=stream, kind=kind)]
    t = np.linspace(trace.start_s + window_s, trace.end_s, points)
    if not spans or window_s <= 0:
        return t, np.zeros_like(t)
    starts, ends = np.array(spans).T
    lo, hi = t[:, None] - window_s, t[:, None]
    overlap = np.clip(np.minimum(ends, hi) - np.maximum(starts, lo), 0, None)
    return t, overlap.sum(axis=1) / window_s


def utilisation_timeline(trace: Trace, *, window_s: float | None = None,
                         title: str = "", max_workers_shown: int = 8) -> Figure:
    """Gantt rows per stream over a windowed busy-fraction curve of the training loop."""
    streams = sorted({s.stream for s in trace}, key=_stream_order)
    shown = [s for s in streams if not s.startswith("worker ")]
    workers = [s for s in streams if s.startswith("worker ")]
    shown += workers[:max_workers_shown]
    fig = new_figure((9, 1.2 + 0.35 * len(shown) + 1.6))
    top, bottom = fig.subplots(2, 1, sharex=True,
                               gridspec_kw={"height_ratios": [max(1, len(shown)), 2.5]})
    for row, stream in enumerate(shown):
        spans = trace.filter(stream=stream)
        for kind in sorted({s.kind for s in spans}):
            bars = [(s.start_s, s.duration_s) for s in spans if s.kind == kind]
            top.broken_barh(bars, (row - 0.4, 0.8), facecolor=COLOURS.get(kind, "#9467bd"),
                            edgecolor="white", linewidth=0.5, label=kind)
    top.set_yticks(range(len(shown)), shown)
    top.invert_yaxis()
    handles, labels = top.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    top.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0),
               fontsize=8)
    if len(workers) > max_workers_shown:
        top.set_ylabel(f"{len(workers) - max_workers_shown} workers not shown", fontsize=8)
    if title:
        top.set_title(title)
    compute = trace.filter(stream="main", kind="compute")
    if window_s is None:
        mean_step = compute.busy_s() / max(1, len(compute))
        window_s = max(trace.makespan_s / 40, 4 * mean_step)
    t, busy = busy_curve(trace, window_s)
    total = compute.busy_s() / trace.makespan_s if trace.makespan_s else 0.0
    bottom.plot(t, busy * 100, color=COLOURS["compute"])
    bottom.axhline(total * 100, color="k", ls="--", lw=1, label=f"mean {total:.0%}")
    bottom.set_ylim(0, 105)
    bottom.set_ylabel(f"GPU busy %\n({window_s * 1e3:.0f} ms window)")
    bottom.set_xlabel("time (s)")
    bottom.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def sweep_figure(x: list[float], series: dict[str, list[float]], *, xlabel: str,
                 ylabel: str, title: str = "", percent: bool = False) -> Figure:
    """Lines of measured / simulated / predicted values over one swept setting."""
    fig = new_figure((6, 3.4))
    ax = fig.subplots()
    for (name, ys), marker in zip(series.items(), "os^dvx*"):
        ys = [y * 100 for y in ys] if percent else ys
        ax.plot(x, ys, marker=marker, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel + (" (%)" if percent else ""))
    if percent:
        ax.set_ylim(0, 105)
    ax.set_xticks(x)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


_LOOP_ROWS = ("main thread", "torch operators", "GPU kernels")
_LOOP_COLOURS = {"load": "#d62728", "compute": "#2ca02c", "idle": "#bbbbbb"}
_LOOP_OPERATOR_COLOUR = "#1f4e79"
_LOOP_WORDS = {"load": "data (fetching or waiting for a batch)", "compute": "step",
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
        rows = [r for r in _LOOP_ROWS if trace.filter(stream=r).spans]
        for y, row in enumerate(rows):
            spans = trace.filter(stream=row)
            for kind in sorted({s.kind for s in spans}):
                bars = [(s.start_s * 1e3, s.duration_s * 1e3) for s in spans if s.kind == kind]
                colour = _LOOP_COLOURS[kind] if row == "main thread" else _LOOP_OPERATOR_COLOUR
                ax.broken_barh(bars, (y - 0.38, 0.76), facecolors=colour, linewidth=0)
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_title(name, fontsize=9, loc="left")
        ax.set_xlim(0, end_ms)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("time from the first fetch (ms)")
    handles = [Patch(color=_LOOP_COLOURS[k], label=w) for k, w in _LOOP_WORDS.items()]
    handles.append(Patch(color=_LOOP_OPERATOR_COLOUR, label="an operator (or kernel) running"))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8,
               bbox_to_anchor=(0.5, 1.0 if not title else 0.97))
    if title:
        fig.suptitle(title, fontsize=10, y=1.06)
    fig.tight_layout()
    return fig
