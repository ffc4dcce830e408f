"""labsim.plots.precision: three panels, skipped steps marked and counted."""

from __future__ import annotations

import math
from types import SimpleNamespace

from matplotlib.figure import Figure

from labsim.plots.precision import loss_scaling_run


def test_panels_and_skipped_steps():
    run = SimpleNamespace(
        losses=(4.0, 3.0, 2.5, 2.0),
        scales=(8.0, 4.0, 4.0, 8.0),
        skipped=(True, False, False, False),
        grad_norms=(math.inf, 1.0, 0.9, 0.8),
    )
    fig = loss_scaling_run(run)
    assert isinstance(fig, Figure)
    axes = fig.get_axes()
    assert len(axes) == 3
    assert "1 of 4 steps skipped" in axes[0].get_title()
    # the norm panel draws only the finite norms
    assert list(axes[2].get_lines()[0].get_xdata()) == [1, 2, 3]
