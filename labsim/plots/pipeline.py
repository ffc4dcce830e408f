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
                   title: str = "", time_unit: str | None = None,
                   ax: Axes | None = None) -> Figure:
    """Draw ``result.trace`` as stages x time.  ``streams`` adds thin rows for "p2p" and "dp"
    under each stage; ``label_microbatches`` writes the micro-batch number in each bar
    (default: when there are at most 300 bars).  Stages beyond ``max_stages`` are left out
    and the title says so.  Times are seconds unless ``time_unit`` names the unit of a trace
    on paper (``labsim.pipeline.timeline`` in units of a stage's forward, say): then they are
    drawn as they are, the axis labelled with it.  The legend sits right of the chart, clear
    of the bars."""
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
    scale, unit = (1.0, time_unit) if time_unit else next(
        ((f, u) for f, u in _UNITS if end >= 2 * f), _UNITS[-1])
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
              fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def in_flight_bars(series: dict[str, tuple[int, ...]], title: str = "") -> Figure:
    """Grouped bars: peak (micro-batch, chunk) activations each stage holds, per schedule
    (``labsim.pipeline.max_in_flight`` of each stage's ops)."""
    fig = new_figure((7, 3.2))
    ax = fig.subplots()
    width = 0.8 / max(len(series), 1)
    for j, (name, held) in enumerate(series.items()):
        ax.bar([s + (j - (len(series) - 1) / 2) * width for s in range(len(held))], held,
               width, label=name)
    stages = max((len(h) for h in series.values()), default=0)
    ax.set_xticks(range(stages))
    ax.set_xticklabels([f"stage {s}" for s in range(stages)])
    ax.set_ylabel("activations held at peak\n(micro-batch chunks)")
    ax.set_title(title or "in-flight activations per stage", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def bubble_curves(rows: dict[int, list[tuple[int, float]]], target: float | None = None,
                  title: str = "") -> Figure:
    """Bubble fraction against micro-batches, one line per pipeline depth ``p`` (``rows[p]``
    = [(m, bubble), ...]); ``target`` draws a horizontal line (e.g. 0.10)."""
    fig = new_figure((6, 3.4))
    ax = fig.subplots()
    for p, points in rows.items():
        ax.semilogx([m for m, _ in points], [b for _, b in points], "o-", ms=3, label=f"p={p}",
                    base=2)
    if target is not None:
        ax.axhline(target, color="red", ls="--", lw=1, label=f"{target:.0%}")
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.set_title(title or "pipeline bubble vs micro-batches", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def p2p_curves(rows: dict[str, list[tuple[float, float]]], title: str = "") -> Figure:
    """Step time against the time of one point-to-point message, one line per schedule
    (``rows[name]`` = [(p2p_s, step_s), ...])."""
    fig = new_figure((6, 3.4))
    ax = fig.subplots()
    for name, points in rows.items():
        ax.plot([x for x, _ in points], [y for _, y in points], "o-", ms=3, label=name)
    ax.set_xlabel("one message between stages (in units of a stage's forward)")
    ax.set_ylabel("step time (same units)")
    ax.set_title(title or "interleaving sends v times the messages", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
