"""Matplotlib figures (the presentation layer): one module per topic (``series`` draws any
measured or modelled quantities against a size).

Every function returns a ``matplotlib.figure.Figure`` made by ``_figure.new_figure`` (free of
pyplot's global figure list, shown once by IPython) and never calls ``plt.show``; pass
``ax=`` to draw into an existing axes where a function takes one.
"""

from labsim.plots.checkpointing import recompute_tradeoff
from labsim.plots.collectives import busbw_curves, published_curve
from labsim.plots.data_parallel import bucket_curve, scaling_curves
from labsim.plots.loading import sweep_figure, utilisation_timeline
from labsim.plots.memory import memory_bars
from labsim.plots.network import link_utilisation
from labsim.plots.pipeline import pipeline_gantt
from labsim.plots.precision import loss_scaling_run
from labsim.plots.quantization import int8_decode
from labsim.plots.roofline import roofline
from labsim.plots.series import scaling
from labsim.plots.trace import gantt
from labsim.plots.zero import zero_bars

__all__ = sorted(name for name in dir() if not name.startswith("_")
                 and callable(globals()[name]))
