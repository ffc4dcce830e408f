"""Training memory drawn two ways.

- ``memory_bars``: stacked bars of memory per GPU (weights, gradients, optimizer state,
  activations), one per ``labsim.MemoryBreakdown``; horizontal lines mark GPU capacities so
  "does it fit?" can be read off the chart.
- ``memory_timeline``: bytes alive through training steps, stacked by category (as
  ``torch.profiler``'s memory timeline categorises them), the steps' phases shaded and
  labelled, and predictions drawn as horizontal lines to hold against the measured peak.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

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


TIMELINE_COLOURS = {"parameters": "#4c72b0", "optimizer state": "#55a868",
                    "activations": "#c44e52", "gradients": "#dd8452",
                    "autograd detail": "#8172b3", "temporary": "#937860",
                    "inputs": "#333333", "unknown": "#bbbbbb"}
_TIMELINE_ORDER = ("parameters", "optimizer state", "gradients", "activations",
                   "autograd detail", "temporary", "inputs", "unknown")


def memory_timeline(
    times_ms: Sequence[float],
    by_category: Mapping[str, Sequence[float]],
    *,
    phases: Sequence[tuple[str, float, float]] = (),
    marks: Mapping[str, float] | None = None,
    title: str = "Memory alive through training steps",
    ax: Axes | None = None,
) -> Figure:
    """Stacked areas of bytes alive (MB, 1e6 bytes) against time (ms): ``by_category[c][i]``
    is alive from ``times_ms[i]`` to ``times_ms[i + 1]``.  Categories are stacked from the
    bottom in a fixed order (parameters, optimizer state, gradients, activations, then what
    the backward makes on its way; unknown names after); a category that is never above
    zero is left out of the legend.  ``phases`` (label, start, end) start at a thin vertical
    line and are labelled along the top (those too short for a label are left out); the peak
    is marked; ``marks`` (label -> bytes) are horizontal lines."""
    if not times_ms or any(len(v) != len(times_ms) for v in by_category.values()):
        raise ValueError("memory_timeline needs one value per moment in every category")
    if ax is None:
        fig = new_figure((10.0, 4.8))
        ax = fig.subplots()
    else:
        fig = ax.figure
    names = [c for c in _TIMELINE_ORDER if c in by_category]
    names += [c for c in by_category if c not in names]
    times = [float(t) for t in times_ms]
    times.append(times[-1])  # the last state is drawn as a point
    bottom = [0.0] * len(times)
    for name in names:
        values = [float(v) / 1e6 for v in by_category[name]]
        if not any(values):
            continue
        values.append(values[-1])
        top = [b + v for b, v in zip(bottom, values)]
        ax.fill_between(times, bottom, top, step="post", lw=0, label=name,
                        color=TIMELINE_COLOURS.get(name))
        bottom = top
    peak = max(bottom)
    at = bottom.index(peak)
    ax.plot([times[at]], [peak], marker="v", color="black", ms=6, ls="none")
    ax.annotate(f"peak {peak:.3g} MB", (times[at], peak), xytext=(4, 4),
                textcoords="offset points", fontsize=8)
    first, last = times[0], times[-1]
    for label, start, end in phases:
        start, end = max(start, first), min(end, last)  # the part of it on the chart
        if end - start < 0.02 * ((last - first) or 1.0):
            continue  # too short for a label
        ax.axvline(start, color="black", lw=0.6, alpha=0.5)
        ax.annotate(label, ((start + end) / 2, 1.0), xycoords=("data", "axes fraction"),
                    ha="center", va="bottom", fontsize=8)
    for j, (label, nbytes) in enumerate((marks or {}).items()):
        ax.axhline(nbytes / 1e6, color="black", ls=("--", ":", "-.")[j % 3], lw=1)
        ax.annotate(label, (times[0], nbytes / 1e6), ha="left", va="bottom", fontsize=8)
        peak = max(peak, nbytes / 1e6)
    ax.set_ylim(0, peak * 1.12)
    ax.set_xlim(times[0], times[-1])
    ax.set_xlabel("time since the profiler started (ms; the profiler slows every op)")
    ax.set_ylabel("MB alive")
    ax.set_title(title, pad=18)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
