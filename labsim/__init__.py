"""labsim: the GPU training-acceleration lab's simulator and helpers.

Three layers, imports pointing one way only:

1. values (no simpy, no plotting): ``units``, ``hardware``, workload and memory models,
   closed-form cost models, ``trace`` (plain data);
2. simulation (simpy): ``sim`` -- cluster and links, collectives, schedules, training step,
   data loader;
3. presentation: ``plots`` and ``widgets`` (matplotlib and ipywidgets are imported there only).

Beside them: ``lab`` (helpers for real PyTorch exercises), ``checks`` (what check cells call)
and ``course`` (release and grading), and the ``labsim`` command line in ``cli``.
"""

from labsim.hardware import GPU, Link, gpu, link
from labsim.sim.dataloader import LoaderResult, simulate_dataloader
from labsim.trace import Span, Trace

__version__ = "0.1.0"

__all__ = ["GPU", "Link", "Span", "Trace", "gpu", "link"]
__all__ += ["LoaderResult", "simulate_dataloader"]
