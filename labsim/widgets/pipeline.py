"""Explore pipeline schedules: depth p, micro-batches m, chunks v, and the zero-bubble split.

``pipeline_figure`` is the pure function: the schedule's timeline on uniform stages
(``labsim.pipeline.timeline``) drawn by ``labsim.plots.pipeline_gantt``, the bubble measured
from that trace beside the closed form; ``explore_pipeline`` wraps it in an ``Explorer``.
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from labsim.pipeline import (
    bubble_fraction,
    bubble_from_trace,
    make_schedule,
    timeline,
    zero_bubble_h1,
)
from labsim.plots.pipeline import pipeline_gantt

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble (ZB-H1)")
PAPER_TIME = "a stage's forward = 1"  # the unit of timelines on paper (t_f = 1, t_b = 2)


def pipeline_figure(schedule: str = "1f1b", p: int = 4, m: int = 8, v: int = 2,
                    p2p: float = 0.0, w_share: float = 1 / 3) -> Figure:
    """Gantt chart of ``schedule`` on ``p`` uniform stages (forward 1, backward 2 time units;
    ``p2p`` units per message; ZB-H1 splits ``w_share`` of the backward off as W), titled
    with the bubble measured from the chart and the closed form."""
    if schedule.startswith("zero"):
        sched, t_w, formula = zero_bubble_h1(p, m), 2 * w_share, None
    else:
        v_used = v if schedule == "interleaved" else 1
        if schedule == "interleaved" and m % p:
            m = max(p, m - m % p)  # Megatron-LM's rule: m a multiple of p
        sched, t_w, formula = make_schedule(schedule, p, m, v_used), 0.0, bubble_fraction(
            p, m, v_used)
    tl = timeline(sched, 1.0, 2.0, t_w=t_w, p2p_s=p2p)
    closed = "" if formula is None or p2p else f"closed form {formula:.1%}; "
    title = (f"{schedule}, p={p}, m={m}" + (f", v={v}" if schedule == "interleaved" else "")
             + f": {tl.messages} messages; {closed}measured from the chart "
             f"{bubble_from_trace(tl.trace):.1%}")
    return pipeline_gantt(_Chart(tl.trace), streams=("compute", "p2p") if p2p else
                          ("compute",), title=title, time_unit=PAPER_TIME)


class _Chart:
    """A trace without a bubble of its own (the title carries it)."""

    def __init__(self, trace: Any) -> None:
        self.trace = trace


def explore_pipeline(**defaults: Any) -> Any:
    """Controls over ``pipeline_figure``.  A control a schedule ignores is disabled while that
    schedule is chosen (``v`` outside interleaving, the W share outside ZB-H1), and with
    interleaving the micro-batch slider steps by ``p`` (Megatron-LM's rule: ``m`` a multiple of
    ``p``), so that every live control changes the chart.  Times are in units of a stage's
    forward (``t_f`` = 1, ``t_b`` = 2)."""
    import ipywidgets as w

    from labsim.widgets._explorer import Explorer

    start = dict(schedule="1f1b", p=4, m=8, v=2, p2p=0.0, w_share=1 / 3)
    start.update(defaults)
    wide = {"description_width": "initial"}  # whole labels, never "micro-bat..."
    controls = {
        "schedule": w.Dropdown(options=list(SCHEDULES), value=start["schedule"],
                               description="schedule", style=wide),
        "p": w.IntSlider(start["p"], 1, 8, description="stages p", style=wide),
        "m": w.IntSlider(start["m"], 1, 32, description="micro-batches m", style=wide),
        "v": w.IntSlider(start["v"], 2, 4, description="chunks v", style=wide),
        "p2p": w.FloatSlider(start["p2p"], min=0.0, max=1.0, step=0.1, readout_format=".1f",
                             description="message time / t_f", style=wide),
        "w_share": w.FloatSlider(start["w_share"], min=0.1, max=0.5, step=0.05,
                                 readout_format=".2f", description="W time / t_b",
                                 style=wide),
    }
    sync_controls(controls)
    for name in ("schedule", "p"):  # registered before the explorer's own: applied first
        controls[name].observe(lambda _change: sync_controls(controls), names="value")
    return Explorer(pipeline_figure, controls, rows=(3, 3))


def sync_controls(controls: dict[str, Any]) -> None:
    """Enable the controls the chosen schedule reads and disable the others; with
    interleaving, let ``m`` take only multiples of ``p``."""
    schedule = controls["schedule"].value
    interleaved = schedule == "interleaved"
    controls["v"].disabled = not interleaved
    controls["w_share"].disabled = not schedule.startswith("zero")
    m, p = controls["m"], controls["p"].value
    if interleaved:
        m.min, m.step = p, p
        m.value = max(p, m.value - m.value % p)
    else:
        m.min, m.step = 1, 1
