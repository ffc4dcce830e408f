"""Roofline chart: the roofs of catalog GPUs (and of a measured machine) with measured ops.

Log-log axes: x = arithmetic intensity (FLOP/byte), y = attainable FLOP/s.  Each roof is the
line ``min(peak, I * bandwidth)``; its knee is the ridge point.  Points are ops you measured:
(label, intensity, achieved FLOP/s).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from labsim.plots._figure import new_figure
from labsim.roofline import Roofline
from labsim.units import fmt_flops

Point = tuple[str, float, float]


def _label_offset_pt(intensity: float, achieved: float,
                     placed: list[tuple[float, float]]) -> float:
    """Vertical offset (points) of a point's label, moved down a line for every label already
    placed close by (within 0.35 decades across and 0.25 decades up or down), so labels of
    neighbouring points do not print over each other."""
    x, y = np.log10(max(intensity, 1e-30)), np.log10(max(achieved, 1e-30))
    near = sum(1 for px, py in placed if abs(px - x) < 0.35 and abs(py - y) < 0.25)
    placed.append((x, y))
    return -10.0 - 9.0 * near


def roofline(
    roofs: Iterable[Roofline | str] = ("A100-80GB", "H100-SXM"),
    points: Sequence[Point] = (),
    *,
    dtype: str = "bf16",
    intensity_range: tuple[float, float] | None = None,
    title: str = "Roofline",
    ax: Axes | None = None,
) -> Figure:
    """Draw roofs (``Roofline`` objects or catalog GPU names, read at ``dtype``) and points.

    ``points``: (label, intensity FLOP/byte, achieved FLOP/s) of measured ops; points whose
    label starts with the same word share a marker colour (e.g. "matmul 512", "matmul 1024").
    """
    lines = [r if isinstance(r, Roofline) else Roofline.of(r, dtype) for r in roofs]
    if not lines:
        raise ValueError("give at least one roof: a Roofline or a catalog GPU name")
    intensities = [p[1] for p in points if p[1] > 0]
    ridges = [r.ridge_point for r in lines]
    lo, hi = intensity_range or (
        min([0.05, *intensities, *ridges]) / 2,
        max([1e4, *intensities, *ridges]) * 2,
    )
    x = np.logspace(np.log10(lo), np.log10(hi), 256)
    if ax is None:
        fig = new_figure((8, 5))
        ax = fig.subplots()
    else:
        fig = ax.figure
    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, roof in enumerate(lines):
        c = colours[i % len(colours)]
        ax.loglog(x, np.minimum(roof.peak_flops, x * roof.bandwidth_Bps), color=c,
                  label=f"{roof.name}: {fmt_flops(roof.peak_flops)}, ridge "
                        f"{roof.ridge_point:.3g} FLOP/B")
        ax.plot([roof.ridge_point], [roof.peak_flops], "o", color=c, ms=4)
    groups: dict[str, str] = {}
    placed: list[tuple[float, float]] = []  # label anchors, in decades (log10 x, log10 y)
    for label, intensity, achieved in points:
        group = label.split()[0] if label.split() else label
        if group not in groups:
            groups[group] = colours[(len(lines) + len(groups)) % len(colours)]
        ax.plot([intensity], [achieved], "x", color=groups[group], ms=8, mew=2)
        ax.annotate(label, (intensity, achieved), textcoords="offset points",
                    xytext=(4, _label_offset_pt(intensity, achieved, placed)),
                    fontsize=7, color=groups[group])
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return fig
