"""A training step, built in one direction: from the model to its time.

1. **Work** -- ``labsim.workload.Transformer``: the model's shapes.
2. **Per-op time on one GPU** -- ``labsim.compute``: each layer's GEMMs, attention core and
   memory-bound kernels on the plan's GPU and software profile.
3. **Chunks and flows** -- ``labsim.step.costs``: ``step_costs(model, cluster, plan)`` prices
   one step once into a ``StepCosts``: every model chunk's compute (``ChunkCost``, with the
   collectives it waits for besides TP's: ``labsim.step.inline``) and every collective placed
   on the pipes of the folded network (``labsim.network``).
4. **Schedule** -- ``labsim.pipeline``: each stage's op list (GPipe, 1F1B, interleaved).
5. **Evaluation** -- the schedule run over the ``StepCosts``:

   * ``labsim.step.alone``: exactly, op by op without events, every flow at its rate alone,
     and the one meeting it prices (``labsim.step.beside``: an op's TP bytes beside its
     stage's gradient buckets; ``labsim.step.zero3_fluid``: ZeRO-3's gather and reduce
     streams) as fluids -- exactly what the engine computes when nothing else contends;
   * ``labsim.step.closed_form``: ``estimate_step``, that evaluation for short schedules and
     formulas for long ones;
   * ``labsim.sim.step``: ``simulate_step``, the same costs as simpy events, with contention
     on every pipe (the fast path above whenever no two flows meet).

6. **Result** -- ``labsim.step.result``: ``StepResult``, with its error band
   (``labsim.bands``).
"""

from labsim.step.closed_form import estimate_step
from labsim.step.costs import (
    ChunkCost,
    StepCosts,
    contended_chunks,
    stage_memory,
    step_costs,
    zero3_gathers,
)
from labsim.step.result import StepResult, result_from

__all__ = ["ChunkCost", "StepCosts", "StepResult", "contended_chunks", "estimate_step",
           "result_from", "stage_memory", "step_costs", "zero3_gathers"]
