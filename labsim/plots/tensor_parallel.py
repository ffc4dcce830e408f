"""Plots of tensor-parallel studies (``labsim.sim.tensor_parallel``): a layer's compute
against its TP communication, efficiency against the TP degree, activation memory with and
without sequence parallelism, and blocking against overlapped collectives."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

from labsim.plots._figure import new_figure
from labsim.plots.series import compute_comm_bars, efficiency

_COMPUTE, _COMM = "#4C72B0", "#55A868"


def layer_time_bars(rows: Sequence[object], title: str = "") -> Figure:
    """Stacked horizontal bars, one per ``LayerTimes``: compute and blocking TP
    communication of one layer (forward + backward), in ms, with the communication share."""
    return compute_comm_bars(
        [f"tp={r.tp}: {r.where}" for r in rows], [r.compute_s for r in rows],
        [r.comm_s for r in rows], comm_label="TP communication (blocking)",
        xlabel="ms per layer and micro-batch (forward + backward)",
        title=title or "one layer: compute vs tensor-parallel communication")


def tp_efficiency_curves(series: Mapping[str, Sequence[Mapping[str, float]]],
                         title: str = "") -> Figure:
    """Efficiency (speed-up over one GPU / tp) against the TP degree, one line per series."""
    return efficiency(series, "tp", xlabel="tensor-parallel degree t",
                      ylabel="efficiency = speed-up / t",
                      title=title or "strong scaling of tensor parallelism")


def activation_bars(rows: Sequence[Mapping[str, float]], capacity_bytes: float | None = None,
                    title: str = "") -> Figure:
    """Grouped bars of activation GB per GPU at each TP degree: plain TP, sequence parallel,
    sequence parallel + selective recomputation, full recomputation."""
    keys = (("tp_only", "tensor parallel", "#C44E52"),
            ("sequence_parallel", "+ sequence parallel", "#4C72B0"),
            ("sp_selective", "+ selective recompute", "#55A868"),
            ("full_recompute", "full recompute", "#8172B3"))
    fig = new_figure((7, 3.4))
    ax = fig.subplots()
    width = 0.8 / len(keys)
    for j, (key, label, colour) in enumerate(keys):
        ax.bar([i + (j - 1.5) * width for i in range(len(rows))],
               [r[key] / 1e9 for r in rows], width, label=label, color=colour)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"t={r['tp']}" for r in rows])
    if capacity_bytes:
        ax.axhline(capacity_bytes / 1e9, color="black", ls="--", lw=1, label="GPU memory")
    ax.set_yscale("log")
    ax.set_ylabel("activation GB per GPU")
    ax.set_title(title or "activation memory per GPU", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def overlap_bars(rows: Sequence[object], title: str = "") -> Figure:
    """Per ``OverlapTimes``: compute alone, blocking collectives, collective matmul (ms)."""
    fig = new_figure((7, 0.55 * len(rows) + 1.3))
    ax = fig.subplots()
    labels = [f"tp={r.tp}: {r.where}" for r in rows]
    h = 0.27
    for j, (key, label, colour) in enumerate((("compute_s", "compute only", _COMPUTE),
                                              ("overlapped_s", "collective matmul",
                                               "#8172B3"),
                                              ("blocking_s", "blocking", _COMM))):
        ax.barh([i + (j - 1) * h for i in range(len(rows))],
                [getattr(r, key) * 1e3 for r in rows], h, label=label, color=colour)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per layer and micro-batch, sequence parallel (forward + backward)")
    ax.set_title(title or "TP communication: blocking vs overlapped with the GEMMs",
                 fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
