"""Plots of the mixture-of-experts lab (``labsim.experiments.moe``): one MoE layer's compute
against its expert-parallel all-to-alls, and the rows each rank sends each rank."""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from labsim.plots._figure import new_figure
from labsim.plots.series import compute_comm_bars


def ep_layer_bars(rows: Sequence[object], title: str = "") -> Figure:
    """Stacked horizontal bars, one per ``EpLayer``: an MoE layer's compute and its dispatch
    and combine all-to-alls (seconds alone, forward + backward), in ms, with their share."""
    return compute_comm_bars(
        [f"ep={r.ep}: {r.where}" for r in rows], [r.compute_s for r in rows],
        [r.alltoall_s for r in rows], comm_label="all-to-alls (alone)", comm_colour="#DD8452",
        xlabel="ms per MoE layer and micro-batch (forward + backward)",
        title=title or "one MoE layer: compute vs expert-parallel all-to-alls")


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
