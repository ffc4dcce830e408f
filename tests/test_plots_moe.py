"""The mixture-of-experts lab's figures draw what their cells describe."""

from __future__ import annotations

from labsim.experiments.moe import EpLayer
from labsim.plots import moe as plots


def test_ep_layer_bars_stack_compute_and_alltoalls_with_their_share() -> None:
    rows = [EpLayer(1, "one GPU", 6e-3, 0.0, 1.0, 1.0, 8e10),
            EpLayer(16, "across 2 nodes (InfiniBand)", 5e-3, 5e-3, 2.0, 1.5, 3e10)]
    fig = plots.ep_layer_bars(rows)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "ep=1: one GPU", "ep=16: across 2 nodes (InfiniBand)"]
    assert " 50%" in [t.get_text() for t in ax.texts]
    assert ax.get_xlim()[1] > 10.0  # room for the share beside the longest bar


def test_traffic_matrix_writes_every_count() -> None:
    sent = [[5, 1], [2, 7]]
    fig = plots.traffic_matrix(sent)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert sorted(texts) == ["1", "2", "5", "7"]
