"""ipywidgets explorers (the presentation layer): one module per explorer, each over a pure
function that also draws a static figure (ipywidgets is imported here only).

The memory explorer also shows a PNG of its figure to front ends that cannot run widgets
(GitHub, nbviewer).
"""

from labsim.widgets.collectives import collectives_figure, explore_collectives
from labsim.widgets.data_parallel import dp_step_figure, explore_data_parallel
from labsim.widgets.loading import dataloader_figure, explore_dataloader
from labsim.widgets.memory import memory_explorer, memory_figure
from labsim.widgets.pipeline import explore_pipeline, pipeline_figure
from labsim.widgets.zero import explore_zero, zero_figure

__all__ = ["collectives_figure", "dataloader_figure", "dp_step_figure", "explore_collectives",
           "explore_data_parallel", "explore_dataloader", "explore_pipeline", "explore_zero",
           "memory_explorer", "memory_figure", "pipeline_figure", "zero_figure"]
