"""The collective plots draw from a trace / result without error and label what they show."""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

from labsim import dgx_h100, simulate_collective  # noqa: E402
from labsim.plots import busbw_curves, gantt, link_utilisation  # noqa: E402


def test_gantt_has_one_row_per_rank_stream_and_caps_rows():
    r = simulate_collective("allreduce", 10**6, dgx_h100(1), "ring", protocol="alpha-beta",
                            detail="full")
    fig = gantt(r.trace)
    assert len(fig.axes[0].get_yticklabels()) == 8
    fig = gantt(r.trace, max_rows=3)
    assert "5 more rows" in fig.axes[0].get_title()
    legend = gantt(r.trace, color_by="phase").axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["reduce-scatter", "all-gather"]


def test_link_utilisation_and_busbw_curves_draw():
    r = simulate_collective("allreduce", 10**8, dgx_h100(2))
    assert "utilisation" in link_utilisation(r).axes[0].get_title()
    fig = busbw_curves(dgx_h100(1), sizes=[1e3, 1e6, 1e9],
                       algorithms=("auto", "ring", "nvls", "collnet_chain"))
    assert len(fig.axes[0].get_lines()) == 3  # no SHARP switches: CollNet is skipped
    fig = busbw_curves(dgx_h100(1), sizes=[1e3, 1e6, 1e9], protocol="alpha-beta",
                       algorithms=("ring", "tree", "recursive_doubling"))
    assert len(fig.axes[0].get_lines()) == 3
    # textbook-only names, or "alpha-beta:<name>", use the textbook model beside NCCL's
    fig = busbw_curves(dgx_h100(2), sizes=[1e3, 1e6, 1e9],
                       algorithms=("auto", "hierarchical", "alpha-beta:ring"))
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["DGX H100 x2, NCCL's choice", "DGX H100 x2, hierarchical (textbook)",
                      "DGX H100 x2, ring (textbook)"]


def test_published_curve_draws_measured_points_and_the_model():
    from labsim.plots import published_curve
    from labsim.published import nccl_tests

    curve = nccl_tests()[0]
    ax = published_curve(curve).axes[0]
    assert [line.get_label() for line in ax.get_lines()][:2] == ["published", "NCCL model"]
    assert curve.id in ax.get_title() and curve.role in ax.get_title()


@pytest.mark.slow
def test_collectives_widget_and_its_static_figure():
    from labsim.widgets import collectives_figure, explore_collectives

    fig = collectives_figure("pcie-a100", 2, "allreduce", ("auto", "ring", "tree"), 2**20)
    assert "16 GPUs" in fig.axes[0].get_title()
    explorer = explore_collectives(nodes=2)
    first = explorer.png
    assert first and explorer._repr_mimebundle_()["image/png"] == first  # static fallback
    explorer.controls["nodes"].value = 4
    assert explorer.png != first and "32 GPUs" in explorer.figure.axes[0].get_title()
