"""The one shape every explorer has: controls over a pure figure function.

``Explorer`` is a ``VBox`` of controls and one output area holding exactly one figure. A change
of a control asks for a redraw; redraws are coalesced so that the latest state always wins: in
a running kernel the redraw waits ``DEBOUNCE_S`` on the kernel's event loop, so that every
control change already queued (a slider dragged, keys held) is applied first and drawn once;
sliders report only where they are released (``continuous_update=False``), so a drag does not
flood the kernel. Outside a kernel (tests, scripts) a change redraws at once.

Its display bundle carries, beside the live widget, a PNG of the current figure: front ends
that cannot run widgets (GitHub, nbviewer, nbval, an exported notebook) show that static
figure instead. Figures come from ``labsim.plots`` (never pyplot), so none is kept alive after
it is replaced and none is shown twice.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Callable, Mapping
from typing import Any

import ipywidgets as w
from IPython.display import clear_output, display
from matplotlib.figure import Figure

DEBOUNCE_S = 0.05


def figure_png(fig: Figure, dpi: int = 80) -> str:
    """Base64 PNG of a figure, as a notebook stores it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


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
        loop = _running_loop()
        if loop is None:
            self.redraw()
        elif not self._pending:
            self._pending = True
            loop.call_later(DEBOUNCE_S, self._flush)

    def _flush(self) -> None:
        self._pending = False
        self.redraw()

    def redraw(self, _: Any = None) -> None:
        """Draw the figure for the controls' values now, replacing the one on show."""
        self.figure = self.figure_fn(**self.values)
        self.draws += 1
        with self.out:
            clear_output(wait=True)
            display(self.figure)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)
        if isinstance(bundle, tuple):
            bundle = bundle[0]
        return {**(bundle or {}), "image/png": self.png}
