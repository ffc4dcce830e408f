"""Tensor-parallel figures draw the studies they are given."""

import matplotlib

matplotlib.use("Agg")

import labsim  # noqa: E402
from labsim.plots import tensor_parallel as p  # noqa: E402
from labsim.sim import tensor_parallel as stp  # noqa: E402

MODEL = labsim.Transformer(layers=4, hidden=1024, heads=8, seq_len=512, vocab=1000)
DGX = labsim.dgx_a100(1)


def test_layer_time_and_overlap_bars(tmp_path) -> None:
    rows = [stp.layer_times(MODEL, stp.tp_cluster(DGX, t, a)) for t, a in ((2, 0), (2, 1))]
    fig = p.layer_time_bars(rows)
    ax = fig.axes[0]
    assert len(ax.patches) == 4 and {t.get_text() for t in ax.texts} == {
        f" {r.comm_fraction:.0%}" for r in rows}
    over = [stp.overlap_times(MODEL, stp.tp_cluster(DGX, 4))]
    assert len(p.overlap_bars(over).axes[0].patches) == 3
    fig.savefig(tmp_path / "bars.png")


def test_efficiency_and_activation_figures() -> None:
    fig = p.tp_efficiency_curves({"NVLink": stp.tp_scaling(MODEL, DGX, [1, 2, 4])})
    assert fig.axes[0].get_legend().get_texts()[0].get_text() == "NVLink"
    rows = stp.sp_activation_rows(MODEL, [1, 2, 4])
    fig = p.activation_bars(rows, capacity_bytes=80e9)
    assert len(fig.axes[0].patches) == 4 * 3
