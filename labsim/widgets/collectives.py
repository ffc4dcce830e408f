"""Explore collectives: cluster, nodes, operation and algorithms -> bus bandwidth vs size.

``collectives_figure`` is the pure function (``labsim.estimate_collective`` on the cluster,
NCCL's model: its own choice and each algorithm forced, and textbook algorithms such as
``"hierarchical"``; drawn by ``labsim.plots.busbw_curves``);
it is the static figure a notebook shows where widgets cannot run.  ``explore_collectives``
wraps it in controls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure

from labsim.cluster import PRESETS, cluster
from labsim.collectives import estimate_collective
from labsim.collectives.schedule import OPS
from labsim.plots.collectives import _model_of, busbw_curves
from labsim.units import fmt_bandwidth, fmt_bytes, fmt_time


def collectives_figure(preset: str = "dgx-h100", nodes: int = 1, op: str = "allreduce",
                       algorithms: Sequence[str] = ("auto", "ring", "tree", "nvls_tree"),
                       size_bytes: float = 2**28) -> Figure:
    """busbw vs message size on ``nodes`` nodes of ``preset``; the title gives each
    algorithm's time and busbw at ``size_bytes``."""
    c = cluster(preset, nodes)
    fig = busbw_curves(c, op, algorithms)
    notes = []
    for entry in algorithms:
        algo, protocol, name = _model_of(entry, "auto")
        try:
            r = estimate_collective(op, int(size_bytes), c, algo, protocol=protocol)
        except ValueError:
            continue
        if algo == "auto":
            name = f"NCCL picks {r.algorithm}/{r.protocol}"
        notes.append(f"{name} {fmt_time(r.time_s)} ({fmt_bandwidth(r.busbw_Bps)})")
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
        algos = ("auto", "ring", "tree", "nvls", "nvls_tree") if op == "allreduce" else (
            "auto", "ring", "nvls", "pat")
        return collectives_figure(preset, nodes, op, algos, 2.0**log2_size)

    controls = {
        "preset": w.Dropdown(options=list(PRESETS), value=start["preset"],
                             description="cluster"),
        "nodes": w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                                   value=start["nodes"], description="nodes"),
        "op": w.Dropdown(options=[o for o in OPS if o != "alltoall"], value=start["op"],
                         description="operation"),
        "log2_size": w.IntSlider(start["log2_size"], 10, 34, description="log2 bytes"),
    }
    return Explorer(figure, controls, rows=(4,))
