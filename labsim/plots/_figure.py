"""A matplotlib Figure that shows itself in Jupyter, exactly once, without pyplot's global
figure list.

Figures made through ``pyplot`` stay registered until closed, and the inline backend then
shows them a second time at the end of the cell.  ``new_figure`` makes a free-standing figure
whose ``_repr_png_`` lets IPython display it when a cell returns it.  A figure a cell does not
return -- drawn in a loop, or assigned to a name -- is shown when the cell ends, as the inline
backend does for pyplot's figures: the running IPython shell keeps the cell's figures (on the
shell object, so nothing is kept outside a notebook) and a ``post_run_cell`` hook displays the
ones nothing has shown yet.
"""

from __future__ import annotations

import io
from typing import Any

from matplotlib.figure import Figure

_PENDING = "_labsim_pending_figures"  # attribute of the IPython shell


class LabFigure(Figure):
    """A ``matplotlib.figure.Figure`` with a PNG representation for IPython."""

    shown = False  # set once IPython (or a widget) has rendered it

    def _repr_png_(self) -> bytes:
        self.shown = True
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        return buf.getvalue()


def _show_pending(shell: Any) -> None:
    """Display the figures made since the last cell ended that nothing has shown."""
    from IPython.display import display

    pending, figures = getattr(shell, _PENDING), list(getattr(shell, _PENDING))
    pending.clear()
    for fig in figures:
        if not fig.shown:
            display(fig)


def _register(fig: LabFigure) -> None:
    """Hand ``fig`` to the running IPython shell's end-of-cell display (no shell: nothing)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or not hasattr(shell, "events"):
        return
    if not hasattr(shell, _PENDING):
        setattr(shell, _PENDING, [])
        shell.events.register("post_run_cell", lambda _result: _show_pending(shell))
    getattr(shell, _PENDING).append(fig)


def new_figure(figsize: tuple[float, float] = (8.0, 5.0), **kwargs: Any) -> LabFigure:
    """A new free-standing figure (not tracked by pyplot); ``kwargs`` go to ``Figure``
    (``layout="constrained"``, ...).  Every figure labsim draws is made here.  In a notebook
    the figure shows once: where the cell returns it, or else when the cell ends."""
    fig = LabFigure(figsize=figsize, **kwargs)
    _register(fig)
    return fig
