"""Bus bandwidth against message size for several algorithms or clusters (closed forms).

The curve every NCCL user knows: small messages are latency-bound (busbw grows with size),
large ones approach the link's bandwidth.  Each algorithm is ``labsim.estimate_collective``
on the cluster: NCCL's model (``"auto"``: NCCL's own choice by size; or one algorithm forced,
as ``NCCL_ALGO`` does), or a textbook algorithm with ``protocol="alpha-beta"``; a name only
the textbook model has (``"hierarchical"``, ``"recursive_doubling"`` ...) or one written
``"alpha-beta:ring"`` is drawn with the textbook model whatever ``protocol`` says.

``published_curve`` draws a published nccl-tests curve (``labsim.published``) over the NCCL
model's prediction for the same system, sizes and launch mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from labsim.cluster import Cluster
from labsim.collectives import estimate_collective
from labsim.collectives.estimate import TEXTBOOK
from labsim.collectives.tuner import ALGOS
from labsim.plots._figure import new_figure
from labsim.units import fmt_bytes


def _model_of(algo: str, protocol: str) -> tuple[str, str, str]:
    """(algorithm, protocol, legend name) of one entry of ``algorithms``."""
    if algo.startswith(TEXTBOOK + ":"):
        algo = algo.split(":", 1)[1]
        return algo, TEXTBOOK, f"{algo} (textbook)"
    if protocol == TEXTBOOK or (algo != "auto" and algo.lower() not in ALGOS):
        return algo, TEXTBOOK, f"{algo} (textbook)"
    return algo, protocol, "NCCL's choice" if algo == "auto" else f"NCCL {algo}"


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
        for entry in algorithms:
            algo, proto, name = _model_of(entry, protocol)
            try:
                bw = [estimate_collective(op, int(s), c, algo, protocol=proto,
                                          achieved=achieved).busbw_Bps / 1e9 for s in sizes]
            except ValueError:
                continue
            ax.plot(sizes, bw, marker=".", label=f"{c.name}, {name}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{op}: bus bandwidth vs message size", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def published_curve(curve: object, *, ax: Axes | None = None) -> Figure:
    """A published nccl-tests curve (``labsim.published.Curve``): measured busbw (dots)
    and the NCCL model's (line, marked with its algorithm/protocol where the choice
    changes) on log axes, with the curve's role (calibration or validation) in the title."""
    from labsim.collectives.bandwidth import busbw_factor
    from labsim.published import predict_curve

    rows = predict_curve(curve)  # type: ignore[arg-type]
    factor = busbw_factor(curve.op, curve.gpus)  # type: ignore[attr-defined]
    sizes = np.array([r[0] for r in rows], dtype=float)
    measured = sizes * factor / np.array([r[1] for r in rows]) / 1e9
    model = sizes * factor / np.array([r[2] for r in rows]) / 1e9
    if ax is None:
        fig = new_figure((7, 4))
        ax = fig.subplots()
    else:
        fig = ax.figure
    ax.plot(sizes, measured, "o", ms=4, label="published")
    ax.plot(sizes, model, "-", label="NCCL model")
    last = None
    for (size, _, _, choice), y in zip(rows, model):
        if choice != last:  # where the model's NCCL choice changes
            ax.plot([size], [y], "|", color="k", ms=10)
            ax.annotate(choice, (size, y), fontsize=7, xytext=(-4, 8),
                        textcoords="offset points")
            last = choice
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    span = f"{fmt_bytes(sizes[0], binary=True)} .. {fmt_bytes(sizes[-1], binary=True)}"
    ax.set_title(f"{curve.id} ({curve.role}), {span}", fontsize=9)  # type: ignore[attr-defined]
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
