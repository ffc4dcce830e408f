"""Lab 09's ZeRO-3 check: the solution's layer passes on real processes; the cheapest cheats
fail on the rule they break, scoring nothing -- the full weight kept (replicated data
parallelism in disguise), an all-reduce in place of the reduce-scatter, one gather in forward
with the weight saved for backward (2 Psi of traffic, but the whole layer held), labsim's own
``Zero3Linear`` -- and the stub is reported as not done."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labsim.checks import CheckFailed, ExerciseNotDone
from labsim.checks.zero import zero3
from labsim.checks.zero.zero3 import step_traffic_bytes, zero3_linear
from labsim.course.notebook import as_shown
from labsim.parallel.zero import Zero3Linear

from .solution_cells import PREAMBLE, exercise_sources, exercises

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
S = exercises("09_zero_fsdp")
SOURCE = next(s for s in exercise_sources("09_zero_fsdp") if "class Zero3Linear" in s)
CASES = len(zero3._cases())


def _variant(*edits: tuple[str, str]) -> type:
    """The solution cell with each (old, new) of ``edits`` replaced, compiled in a fresh
    namespace as a learner's cell is."""
    src = SOURCE
    for old, new in edits:
        assert old in src, old
        src = src.replace(old, new)
    scope: dict = {"__name__": "solution_variant"}
    exec(compile(PREAMBLE + src, "<variant>", "exec"), scope)  # noqa: S102
    return scope["Zero3Linear"]


class KeepFull(nn.Module):
    """Replicated data parallelism in disguise: the whole layer, its gradients averaged."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        for p in linear.parameters():
            p.register_hook(lambda g: _mean(g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _mean(g: torch.Tensor) -> torch.Tensor:
    g = g.clone()
    dist.all_reduce(g)
    return g / dist.get_world_size()


ALL_REDUCE = _variant(("""        mine = torch.empty_like(shard)
        dist.reduce_scatter_tensor(mine, padded)""", """        dist.all_reduce(padded)
        mine = padded.view(world, -1)[dist.get_rank()].clone()"""))
SAVE_FULL = _variant(  # one gather: 2 Psi of traffic, the whole weight held until backward
    ("ctx.save_for_backward(x, shard)", "ctx.save_for_backward(x, shard, weight)"),
    ("""        x, shard = ctx.saved_tensors
        out_features, in_features = ctx.features
        weight, _ = gather_layer(shard, out_features, in_features)""",
     """        x, shard, weight = ctx.saved_tensors
        out_features, in_features = ctx.features"""))
SUM_NOT_MEAN = _variant(("mine / world, None, None", "mine, None, None"))


class CallsReference(nn.Module):
    """labsim's own layer inside a learner's class."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.inner = Zero3Linear(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Stub(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        raise NotImplementedError("write Zero3Linear")


def test_the_solution_passes(capsys: pytest.CaptureFixture[str]) -> None:
    zero3_linear(S["Zero3Linear"])
    assert f"PASS zero3_linear: {CASES}/{CASES}" in as_shown(capsys.readouterr().out)


def test_the_traffic_is_three_psi() -> None:
    """2 ranks, float64: (512 + 1024 + 160) padded elements gathered twice and
    reduce-scattered, half of each sent per rank."""
    assert step_traffic_bytes() == 3 * 0.5 * (512 + 1024 + 160) * 8


@pytest.mark.parametrize(("cls", "rule"), [
    (KeepFull, "keeps the nn.Linear it was given"),
    (ALL_REDUCE, "allreduce_ of .* bytes in backward"),
    (SAVE_FULL, "from forward to backward"),
    (CallsReference, "calls labsim's own reference"),
    (Zero3Linear, "calls labsim's own reference"),
], ids=["keep_full", "all_reduce", "save_full_weight", "wraps_reference", "reference"])
def test_shortcuts_of_zero3_score_zero(cls: type, rule: str) -> None:
    with pytest.raises(CheckFailed, match=rule) as info:
        zero3_linear(cls)
    assert f"0/{CASES} cases passed" in str(info.value)


def test_the_stub_is_not_done() -> None:
    with pytest.raises(ExerciseNotDone):
        zero3_linear(Stub)


def test_a_sum_in_place_of_the_mean_fails_on_values() -> None:
    """The gradient reduce-scattered but not divided by N: the rules hold, the values not."""
    with pytest.raises(CheckFailed, match="FAIL zero3_linear") as info:
        zero3_linear(SUM_NOT_MEAN)
    assert "breaks a rule" not in str(info.value)

