"""A pipeline by hand (labsim.parallel.pipeline): GPipe and 1F1B from ``labsim.pipeline`` on 3
real processes give the gradients of one process on the whole batch."""

from __future__ import annotations

import pytest
from torch import nn

from labsim.lab import launch
from labsim.parallel.pipeline import split_stages

pytestmark = pytest.mark.multiprocess


def _both(rank: int, world: int) -> dict[str, float]:
    from labsim.parallel import pipeline

    return {s: pipeline.demo(rank, world, schedule=s, microbatches=m)
            for s, m in (("gpipe", 4), ("1f1b", 5))}


def test_gpipe_and_1f1b_equal_one_process() -> None:
    result = launch(_both, 3, timeout_s=120)
    assert all(v < 1e-12 for r in result for v in r.values())


def test_split_stages() -> None:
    layers = [nn.Linear(2, 2) for _ in range(6)]
    stages = split_stages(layers, 3)
    assert [len(s) for s in stages] == [2, 2, 2] and stages[1][0] is layers[2]
    with pytest.raises(ValueError, match="equal stages"):
        split_stages(layers, 4)


def test_timed_stage_pads_and_logs_each_op_in_order() -> None:
    import time

    import torch

    from labsim.parallel.pipeline import TimedStage, measured_bubble

    stage = TimedStage(nn.Linear(3, 3).double(), t_f=0.02, t_b=0.04)
    stage.reset(time.perf_counter())
    outs = [stage(torch.randn(2, 3, dtype=torch.float64)) for _ in range(2)]
    outs[1].backward(torch.ones(2, 3, dtype=torch.float64))
    outs[0].sum().backward()
    assert [(op.kind, op.microbatch) for op in stage.log] == [("F", 0), ("F", 1), ("B", 1),
                                                             ("B", 0)]
    assert all(op.end_s - op.start_s >= (0.02 if op.kind == "F" else 0.04)
               for op in stage.log)
    assert stage.inner.weight.grad is not None
    step, bubble = measured_bubble([stage.log])
    assert step >= 0.12 and 0 <= bubble < 1
