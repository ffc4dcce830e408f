"""Data parallel by hand (labsim.parallel.data_parallel) and ZeRO-1 (labsim.parallel.zero):
structure in one process, and the torchrun demos on 2 real processes (ranks agree)."""

from __future__ import annotations

import pytest
import torch

from labsim.lab import launch
from labsim.parallel import data_parallel as dp
from labsim.parallel.zero import shard_bounds

pytestmark = pytest.mark.multiprocess


def _both_demos(rank: int, world: int) -> tuple[float, float]:
    from labsim.parallel import data_parallel, zero

    return data_parallel.demo(rank, world), zero.demo(rank, world)


def test_demos_leave_ranks_identical() -> None:
    result = launch(_both_demos, 2, timeout_s=120)
    assert [v for r in result for v in r] == [0.0] * 4


def test_trapnet_traps() -> None:
    m = dp.TrapNet()
    assert m.head.weight is m.embed.weight
    assert not m.frozen.weight.requires_grad
    dp.lm_loss(m, dp.make_tokens(0, 2)).backward()
    assert m.unused.weight.grad is None and m.frozen.weight.grad is None
    assert m.embed.weight.grad is not None


def test_shard_splits_rows_and_rejects_uneven() -> None:
    b = torch.arange(12).reshape(6, 2)
    assert torch.equal(torch.cat([dp.shard(b, r, 3) for r in range(3)]), b)
    with pytest.raises(ValueError, match="does not split"):
        dp.shard(b, 0, 4)


def test_serial_reference_accumulation_equals_big_batch() -> None:
    batches = [dp.make_tokens(s, 8) for s in range(2)]
    one = dp.serial_reference(3, batches)
    four = dp.serial_reference(3, batches, accumulate=4)
    for k, v in one.params.items():
        assert torch.allclose(v, four.params[k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("numel,world", [(10, 3), (2, 4), (0, 2), (7, 1), (1000, 7)])
def test_shard_bounds_match_tensor_split(numel: int, world: int) -> None:
    sizes = [len(c) for c in torch.tensor_split(torch.arange(numel), world)]
    got = [shard_bounds(numel, world, r) for r in range(world)]
    assert [e - s for s, e in got] == sizes
    assert got[0][0] == 0 and got[-1][1] == numel
    with pytest.raises(ValueError):
        shard_bounds(numel, world, world)
