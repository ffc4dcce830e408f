"""Bus bandwidth against message size for several algorithms or clusters (closed forms).

The curve every NCCL user knows: small messages are latency-bound (busbw grows with size),
large ones approach the link's bandwidth.  Each algorithm is ``labsim.estimate_collective``
on the cluster: NCCL's model (``"auto"``: NCCL's own choice by size; or one algorithm forced,
as ``NCCL_ALGO`` does), or a textbook algorithm with ``protocol="alpha-beta"``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from labsim.cluster import Cluster
from labsim.collectives import estimate_collective
from labsim.plots._figure import new_figure


def busbw_curves(clusters: Cluster | Sequence[Cluster], op: str = "allreduce",
                 algorithms: Sequence[str] = ("auto", "ring", "tree"),
                 sizes: Sequence[float] | None = None, *, protocol: str = "auto",
                 achieved: bool = True, ax: Axes | None = None) -> Figure:
    """busbw (GB/s) vs size (bytes, log axis), one line per (cluster, algorithm).
    Algorithms that do not apply to a cluster or size (NVLS without NVSwitch, power-of-two
    textbook algorithms, ...) are skipped."""
    clusters = [clusters] if isinstance(clusters, Cluster) else list(clusters)
    # powers of two (1 KiB .. 8 GiB): divisible by power-of-two rank counts, like nccl-tests
    sizes = 2.0 ** np.arange(10, 34) if sizes is None else np.asarray(sizes)
    if ax is None:
        fig = new_figure((7, 4))
        ax = fig.subplots()
    else:
        fig = ax.figure
    for c in clusters:
        for algo in algorithms:
            try:
                bw = [estimate_collective(op, int(s), c, algo, protocol=protocol,
                                          achieved=achieved).busbw_Bps / 1e9 for s in sizes]
            except ValueError:
                continue
            name = "NCCL's choice" if algo == "auto" else algo
            ax.plot(sizes, bw, marker=".", label=f"{c.name}, {name}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{op}: bus bandwidth vs message size", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
