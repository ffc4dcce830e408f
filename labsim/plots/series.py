"""Plot shapes several topics share.

``scaling``: measured or modelled quantities against a size, on log-log axes; each series is a
line (label -> values at the shared x positions), and dashed guide lines of slope 1 and 2
through the first point of the first series show what O(n) and O(n^2) growth look like, so a
learner can read the exponent off the chart.  ``efficiency``: scaling efficiency against a
parallel degree.  ``compute_comm_bars``: one layer's compute and its communication as stacked
bars, with the communication's share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from labsim.plots._figure import new_figure


def scaling(
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    guides: Sequence[int] = (1, 2),
    ax: Axes | None = None,
) -> Figure:
    """Log-log lines of ``series`` against ``x`` with guide slopes ``guides`` (O(x^k)).

    Non-positive or NaN values (a size that was not measured) are left out of a line.  In
    Jupyter the returned figure displays itself when it is the value of a cell.
    """
    if not series:
        raise ValueError("give at least one series")
    xs = np.asarray(x, dtype=float)
    for label, ys in series.items():
        if len(ys) != len(xs):
            raise ValueError(f"series {label!r} has {len(ys)} values for {len(xs)} sizes")
    if ax is None:
        fig = new_figure((7.0, 4.5))
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    anchor = None
    for label, ys in series.items():
        ya = np.asarray(ys, dtype=float)
        ok = np.isfinite(ya) & (ya > 0)
        ax.loglog(xs[ok], ya[ok], "o-", label=label)
        if anchor is None and ok.any():
            first = int(np.argmax(ok))
            anchor = (xs[first], ya[first])
    if anchor is not None:
        for k in guides:
            ax.loglog(xs, anchor[1] * (xs / anchor[0]) ** k, "--", color="grey", lw=0.8,
                      alpha=0.7)
            ax.annotate(f"O(n^{k})" if k != 1 else "O(n)", (xs[-1], anchor[1] *
                        (xs[-1] / anchor[0]) ** k), fontsize=8, color="grey")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def efficiency(series: Mapping[str, Sequence[Mapping[str, float]]], x_key: str, *,
               xlabel: str, ylabel: str = "scaling efficiency", title: str = "") -> Figure:
    """Efficiency (0..1) against a power-of-two count (GPUs, a parallel degree), one line per
    labelled series of rows ``{x_key: count, "efficiency": value}``."""
    fig = new_figure((6, 3.4))
    ax = fig.subplots()
    for label, rows in series.items():
        ax.semilogx([r[x_key] for r in rows], [r["efficiency"] for r in rows], "o-",
                    label=label, base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def compute_comm_bars(labels: Sequence[str], compute_s: Sequence[float],
                      comm_s: Sequence[float], *, comm_label: str, xlabel: str, title: str,
                      comm_colour: str = "#55A868") -> Figure:
    """Stacked horizontal bars, one per label: compute, then communication (seconds, drawn in
    ms), each bar ending with the communication's share of the two."""
    fig = new_figure((7, 0.45 * len(labels) + 1.3))
    ax = fig.subplots()
    compute = [t * 1e3 for t in compute_s]
    comm = [t * 1e3 for t in comm_s]
    ax.barh(list(labels), compute, color="#4C72B0", label="compute")
    ax.barh(list(labels), comm, left=compute, color=comm_colour, label=comm_label)
    for i, (c, m) in enumerate(zip(compute, comm)):
        ax.text(c + m, i, f" {m / (c + m) if c + m else 0:.0%}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.12 * max(c + m for c, m in zip(compute, comm)))
    ax.set_xlabel(xlabel)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig
