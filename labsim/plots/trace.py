"""Gantt chart of a ``Trace``: one row per (rank, stream), one bar per span, coloured by kind.

Reads only the trace, so it draws any simulation (collectives, training steps, loaders) and
traces of real runs alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from labsim.plots._figure import new_figure
from labsim.trace import Trace

_COLOURS = {"compute": "#4C72B0", "forward": "#4C72B0", "backward": "#DD8452",
            "recompute": "#937860", "optimizer": "#8172B3", "comm": "#55A868",
            "send": "#55A868", "recv": "#64B5CD", "wait": "#C44E52", "load": "#DA8BC3",
            "idle": "#CCCCCC"}
_PHASE_COLOURS = ["#55A868", "#4C72B0", "#DD8452", "#8172B3", "#937860", "#DA8BC3",
                  "#64B5CD", "#C44E52"]
_UNITS = [(1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")]

# how much of the run a trace shows, said in a subtitle (Trace.detail)
DETAIL_WORDS = {"full": "", "op": " (one bar per operation)",
                "step": " (one bar per algorithm step, on its first sender's row)",
                "phase": " (one bar per phase, on its first sender's row)"}


def _unit(span_s: float) -> tuple[float, str]:
    for scale, name in _UNITS:
        if span_s >= 2 * scale:
            return scale, name
    return 1e-9, "ns"


def gantt(trace: Trace, *, ranks: Sequence[int] | None = None, max_rows: int = 32,
          title: str = "", label_bars: bool = False, color_by: str = "kind",
          ax: Axes | None = None) -> Figure:
    """Draw ``trace`` as a Gantt chart; rows are (rank, stream), ranks top to bottom.

    ``ranks`` picks which ranks to show (default: all, at most ``max_rows`` rows, the rest
    summarised in the title).  ``label_bars`` writes each span's label inside its bar.
    ``color_by``: "kind" (compute, comm, ...) or "phase" (a span's ``phase`` argument, e.g. a
    collective's reduce-scatter and all-gather; spans without one fall back to their kind).
    """
    if color_by not in ("kind", "phase"):
        raise ValueError(f"color_by must be 'kind' or 'phase', got {color_by!r}")
    palette = iter(_PHASE_COLOURS)
    spans = [s for s in trace if ranks is None or s.rank in set(ranks)]
    rows = sorted({(s.rank, s.stream) for s in spans})
    hidden = max(0, len(rows) - max_rows)
    rows = rows[:max_rows]
    index = {row: i for i, row in enumerate(rows)}
    if ax is None:
        fig = new_figure((10, 0.35 * max(len(rows), 2) + 1.2))
        ax = fig.subplots()
    else:
        fig = ax.figure
    t0 = trace.start_s
    scale, unit = _unit(trace.makespan_s)
    kinds: dict[str, str] = {}
    by_row: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
    for s in spans:
        row = (s.rank, s.stream)
        if row not in index:
            continue
        key = str(s.args.get("phase", s.kind)) if color_by == "phase" else s.kind
        if key not in kinds:
            kinds[key] = (next(palette, "#999999") if color_by == "phase"
                          else _COLOURS.get(s.kind, "#999999"))
        by_row.setdefault((*row, key), []).append(
            ((s.start_s - t0) / scale, s.duration_s / scale))
        if label_bars and s.label:
            ax.text((s.start_s - t0 + s.duration_s / 2) / scale, index[row], s.label,
                    ha="center", va="center", fontsize=6, clip_on=True)
    for (rank, stream, kind), bars in by_row.items():
        ax.broken_barh(bars, (index[(rank, stream)] - 0.4, 0.8),
                       facecolors=kinds[kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {st}" for r, st in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, max(trace.makespan_s / scale, 1e-12))
    note = f" ({hidden} more rows not shown)" if hidden else ""
    detail = DETAIL_WORDS.get(trace.detail, f" ({trace.detail})")
    ax.set_title((title or "Gantt chart") + detail + note, fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in kinds.items()], fontsize=7,
              loc="upper right")
    fig.tight_layout()
    return fig
