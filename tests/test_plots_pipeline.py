"""Pipeline Gantt chart: draws stages x time from a step or pipeline result."""

import matplotlib

matplotlib.use("Agg")

import labsim  # noqa: E402
from labsim.plan import Plan  # noqa: E402
from labsim.plots.pipeline import pipeline_gantt  # noqa: E402
from labsim.sim.pipeline import simulate_pipeline  # noqa: E402
from labsim.sim.step import simulate_step  # noqa: E402


def test_pipeline_gantt_rows_and_title(tmp_path):
    r = simulate_pipeline(4, 6, 1.0, 2.0)
    fig = pipeline_gantt(r)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"stage {s}" for s in range(4)]
    assert "bubble 33.3%" in ax.get_title()
    assert len(ax.texts) == 4 * 6 * 2  # one micro-batch label per forward and backward
    fig.savefig(tmp_path / "g.png")


def test_a_timeline_on_paper_is_drawn_in_its_own_unit_with_the_legend_clear_of_the_bars():
    r = simulate_pipeline(4, 6, 1.0, 2.0)
    ax = pipeline_gantt(r, time_unit="a stage's forward = 1").axes[0]
    assert ax.get_xlabel() == "time (a stage's forward = 1)"
    assert ax.get_xlim()[1] == r.step_time_s  # unscaled, not "time (s)"
    assert ax.get_legend().get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1e-6
    assert pipeline_gantt(r).axes[0].get_xlabel() == "time (s)"


def test_pipeline_gantt_of_a_step_with_streams():
    model = labsim.Transformer(layers=8, hidden=512, heads=8, seq_len=256, vocab=1000)
    r = simulate_step(model, labsim.dgx_a100(1), Plan(dp=2, tp=1, pp=4, global_batch=8,
                                                     recompute="full"))
    fig = pipeline_gantt(r, streams=("compute", "p2p", "dp"), max_stages=2)
    ax = fig.axes[0]
    assert len(ax.get_yticklabels()) == 2 * 3
    assert "2 more stages not shown" in ax.get_title()
    legend = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"forward", "backward", "recompute", "send"} <= legend


def test_in_flight_bubble_and_p2p_figures():
    from labsim.plots.pipeline import bubble_curves, in_flight_bars, p2p_curves

    fig = in_flight_bars({"GPipe": (8, 8, 8, 8), "1F1B": (4, 3, 2, 1)})
    assert len(fig.axes[0].patches) == 8
    fig = bubble_curves({4: [(1, 0.75), (8, 0.27)]}, target=0.1)
    assert {t.get_text() for t in fig.axes[0].get_legend().get_texts()} == {"p=4", "10%"}
    assert len(p2p_curves({"1F1B": [(0.0, 33.0), (0.5, 40.0)]}).axes[0].lines) == 1
