"""Explore collectives: cluster, nodes, operation and algorithms -> bus bandwidth vs size.

``collectives_figure`` is the pure function (closed forms on the cluster's network, drawn by
``labsim.plots.busbw_curves``); it is the static figure a notebook shows where widgets cannot
run.  ``explore_collectives`` wraps it in controls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure

from labsim.cluster import PRESETS, cluster
from labsim.collectives import busbw, collective_time_on
from labsim.collectives.schedule import ALGORITHMS
from labsim.plots.collectives import busbw_curves
from labsim.units import fmt_bandwidth, fmt_bytes, fmt_time


def collectives_figure(preset: str = "dgx-h100", nodes: int = 1, op: str = "allreduce",
                       algorithms: Sequence[str] = ("ring", "tree"),
                       size_bytes: float = 2**28) -> Figure:
    """busbw vs message size on ``nodes`` nodes of ``preset``; the title gives each
    algorithm's time and busbw at ``size_bytes``."""
    c = cluster(preset, nodes)
    fig = busbw_curves(c, op, algorithms)
    notes = []
    for algo in algorithms:
        try:
            t = collective_time_on(c, op, size_bytes, None, algo)
        except ValueError:
            continue
        bw = fmt_bandwidth(busbw(op, size_bytes, c.world_size, t))
        notes.append(f"{algo} {fmt_time(t)} ({bw})")
    ax = fig.axes[0]
    ax.axvline(size_bytes, color="grey", lw=0.8, ls="--")
    size = fmt_bytes(size_bytes, binary=True)
    ax.set_title(f"{op} on {c.world_size} GPUs ({c.name}); at {size}: " + ", ".join(notes),
                 fontsize=8)
    return fig


def explore_collectives(**defaults: Any) -> Any:
    """Controls over ``collectives_figure`` (``defaults`` sets their starting values)."""
    import ipywidgets as w

    from labsim.widgets._explorer import Explorer

    start = dict(preset="dgx-h100", nodes=1, op="allreduce", log2_size=28)
    start.update(defaults)

    def figure(preset: str, nodes: int, op: str, log2_size: int) -> Figure:
        algos = [a for a in ALGORITHMS[op] if op != "allreduce" or a != "recursive_doubling"]
        return collectives_figure(preset, nodes, op, algos, 2.0**log2_size)

    controls = {
        "preset": w.Dropdown(options=list(PRESETS), value=start["preset"],
                             description="cluster"),
        "nodes": w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                                   value=start["nodes"], description="nodes"),
        "op": w.Dropdown(options=list(ALGORITHMS), value=start["op"], description="operation"),
        "log2_size": w.IntSlider(start["log2_size"], 10, 34, description="log2 bytes"),
    }
    return Explorer(figure, controls, rows=(4,))
