"""Lab 09 checks: the solution's ZeRO-1 passes on real processes; an unsharded optimizer, a
replicated one that reports half its state, ZeRO-1 that treats a missing gradient as zero and
labsim's own reference fail, naming the rule; the formula checks accept the formulas and
reject near misses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labsim.checks import CheckFailed
from labsim.checks import zero as z
from labsim.course.notebook import as_shown
from labsim.parallel.zero import ShardedOptimizer

from .solution_cells import exercises

pytestmark = pytest.mark.multiprocess
S = exercises("09_zero_fsdp")


class Unsharded:
    """Each rank steps on its own gradients with the whole state: not data parallel."""

    def __init__(self, params, optimizer_cls, **kwargs):  # type: ignore[no-untyped-def]
        self.opt = optimizer_cls(params, **kwargs)

    def zero_grad(self):  # type: ignore[no-untyped-def]
        self.opt.zero_grad()

    def step(self):  # type: ignore[no-untyped-def]
        self.opt.step()


class Replicated(Unsharded):
    """Right numbers (all-reduce, the whole optimizer on every rank), no sharding."""

    @torch.no_grad()
    def step(self):  # type: ignore[no-untyped-def]
        for g in self.opt.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
        self.opt.step()


class NoneAsZero(S["ShardedOptimizer"]):  # type: ignore[misc,valid-type]
    """The solution, with a missing gradient taken as zero (a flat-shard shortcut)."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        super().step()


def test_the_solution_passes_and_unsharded_fails(capsys: pytest.CaptureFixture[str]) -> None:
    z.sharded_optimizer(S["ShardedOptimizer"])
    assert "PASS sharded_optimizer: 9/9" in as_shown(capsys.readouterr().out)
    with pytest.raises(CheckFailed, match="FAIL sharded_optimizer"):
        z.sharded_optimizer(Unsharded)


def test_a_missing_gradient_taken_as_zero_fails() -> None:
    with pytest.raises(CheckFailed, match="FAIL sharded_optimizer"):
        z.sharded_optimizer(NoneAsZero)


@pytest.mark.parametrize(("cls", "rule"), [
    (Replicated, "reduce-scatters the gradients"),
    (ShardedOptimizer, "calls labsim's own reference"),
], ids=["replicated", "reference"])
def test_shortcuts_of_zero1_score_zero(cls, rule: str) -> None:
    with pytest.raises(CheckFailed, match=rule) as info:
        z.sharded_optimizer(cls)
    assert "0/9 cases passed" in str(info.value)


def test_formula_checks(capsys: pytest.CaptureFixture[str]) -> None:
    z.zero_memory(S["zero_memory"])
    z.comm_volume(S["comm_volume"])
    assert as_shown(capsys.readouterr().out).count("PASS") == 2
    memory = S["zero_memory"]
    with pytest.raises(CheckFailed):  # ZeRO-2 sharding the weights too
        z.zero_memory(lambda p, dp, s: memory(p, dp, 3 if s == 2 else s))
    with pytest.raises(CheckFailed):  # forgetting the (N-1)/N
        z.comm_volume(lambda p, n, s, k=1: (3 if s == 3 else 2) * p)
    with pytest.raises(CheckFailed, match="micro-batch"):  # accumulation ignored (2 / 3 Psi)
        z.comm_volume(lambda p, n, s, k=1: (3 if s == 3 else 2) * (n - 1) / n * p)
