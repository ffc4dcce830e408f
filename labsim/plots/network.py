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
    start = 0
    for name, values in groups:
        x = np.arange(start, start + len(values))
        if len(util) <= 96:
            ax.bar(x, values, width=0.85, label=f"{name} (mean {values.mean():.0%})")
        else:
            ax.plot(x, values, lw=1, label=f"{name} (mean {values.mean():.0%})")
        start += len(values) + max(1, len(util) // 50)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("utilisation")
    ax.set_xlabel("link direction (GPU ports, then NICs)")
    ax.set_xticks([])
    ax.set_title(title or f"{result.op} {result.algorithm} on {c.name}: link utilisation",
                 fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
