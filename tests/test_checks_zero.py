"""Lab 09 checks: ZeroAdam passes, plain (unsharded) Adam fails on real processes; the
formula checks accept the formulas and reject near misses."""

from __future__ import annotations

import pytest
import torch

from labsim.checks import CheckFailed
from labsim.checks import zero as z
from labsim.parallel.zero import ZeroAdam

pytestmark = pytest.mark.multiprocess


class UnshardedAdam(torch.optim.Adam):
    """Each rank steps on its own gradients with the whole state: not data parallel."""

    def __init__(self, params, lr):  # type: ignore[no-untyped-def]
        super().__init__(params, lr=lr)

    def state_tensors(self):  # type: ignore[no-untyped-def]
        return [v for s in self.state.values() for k, v in s.items() if k != "step"]


def test_zero_adam_passes_and_unsharded_fails(capsys: pytest.CaptureFixture[str]) -> None:
    z.sharded_adam(ZeroAdam)
    assert "PASS sharded_adam: 6/6" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="FAIL sharded_adam"):
        z.sharded_adam(UnshardedAdam)


def test_formula_checks(capsys: pytest.CaptureFixture[str]) -> None:
    def memory(p: float, dp: int, s: int) -> float:
        return (2 * p / (dp if s >= 3 else 1) + 2 * p / (dp if s >= 2 else 1)
                + 12 * p / (dp if s >= 1 else 1))

    z.zero_memory(memory)
    z.comm_volume(lambda p, n, s: (3 if s == 3 else 2) * (n - 1) / n * p)
    assert capsys.readouterr().out.count("PASS") == 2
    with pytest.raises(CheckFailed):  # ZeRO-2 sharding the weights too
        z.zero_memory(lambda p, dp, s: memory(p, dp, 3 if s == 2 else s))
    with pytest.raises(CheckFailed):  # forgetting the (N-1)/N
        z.comm_volume(lambda p, n, s: (3 if s == 3 else 2) * p)
