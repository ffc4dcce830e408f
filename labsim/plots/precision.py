"""A mixed-precision run step by step: loss, loss scale and gradient norm, skipped steps marked.

Reads an ``AmpRun`` (``labsim.experiments.precision.train_amp``).  A skipped step has an infinite or
NaN gradient norm; it is drawn as a red mark on every panel so that the loss curve, which
hides skipped steps, can be read against the scale and the norm (what to watch, claim 002-11).
"""

from __future__ import annotations

import math
from typing import Protocol

from matplotlib.figure import Figure

from labsim.plots._figure import new_figure


class _Run(Protocol):
    losses: tuple[float, ...]
    scales: tuple[float, ...]
    skipped: tuple[bool, ...]
    grad_norms: tuple[float, ...]


def loss_scaling_run(run: _Run, *, title: str = "Dynamic loss scaling") -> Figure:
    """Three panels sharing the step axis: loss, log2(scale), unscaled gradient norm."""
    steps = list(range(len(run.losses)))
    skipped = [i for i in steps if run.skipped[i]]
    fig = new_figure((9, 6.5))
    ax_loss, ax_scale, ax_norm = fig.subplots(3, 1, sharex=True)
    ax_loss.plot(steps, run.losses, "-o", ms=3)
    ax_loss.set_ylabel("loss")
    ax_scale.step(steps, [math.log2(s) for s in run.scales], where="post")
    ax_scale.set_ylabel("log2(scale)")
    finite = [(i, n) for i, n in zip(steps, run.grad_norms) if math.isfinite(n)]
    ax_norm.plot([i for i, _ in finite], [n for _, n in finite], "-o", ms=3)
    ax_norm.set_ylabel("grad norm (unscaled)")
    ax_norm.set_xlabel("step")
    for ax in (ax_loss, ax_scale, ax_norm):
        for i in skipped:
            ax.axvline(i, color="tab:red", alpha=0.3, lw=3)
    ax_loss.set_title(f"{title}: {len(skipped)} of {len(steps)} steps skipped (red)")
    fig.tight_layout()
    return fig
