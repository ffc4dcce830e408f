"""Counting the collectives of tensor-parallel layers (labsim.experiments.tensor_parallel): the
learner-shaped splits, labsim's and DTensor's all equal one process and agree with PyTorch's
CommDebugMode; Megatron's two all-reduces each way per layer, or gathers and scatters."""

from __future__ import annotations

import pytest

from labsim.experiments.tensor_parallel import comm_count_worker
from labsim.lab import launch

from .test_checks_tensor_parallel import CE, attention, mlp, sp_block

pytestmark = pytest.mark.multiprocess

EXPECTED = {  # setup: (forward, backward) collectives per rank
    "yours: attention + MLP": ({"all_reduce": 2}, {"all_reduce": 2}),
    "labsim ParallelBlock, sequence parallel": ({"all_gather": 2, "reduce_scatter": 2},
                                                {"all_gather": 2, "reduce_scatter": 2}),
    "yours: sequence-parallel MLP half": ({"all_gather": 1, "reduce_scatter": 1},
                                          {"all_gather": 1, "reduce_scatter": 1}),
    "DTensor Colwise/Rowwise": ({"all_reduce": 2}, {"all_reduce": 2}),
    "DTensor SequenceParallel": ({"all_gather": 2, "reduce_scatter": 2},
                                 {"all_gather": 2, "reduce_scatter": 2}),
    "yours: vocab-parallel cross-entropy": ({"all_reduce": 3}, {"all_reduce": 1}),
    "DTensor loss_parallel": ({"all_reduce": 3}, {"all_reduce": 1}),
}


def test_every_split_counts_like_megatron_and_commdebugmode_agrees() -> None:
    for rows in launch(comm_count_worker, 2, args=(attention, mlp, sp_block, CE),
                       timeout_s=180):
        assert [r.setup for r in rows] == list(EXPECTED)
        for r in rows:
            assert (r.forward, r.backward) == EXPECTED[r.setup], r.setup
            both = {k: r.forward.get(k, 0) + r.backward.get(k, 0)
                    for k in {*r.forward, *r.backward}}
            assert r.comm_debug_mode == both, r.setup
            assert r.max_error < 1e-12, r.setup
