"""Plots of the mixture-of-experts lab (``labsim.experiments.moe``): one MoE layer's compute
against its expert-parallel all-to-alls, and the rows each rank sends each rank."""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from labsim.plots._figure import new_figure

_COMPUTE, _COMM = "#4C72B0", "#DD8452"


def ep_layer_bars(rows: Sequence[object], title: str = "") -> Figure:
    """Stacked horizontal bars, one per ``EpLayer``: an MoE layer's compute and its dispatch
    and combine all-to-alls (seconds alone, forward + backward), in ms, with their share."""
    fig = new_figure((7, 0.45 * len(rows) + 1.3))
    ax = fig.subplots()
    labels = [f"ep={r.ep}: {r.where}" for r in rows]
    compute = [r.compute_s * 1e3 for r in rows]
    comm = [r.alltoall_s * 1e3 for r in rows]
    ax.barh(labels, compute, color=_COMPUTE, label="compute")
    ax.barh(labels, comm, left=compute, color=_COMM, label="all-to-alls (alone)")
    for i, r in enumerate(rows):
        ax.text(compute[i] + comm[i], i, f" {r.alltoall_fraction:.0%}", va="center",
                fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.12 * max(c + m for c, m in zip(compute, comm)))
    ax.set_xlabel("ms per MoE layer and micro-batch (forward + backward)")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title(title or "one MoE layer: compute vs expert-parallel all-to-alls", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def traffic_matrix(sent: Sequence[Sequence[int]], title: str = "") -> Figure:
    """Rows rank i sent rank j in the dispatch all-to-all, as a heat map with the counts."""
    n = len(sent)
    fig = new_figure((3.8, 3.2))
    ax = fig.subplots()
    image = ax.imshow([list(r) for r in sent], cmap="Blues")
    top = max(max(r) for r in sent)
    for i in range(n):
        for j in range(n):
            ax.text(j, i, str(sent[i][j]), ha="center", va="center", fontsize=8,
                    color="white" if sent[i][j] > 0.6 * top else "black")
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("to rank (holds those experts)")
    ax.set_ylabel("from rank")
    ax.set_title(title or "routed rows sent, dispatch", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig
