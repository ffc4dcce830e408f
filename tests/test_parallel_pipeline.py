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
