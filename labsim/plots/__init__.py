"""Matplotlib figures (the presentation layer): one module per kind of plot.

Every function returns a ``matplotlib.figure.Figure`` and never calls ``plt.show``; pass
``ax=`` to draw into an existing axes.
"""

from labsim.plots.scaling import scaling

__all__ = ["scaling"]
