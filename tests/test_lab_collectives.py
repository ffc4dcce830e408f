"""The reference ring all-reduce equals dist.all_reduce on awkward sizes (one launch)."""

from __future__ import annotations

import torch

from labsim.lab.collectives import check_worker, rank_tensor, ring_allreduce
from labsim.lab.launcher import launch


def both(rank, world):
    sizes = [1, 3, 4, 5, 97, 10_000]
    dtypes = [torch.float64] * 5 + [torch.int64]
    return check_worker(rank, world, ring_allreduce, sizes, dtypes)


def test_ring_equals_all_reduce_on_sizes_the_world_does_not_divide():
    result = launch(both, 3)
    for per_rank in result:
        for case in per_rank:
            assert torch.allclose(case["got"], case["expected"], rtol=1e-12, atol=1e-12), case


def test_rank_tensors_differ_and_are_deterministic():
    assert torch.equal(rank_tensor(0, 5), rank_tensor(0, 5))
    assert not torch.equal(rank_tensor(0, 5), rank_tensor(1, 5))
    assert rank_tensor(2, 3, torch.int64).dtype == torch.int64
