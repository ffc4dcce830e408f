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


def test_every_live_control_changes_the_chart_and_the_others_are_disabled() -> None:
    from labsim.widgets import explore_pipeline
    from labsim.widgets.pipeline import SCHEDULES

    explorer = explore_pipeline()
    moves = {"p": 3, "m": 12, "v": 3, "p2p": 0.3, "w_share": 0.2}
    for schedule in SCHEDULES:
        explorer.controls["schedule"].value = schedule
        disabled = {n for n, c in explorer.controls.items() if c.disabled}
        assert disabled == ({"w_share"} if schedule == "interleaved" else {"v"}
                            if schedule.startswith("zero") else {"v", "w_share"})
        for name, value in moves.items():
            if name in disabled:
                continue
            control = explorer.controls[name]
            before, old = explorer.png, control.value
            control.value = value
            assert explorer.png != before, (schedule, name)
            control.value = old


def test_interleaved_micro_batches_step_by_p() -> None:
    from labsim.widgets import explore_pipeline

    explorer = explore_pipeline(schedule="interleaved", p=4, m=10)
    m = explorer.controls["m"]
    assert (m.value, m.min, m.step) == (8, 4, 4)
    explorer.controls["p"].value = 3
    assert m.value % 3 == 0 and m.step == 3
    explorer.controls["schedule"].value = "gpipe"
    assert (m.min, m.step) == (1, 1)


def test_no_label_is_cut_and_the_message_has_a_unit() -> None:
    from labsim.widgets import explore_pipeline

    controls = explore_pipeline().controls
    assert all(c.style.description_width == "initial" for c in controls.values())
    assert controls["p2p"].description == "message time / t_f"
