"""Bytes per rank of data-parallel Adam, ZeRO-1 and FSDP2 on 2 real processes, held and sent
(also checks that ``labsim.lab.memory`` counts a DTensor by its local shard and that the
recorder sees FSDP2's collectives)."""

from __future__ import annotations

import pytest

from labsim.experiments.zero import bytes_worker
from labsim.lab import launch

pytestmark = pytest.mark.multiprocess


def test_bytes_per_rank_follow_the_sharding() -> None:
    # depth 4: the greedy owners split the 8 tensors evenly, so ZeRO-1 pads nothing
    ranks = launch(bytes_worker, 2, kwargs={"width": 32, "depth": 4}, timeout_s=180)
    psi = ranks[0]["FSDP2"].numel
    for r in ranks:
        dp, z1, f2, bf = (r[k] for k in ("data-parallel Adam", "ZeRO-1", "FSDP2",
                                         "FSDP2, bf16 compute"))
        assert dp.params == z1.params == 4 * psi
        assert dp.grads == 4 * psi
        # FSDP2 shards dim 0 of each tensor: 32 rows and 32 biases split evenly over 2
        assert f2.params == 2 * psi and f2.grads == 2 * psi
        assert 4 * psi <= f2.optimizer <= 4 * psi + 64  # + scalar step counters
        # bytes a ring sends per rank, n = 2: all-reduce 2(n-1)/n = 1 of the tensor
        assert dp.sent_bytes == 4 * psi  # 4 bytes per parameter x 2(n-1)/n = 1
        assert z1.by_kind["reduce_scatter"] >= 4 * psi and z1.by_kind["all_gather"] >= 4 * psi
        assert z1.sent_bytes == pytest.approx(4 * psi, rel=0.01)  # 2 Psi: same as DP
        assert f2.sent_bytes == pytest.approx(6 * psi, rel=0.01)  # 3 Psi: 1.5 x DP
        assert bf.by_kind["all_gather"] == 2 * 2 * psi  # gathered twice, in bf16
        z3 = r["ZeRO-3 by hand"]
        assert (z3.params, z3.grads, z3.sent_bytes) == (f2.params, f2.grads, f2.sent_bytes)
    # ZeRO-1: the two ranks' moments make up Adam's state once, each about half
    moments = [r["ZeRO-1"].optimizer for r in ranks]
    assert sum(moments) == 8 * psi and max(moments) <= 0.6 * 8 * psi


class _ReplicatedAdam:
    """Not ZeRO-1: the whole Adam on every rank, gradients all-reduced."""

    def __init__(self, params, optimizer_cls, **kwargs):  # type: ignore[no-untyped-def]
        self.opt = optimizer_cls(params, **kwargs)

    def step(self):  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        for g in self.opt.param_groups:
            for p in g["params"]:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        self.opt.step()


def test_the_zero1_row_measures_the_class_it_is_given() -> None:
    """The learner's class, not labsim's: a replicated Adam shows the whole state on every
    rank and the all-reduce's traffic, however it names its state."""
    ranks = launch(bytes_worker, 2, kwargs={"width": 32, "depth": 4,
                                            "zero1_optimizer": _ReplicatedAdam}, timeout_s=180)
    psi = ranks[0]["FSDP2"].numel
    for r in ranks:
        z1 = r["ZeRO-1"]
        assert z1.optimizer >= 8 * psi and set(z1.by_kind) == {"all_reduce"}
        assert z1.sent_bytes == 4 * psi
