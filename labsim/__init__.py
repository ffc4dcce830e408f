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

from types import ModuleType as _ModuleType

from labsim.attention import attention_cost, attention_flops, tiled_attention_hbm_bytes
from labsim.cluster import Cluster, dgx_a100, dgx_h100, pcie_box
from labsim.collectives import (
    CollectiveResult,
    algbw,
    busbw,
    busbw_factor,
    collective_lower_bound,
    collective_time,
    crossover_bytes,
    estimate_collective,
)
from labsim.fusion import chain_bytes, chain_time
from labsim.hardware import GPU, Link, gpu, link
from labsim.memory import MemoryBreakdown, activation_memory, training_memory
from labsim.plan import Plan
from labsim.quantization import decode_cost, decode_step_time, int8_decode_speedup
from labsim.roofline import Roofline, attainable_flops, fraction_of_peak, op_time, ridge_point
from labsim.sim.collectives import simulate_collective
from labsim.sim.loading import LoaderResult, simulate_dataloader
from labsim.sim.plan import PlanSearch, RankedPlan, plan_search
from labsim.sim.quantization import DecodeResult, simulate_decode_step
from labsim.sim.step import simulate_step
from labsim.step import StepResult, estimate_step
from labsim.trace import Span, Trace
from labsim.workload import Gemm, Transformer

__version__ = "0.1.0"

__all__ = sorted(
    name for name, value in globals().items()
    if not name.startswith("_") and not isinstance(value, _ModuleType)
)
