"""The one shape every explorer has: controls over a pure figure function.

``Explorer`` is a ``VBox`` of controls and an output area. Each change of a control calls the
figure function with the controls' values and shows the figure. Its display bundle carries,
beside the live widget, a PNG of the current figure: front ends that cannot run widgets
(GitHub, nbviewer, nbval, an exported notebook) show that static figure instead.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Mapping
from typing import Any

import ipywidgets as w
from IPython.display import clear_output, display
from matplotlib.figure import Figure


def figure_png(fig: Figure, dpi: int = 80) -> str:
    """Base64 PNG of a figure, as a notebook stores it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class Explorer(w.VBox):
    """Controls over ``figure_fn(**values)``; redraws on every change, PNG fallback included."""

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
        self.png = ""
        self.figure: Figure | None = None
        for control in self.controls.values():
            control.observe(self.redraw, names="value")
        self.redraw()

    @property
    def values(self) -> dict[str, Any]:
        return {name: c.value for name, c in self.controls.items()}

    def redraw(self, _: Any = None) -> None:
        self.figure = self.figure_fn(**self.values)
        self.png = figure_png(self.figure)
        with self.out:
            clear_output(wait=True)
            display(self.figure)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)
        if isinstance(bundle, tuple):
            bundle = bundle[0]
        return {**(bundle or {}), "image/png": self.png}
