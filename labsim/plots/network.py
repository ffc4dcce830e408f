"""Per-link utilisation of a simulated collective: how busy each link direction was.

Utilisation = bytes the pipe carried / (its bandwidth x the run's time).  A perfect ring
keeps every GPU port near 1; a flat ring across nodes leaves most NICs idle; a hierarchical
all-reduce loads NICs and NVLink in turn.
"""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from labsim.collectives import CollectiveResult
from labsim.plots._figure import new_figure


def link_utilisation(result: CollectiveResult, *, ax: Axes | None = None,
                     title: str = "") -> Figure:
    """Bars (few links) or a profile (many links) of utilisation per link direction, grouped
    as GPU tx, GPU rx, NIC tx, NIC rx."""
    c = result.cluster
    cap = c.pipe_capacities(result.achieved)
    util = result.pipe_bytes / (cap * result.time_s) if result.time_s > 0 else 0 * cap
    n, m = c.world_size, c.nodes * c.nics_per_node
    groups = [("GPU port tx", util[:n]), ("GPU port rx", util[n:2 * n]),
              ("NIC tx", util[2 * n:2 * n + m]), ("NIC rx", util[2 * n + m:])]
    if ax is None:
        fig = new_figure((10, 3.2))
        ax = fig.subplots()
    else:
        fig = ax.figure
    groups = [(name, values) for name, values in groups if len(values)]
    if len(util) <= 96:  # one bar per link direction, the groups side by side
        start, centres = 0, []
        for name, values in groups:
            x = np.arange(start, start + len(values))
            ax.bar(x, values, width=0.85, label=f"{name} (mean {values.mean():.0%})")
            centres.append(start + (len(values) - 1) / 2)
            start += len(values) + 1
        ax.set_xticks(centres, [f"{name}\n({len(v)})" for name, v in groups], fontsize=8)
        ax.set_xlabel("link directions, by kind (how many)")
    else:  # too many to draw one by one: each kind's mean, with its least and most loaded
        names = [name for name, _ in groups]
        means = np.array([v.mean() for _, v in groups])
        lows = means - np.array([v.min() for _, v in groups])
        highs = np.array([v.max() for _, v in groups]) - means
        ax.bar(range(len(groups)), means, yerr=[lows, highs], capsize=6, width=0.6,
               color=[f"C{i}" for i in range(len(groups))])
        ax.set_xticks(range(len(groups)),
                      [f"{n}\n({len(v)}: mean {v.mean():.0%}, min {v.min():.0%}, "
                       f"max {v.max():.0%})" for n, (_, v) in zip(names, groups)], fontsize=8)
        ax.set_xlabel("link directions, by kind (bar: mean; whiskers: least and most loaded)")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("utilisation")
    ax.set_title(title or f"{result.op} {result.algorithm} on {c.name}: link utilisation",
                 fontsize=10)
    if len(util) <= 96:
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
