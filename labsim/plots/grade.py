"""A class's grades at a glance: how the scores are spread and which checks held learners back.

``scores`` draws, for one lab, a histogram of the submissions' scores (out of the lab's
maximum) beside each check's share of submissions that passed it, hardest check first --
what ``labsim grade --summary`` saves as ``scores.png``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from labsim.plots._figure import new_figure


def scores(totals: Sequence[float], maximum: float, pass_rates: Mapping[str, float], *,
           title: str = "") -> Figure:
    """Histogram of ``totals`` (points, out of ``maximum``) and bars of ``pass_rates`` (check
    name -> share of submissions that passed it, 0-1)."""
    if maximum <= 0:
        raise ValueError(f"maximum must be > 0 points, got {maximum!r}")
    fig = new_figure((11.0, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1.1, 1.0))
    bins = np.linspace(0.0, maximum, min(20, max(4, int(round(maximum)) * 2)) + 1)
    left.hist(np.clip(np.asarray(totals, dtype=float), 0.0, maximum), bins=bins,
              color="#4C72B0", edgecolor="white")
    left.set_xlim(0.0, maximum)
    left.set_xlabel(f"score (points out of {maximum:g})")
    left.set_ylabel("submissions")
    left.set_title(f"{len(totals)} submission(s)")
    names = sorted(pass_rates, key=lambda n: pass_rates[n])
    rates = [100.0 * pass_rates[n] for n in names]
    right.barh(range(len(names)), rates, color="#55A868")
    right.set_yticks(range(len(names)), names)
    right.set_xlim(0.0, 100.0)
    right.set_xlabel("submissions that passed (%)")
    right.set_title("checks, hardest first")
    for y, rate in enumerate(rates):
        right.text(min(rate + 1.0, 92.0), y, f"{rate:.0f} %", va="center", fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


__all__ = ["scores"]
