"""Megatron's tensor-parallel MLP by hand (labsim.parallel.tensor_parallel): on 2 and 4 real
processes its outputs and gradients equal one process; without ``f`` they do not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from labsim.lab import launch
from labsim.parallel import tensor_parallel as tp

pytestmark = pytest.mark.multiprocess


def _demos(rank: int, world: int) -> tuple[float, float]:
    """The demo as written, then with ``f``'s backward all-reduce removed."""
    from labsim.parallel import tensor_parallel

    right = tensor_parallel.demo(rank, world)
    tensor_parallel.CopyToParallel.backward = staticmethod(lambda ctx, grad: grad)
    return right, tensor_parallel.demo(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_mlp_equals_one_process_and_needs_f(world: int) -> None:
    result = launch(_demos, world, timeout_s=120)
    assert all(right < 1e-12 for right, _ in result)
    assert all(broken > 1e-3 for _, broken in result)  # the input gradient misses t-1 parts


def test_split_mlp_blocks_and_rejects_uneven() -> None:
    up, down = nn.Linear(4, 12), nn.Linear(12, 4)
    part = tp.split_mlp(up, down, 1, 3)
    assert torch.equal(part.up.weight, up.weight[4:8])
    assert torch.equal(part.down.weight, down.weight[:, 4:8])
    with pytest.raises(ValueError, match="not divisible"):
        tp.split_mlp(up, down, 0, 5)
