"""ipywidgets explorers (the presentation layer): one module per explorer.

Each explorer is one line in a notebook over a pure function that draws a static figure; the
widget shows a PNG of that figure to front ends that cannot run widgets (GitHub, nbviewer).
"""

from labsim.widgets.memory import memory_explorer, memory_figure

__all__ = ["memory_explorer", "memory_figure"]
