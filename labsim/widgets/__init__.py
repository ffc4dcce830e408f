"""ipywidgets explorers (the presentation layer): one module per explorer, each over a pure
function that also draws a static figure (ipywidgets is imported here only)."""

from labsim.widgets.collectives import collectives_figure, explore_collectives
from labsim.widgets.data_parallel import dp_step_figure, explore_data_parallel
from labsim.widgets.zero import explore_zero, zero_figure

__all__ = ["collectives_figure", "dp_step_figure", "explore_collectives",
           "explore_data_parallel", "explore_zero", "zero_figure"]
