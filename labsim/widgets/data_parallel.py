"""Explore a data-parallel step: model, cluster, GPUs, bucket size, overlap, accumulation.

``dp_step_figure`` is the pure function (``simulate_step`` drawn by ``labsim.plots.trace``,
with the step's exposed communication in the title); ``explore_data_parallel`` wraps it.
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from labsim.cluster import PRESETS, cluster
from labsim.plan import Plan
from labsim.plots.trace import gantt
from labsim.sim.data_parallel import exposed_comm_s
from labsim.sim.step import simulate_step
from labsim.workload import Transformer


def dp_step_figure(model: str = "gpt2-1.5b", preset: str = "dgx-a100", nodes: int = 8,
                   micro_batch: int = 4, accumulation: int = 1, bucket_mb: float = 25.0,
                   overlap: bool = True) -> Figure:
    """Gantt chart of one data-parallel step of ``model`` on every GPU of ``nodes`` nodes."""
    c = cluster(preset, nodes)
    n = c.world_size
    plan = Plan(dp=n, micro_batch=micro_batch, global_batch=n * micro_batch * accumulation,
                overlap_grad_reduce=overlap, bucket_bytes=bucket_mb * 1e6)
    r = simulate_step(Transformer.preset(model), c, plan, memory=False)
    title = (f"{model} on {n} GPUs ({c.name}), {accumulation} micro-batch(es) of "
             f"{micro_batch}, {bucket_mb:g} MB buckets, overlap {'on' if overlap else 'off'}: "
             f"step {r.step_time_s * 1e3:.1f} ms, exposed comm "
             f"{exposed_comm_s(r) * 1e3:.1f} ms, MFU {r.mfu:.0%}")
    return gantt(r.trace, ranks=[0], title=title)


def explore_data_parallel(**defaults: Any) -> Any:
    """Controls over ``dp_step_figure``."""
    import ipywidgets as w

    from labsim.widgets._explorer import Explorer

    start = dict(model="gpt2-1.5b", preset="dgx-a100", nodes=8, micro_batch=4,
                 accumulation=1, bucket_mb=25.0, overlap=True)
    start.update(defaults)
    controls = {
        "model": w.Dropdown(options=list(Transformer.presets(dense=True)), value=start["model"],
                            description="model"),
        "preset": w.Dropdown(options=list(PRESETS),
                             value=start["preset"], description="cluster"),
        "nodes": w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64], value=start["nodes"],
                                   description="nodes"),
        "micro_batch": w.IntSlider(start["micro_batch"], 1, 16, description="micro-batch"),
        "accumulation": w.SelectionSlider(options=[1, 2, 4, 8, 16],
                                          value=start["accumulation"],
                                          description="accumulate"),
        "bucket_mb": w.SelectionSlider(options=[1.0, 5.0, 25.0, 100.0, 500.0],
                                       value=start["bucket_mb"], description="bucket MB"),
        "overlap": w.Checkbox(value=start["overlap"], description="overlap"),
    }
    return Explorer(dp_step_figure, controls, rows=(3, 3))
