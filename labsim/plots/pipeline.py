"""Pipeline Gantt chart of a training step: one row per pipeline stage, time across.

Forward, backward, recompute and blocking communication (TP / ZeRO-3) are coloured; the white
gaps are the pipeline bubble.  Reads a ``StepResult`` (or ``PipelineResult``) trace: the
``compute`` stream of every stage, optionally the ``p2p`` sends and the ``dp`` gradient
reduction as thin bars under each stage.
"""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from labsim.plots._figure import new_figure

COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "recompute": "#937860",
           "comm": "#55A868", "send": "#64B5CD", "optimizer": "#8172B3", "wgrad": "#C44E52"}
_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))


def pipeline_gantt(result: object, *, streams: tuple[str, ...] = ("compute",),
                   label_microbatches: bool | None = None, max_stages: int = 32,
                   title: str = "", ax: Axes | None = None) -> Figure:
    """Draw ``result.trace`` as stages x time.  ``streams`` adds thin rows for "p2p" and "dp"
    under each stage; ``label_microbatches`` writes the micro-batch number in each bar
    (default: when there are at most 300 bars).  Stages beyond ``max_stages`` are left out
    and the title says so."""
    trace = result.trace
    stages = sorted({s.rank for s in trace})
    hidden = max(0, len(stages) - max_stages)
    stages = stages[:max_stages]
    rows = [(st, stream) for st in stages for stream in streams]
    index = {row: i for i, row in enumerate(rows)}
    if ax is None:
        fig = new_figure((11, 0.32 * max(len(rows), 3) + 1.4))
        ax = fig.subplots()
    else:
        fig = ax.figure
    end = max((s.end_s for s in trace), default=0.0)
    scale, unit = next(((f, u) for f, u in _UNITS if end >= 2 * f), _UNITS[-1])
    spans = [s for s in trace if (s.rank, s.stream) in index and s.end_s > s.start_s]
    if label_microbatches is None:
        label_microbatches = len(spans) <= 300
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for s in spans:
        bars.setdefault((index[(s.rank, s.stream)], s.kind), []).append(
            (s.start_s / scale, (s.end_s - s.start_s) / scale))
        if label_microbatches and s.stream == "compute" and s.kind in ("forward", "backward"):
            ax.text((s.start_s + s.end_s) / 2 / scale, index[(s.rank, s.stream)],
                    s.label.split()[0][1:], ha="center", va="center", fontsize=6,
                    color="white", clip_on=True)
    kinds = []
    for (row, kind), xs in bars.items():
        height = 0.8 if rows[row][1] == "compute" else 0.4
        ax.broken_barh(xs, (row - height / 2, height), facecolors=COLOURS.get(kind, "#999999"),
                       edgecolor="white", linewidth=0.3)
        if kind not in kinds:
            kinds.append(kind)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"stage {st}" + ("" if stream == "compute" else f" {stream}")
                        for st, stream in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(end / scale, 1e-12))
    ax.set_xlabel(f"time ({unit})")
    bubble = getattr(result, "bubble_fraction", None)
    note = f"; bubble {bubble:.1%}" if bubble is not None else ""
    more = f" ({hidden} more stages not shown)" if hidden else ""
    ax.set_title((title or "Pipeline schedule") + note + more, fontsize=10)
    ax.legend(handles=[Patch(color=COLOURS.get(k, "#999999"), label=k) for k in kinds],
              fontsize=7, loc="upper right", ncol=len(kinds))
    fig.tight_layout()
    return fig
