"""ipywidgets explorers (the presentation layer): one module per explorer, each over a pure
function that also draws a static figure (ipywidgets is imported here only)."""

from labsim.widgets.collectives import collectives_figure, explore_collectives
from labsim.widgets.dataloader import dataloader_figure, explore_dataloader

__all__ = ["collectives_figure", "dataloader_figure", "explore_collectives",
           "explore_dataloader"]
