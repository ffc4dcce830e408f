"""A matplotlib Figure that shows itself in Jupyter, without pyplot's global figure list.

Figures made through ``pyplot`` stay registered until closed, and the inline backend then
shows them a second time at the end of the cell.  ``new_figure`` makes a free-standing figure
whose ``_repr_png_`` lets IPython display it exactly once, when a cell returns it.
"""

from __future__ import annotations

import io
from typing import Any

from matplotlib.figure import Figure


class LabFigure(Figure):
    """A ``matplotlib.figure.Figure`` with a PNG representation for IPython."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        return buf.getvalue()


def new_figure(figsize: tuple[float, float] = (8.0, 5.0), **kwargs: Any) -> LabFigure:
    """A new free-standing figure (not tracked by pyplot); ``kwargs`` go to ``Figure``
    (``layout="constrained"``, ...).  Every figure labsim draws is made here."""
    return LabFigure(figsize=figsize, **kwargs)
