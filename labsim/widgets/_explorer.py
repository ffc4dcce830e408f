"""The one shape every explorer has: controls over a pure figure function.

``Explorer`` is a ``VBox`` of controls and one output area holding exactly one figure. A change
of a control asks for a redraw; redraws are coalesced so that the latest state always wins: in
a kernel the redraw runs ``DEBOUNCE_S`` later on a timer thread, so that every control change
already queued (a slider dragged, keys held) is applied first and drawn once, and a change that
arrives while a figure is being drawn is drawn next; sliders report only where they are
released (``continuous_update=False``), so a drag does not flood the kernel. Outside a kernel
(tests, scripts) a change redraws at once.

Its display bundle carries, beside the live widget, a PNG of the current figure: front ends
that cannot run widgets (GitHub, nbviewer, nbval, an exported notebook) show that static
figure instead. Figures come from ``labsim.plots`` (never pyplot), so none is kept alive after
it is replaced and none is shown twice.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Callable, Mapping
from typing import Any

import ipywidgets as w
from matplotlib.figure import Figure

DEBOUNCE_S = 0.05


def figure_png(fig: Figure, dpi: int = 80) -> str:
    """Base64 PNG of a figure, as a notebook stores it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _display_data(figure: Figure) -> dict[str, Any]:
    """The output a figure shows as (PNG and a text stand-in), for an ``Output`` widget."""
    png = figure._repr_png_() if hasattr(figure, "_repr_png_") else None
    if png is None:
        buf = io.BytesIO()
        figure.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        png = buf.getvalue()
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": base64.b64encode(png).decode("ascii"),
                     "text/plain": f"<figure {figure.get_figwidth():g}x"
                                   f"{figure.get_figheight():g} in>"}}


def _in_kernel() -> bool:
    """True inside a Jupyter kernel (where widget changes arrive as comm messages)."""
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class Explorer(w.VBox):
    """Controls over ``figure_fn(**values)``: one figure, redrawn for the latest values."""

    def __init__(self, figure_fn: Callable[..., Figure], controls: Mapping[str, w.Widget],
                 rows: tuple[int, ...] = (4,)) -> None:
        self.figure_fn = figure_fn
        self.controls = dict(controls)
        self.out = w.Output()
        widgets, lines, start = list(self.controls.values()), [], 0
        for size in (*rows, len(widgets)):
            if start < len(widgets):
                lines.append(w.HBox(widgets[start:start + size]))
            start += size
        super().__init__([*lines, self.out])
        self.figure: Figure | None = None
        self.draws = 0  # how many figures were drawn (a redraw per coalesced change)
        self._png: tuple[int, str] = (-1, "")
        self._pending = False
        self._lock = threading.Lock()  # one figure is drawn at a time
        for control in self.controls.values():
            if "continuous_update" in control.traits():
                control.continuous_update = False
            control.observe(self._changed, names="value")
        self.redraw()

    @property
    def values(self) -> dict[str, Any]:
        return {name: c.value for name, c in self.controls.items()}

    @property
    def png(self) -> str:
        """Base64 PNG of the figure on show (made when first asked for, once per figure)."""
        if self.figure is None:
            return ""
        if self._png[0] != self.draws:
            self._png = (self.draws, figure_png(self.figure))
        return self._png[1]

    def _changed(self, _: Any = None) -> None:
        if not _in_kernel():
            self.redraw()
        elif not self._pending:
            self._pending = True
            threading.Timer(DEBOUNCE_S, self._flush).start()

    def _flush(self) -> None:
        with self._lock:
            self._pending = False  # a change from now on asks for one more figure
            self.redraw()

    def redraw(self, _: Any = None) -> None:
        """Draw the figure for the controls' values now, replacing the one on show (safe from
        a thread: the output area is set, not captured)."""
        figure = self.figure_fn(**self.values)
        self.figure = figure
        self.draws += 1
        self.out.outputs = (_display_data(figure),)  # one update: never zero or two figures

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)
        if isinstance(bundle, tuple):
            bundle = bundle[0]
        return {**(bundle or {}), "image/png": self.png}
