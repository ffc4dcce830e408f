"""Lab 09 checks: the solution's ZeRO-1 passes on real processes; unsharded Adam, replicated
Adam that reports half its state and ZeRO-1 that all-reduces fail, naming the rule; the
formula checks accept the formulas and reject near misses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labsim.checks import CheckFailed
from labsim.checks import zero as z
from labsim.parallel.zero import ZeroAdam

from .solution_cells import exercises

pytestmark = pytest.mark.multiprocess
S = exercises("09_zero_fsdp")


class UnshardedAdam(torch.optim.Adam):
    """Each rank steps on its own gradients with the whole state: not data parallel."""

    def __init__(self, params, lr):  # type: ignore[no-untyped-def]
        super().__init__(params, lr=lr)

    def state_tensors(self):  # type: ignore[no-untyped-def]
        return [v for s in self.state.values() for k, v in s.items() if k != "step"]


class ReplicatedAdam:
    """Right numbers (all-reduce, full Adam on every rank) and half the state reported."""

    def __init__(self, params, lr):  # type: ignore[no-untyped-def]
        self.params = list(params)
        self.adam = torch.optim.Adam(self.params, lr=lr)

    def zero_grad(self):  # type: ignore[no-untyped-def]
        self.adam.zero_grad()

    def state_tensors(self):  # type: ignore[no-untyped-def]
        states = [v for s in self.adam.state.values() for k, v in s.items() if k != "step"]
        return states[: len(states) // 2]

    @torch.no_grad()
    def step(self):  # type: ignore[no-untyped-def]
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        self.adam.step()


def test_the_solution_passes_and_unsharded_fails(capsys: pytest.CaptureFixture[str]) -> None:
    z.sharded_adam(S["ShardedAdam"])
    assert "PASS sharded_adam: 6/6" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="FAIL sharded_adam"):
        z.sharded_adam(UnshardedAdam)


@pytest.mark.parametrize(("cls", "rule"), [
    (ReplicatedAdam, "reduce-scatters the gradients"),
    (ZeroAdam, "calls labsim's own reference"),
], ids=["replicated", "reference"])
def test_shortcuts_of_zero1_score_zero(cls, rule: str) -> None:
    with pytest.raises(CheckFailed, match=rule) as info:
        z.sharded_adam(cls)
    assert "0/6 cases passed" in str(info.value)


def test_formula_checks(capsys: pytest.CaptureFixture[str]) -> None:
    z.zero_memory(S["zero_memory"])
    z.comm_volume(S["comm_volume"])
    assert capsys.readouterr().out.count("PASS") == 2
    memory = S["zero_memory"]
    with pytest.raises(CheckFailed):  # ZeRO-2 sharding the weights too
        z.zero_memory(lambda p, dp, s: memory(p, dp, 3 if s == 2 else s))
    with pytest.raises(CheckFailed):  # forgetting the (N-1)/N
        z.comm_volume(lambda p, n, s: (3 if s == 3 else 2) * p)
