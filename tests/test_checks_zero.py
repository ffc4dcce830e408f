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


class PiecewiseAllReduce:
    """Right numbers and half the state, but not ZeRO-1's traffic: every gradient all-reduced
    in pieces no larger than a shard, a token 2-element reduce-scatter, the owned parameters
    stepped and broadcast from their owners -- 2 Psi sent per step on 2 ranks, not Psi."""

    def __init__(self, params, optimizer_cls, **kwargs):  # type: ignore[no-untyped-def]
        world, rank = dist.get_world_size(), dist.get_rank()
        params = list(params)
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.owner, mine, i = {}, [], 0
        for g in groups:
            owned = []
            for p in g["params"]:
                self.owner[p] = i % world
                owned += [p] if i % world == rank else []
                i += 1
            if owned:
                mine.append({**g, "params": owned})
        self.params = [p for g in groups for p in g["params"]]
        self.opt = optimizer_cls(mine, **kwargs)

    def zero_grad(self):  # type: ignore[no-untyped-def]
        self.opt.zero_grad()

    @torch.no_grad()
    def step(self):  # type: ignore[no-untyped-def]
        world, rank = dist.get_world_size(), dist.get_rank()
        for p in self.params:
            if p.grad is not None:
                for piece in p.grad.view(-1).split(64):
                    dist.all_reduce(piece)
                p.grad /= world
                if self.owner[p] != rank:
                    p.grad = None
        token = torch.zeros(2, dtype=torch.float64)
        dist.reduce_scatter_tensor(torch.zeros(1, dtype=torch.float64), token)
        self.opt.step()
        for p in self.params:
            dist.broadcast(p.data, src=self.owner[p])


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
    (PiecewiseAllReduce, "reduce-scatters the gradients themselves"),
    (ShardedOptimizer, "calls labsim's own reference"),
], ids=["replicated", "piecewise-all-reduce", "reference"])
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


def test_a_step_is_priced_by_what_each_collective_sends() -> None:
    """ZeRO-1 on 2 ranks: a reduce-scatter of the gradients and an all-gather of the
    parameters send Psi; broadcasting each half from its owner costs the same; an all-reduce
    of every gradient plus those broadcasts costs 1.5 Psi and breaks the rule."""
    from labsim.checks._core import Case, plain_outcome

    psi = z.trainable_bytes()
    zero1 = [["c10d::_reduce_scatter_base_", psi // 2, psi, False, -1],
             ["c10d::_allgather_base_", psi, psi // 2, False, -1]]
    torch_zero = [zero1[0], ["c10d::broadcast_", psi // 2, 0, False, -1],
                  ["c10d::broadcast_", psi - psi // 2, 0, False, -1]]
    pieces = [["c10d::allreduce_", psi // 4, 0, False, -1]] * 4  # each under a shard
    wasteful = [*torch_zero, *pieces]
    assert z.sent_bytes(zero1, 2) == pytest.approx(psi)
    assert z.sent_bytes(torch_zero, 2) == pytest.approx(psi)
    assert z.sent_bytes(wasteful, 2) == pytest.approx(2 * psi)

    def verdict(messages):  # type: ignore[no-untyped-def]
        out = plain_outcome(None, {"steps": [[{"messages": messages, "grad_bytes": psi}]]})
        return z.reduce_scatter_rule(Case("c", (0, "x")), out)

    assert verdict(zero1) is None and verdict(torch_zero) is None
    assert "ZeRO-1 sends 2(N-1)/N of them" in verdict(wasteful)
