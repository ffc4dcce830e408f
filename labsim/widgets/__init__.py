"""ipywidgets explorers (the presentation layer): one module per explorer, each over a pure
function that also draws a static figure (ipywidgets is imported here only)."""

from labsim.widgets.collectives import collectives_figure, explore_collectives

__all__ = ["collectives_figure", "explore_collectives"]
