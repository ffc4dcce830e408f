"""The pipeline explorer's figure: a chart, its bubble measured and the closed form."""

import matplotlib

matplotlib.use("Agg")


def test_pipeline_figure_titles_the_bubble_from_its_chart() -> None:
    from labsim.widgets import pipeline_figure

    title = pipeline_figure("1f1b", 4, 8).axes[0].get_title()
    assert "closed form 27.3%; measured from the chart 27.3%" in title
    assert "48 messages" in title
    zb = pipeline_figure("zero-bubble (ZB-H1)", 4, 8, w_share=1 / 3).axes[0].get_title()
    assert "measured from the chart" in zb and "closed form" not in zb
    odd = pipeline_figure("interleaved", 4, 6, 2).axes[0].get_title()
    assert "m=4" in odd  # rounded to a multiple of p
