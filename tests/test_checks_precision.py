"""Lab 02's compensated 16-bit weight: the solution and honest variants pass; every way of
skipping the idea fails.

The idea is to carry what rounding took from each update into the next one, in 16 bits.  The
shortcuts: a plain 16-bit ``+`` (loses the updates), an fp32 master copy in disguise (the
thing the exercise does without), Python floats, a history of every update, a second and a
third buffer, a compensation applied only when the weight is read (Neumaier's, whose own sum
stalls in 16 bits), and stochastic rounding (exact only on average).
"""

from __future__ import annotations

import pytest
import torch

from labsim import checks as check
from labsim.checks import CheckFailed
from labsim.checks.precision import kahan_bound
from labsim.course.notebook import as_shown

from .solution_cells import exercises

S2 = exercises("02_mixed_precision")
PASS = "PASS compensated_weight: 7/7 cases passed"


class KahanInPlace:
    """Kahan's update written in place, as torchdistx's AnyPrecisionAdamW does."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.compensation = torch.zeros_like(weight)

    def add_(self, update: torch.Tensor) -> None:
        self.compensation.add_(update)
        before = self.weight.clone()
        self.weight.add_(self.compensation)
        self.compensation.add_(before.sub_(self.weight))


class TwoSum:
    """Knuth's TwoSum, exact whatever the magnitudes, with the error carried forward."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.err = weight.clone(), torch.zeros_like(weight)

    def add_(self, update: torch.Tensor) -> None:
        y = update + self.err
        s = self.weight + y
        y_part = s - self.weight
        w_part = s - y_part
        self.err = (self.weight - w_part) + (y - y_part)
        self.weight = s


class Fp16Buffer:
    """A bf16 weight with its remainder kept in fp16: still 16 bits, 4 bytes per parameter."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.clone()
        self.lost = torch.zeros(weight.shape, dtype=torch.float16)

    def add_(self, update: torch.Tensor) -> None:
        owed = update + self.lost.to(update.dtype)
        new = self.weight + owed
        self.lost = (owed - (new - self.weight)).to(torch.float16)
        self.weight = new


@pytest.mark.parametrize("cls", [S2["CompensatedWeight"], KahanInPlace, TwoSum, Fp16Buffer],
                         ids=["solution", "in-place", "two-sum", "fp16-buffer"])
def test_compensated_weights_pass(cls, capsys) -> None:  # noqa: ANN001
    check.precision.compensated_weight(cls)
    assert as_shown(capsys.readouterr().out).strip() == PASS


class Plain:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.clone()

    def add_(self, update: torch.Tensor) -> None:
        self.weight = self.weight + update


class Master:
    def __init__(self, weight: torch.Tensor) -> None:
        self.master, self.weight = weight.float(), weight.clone()

    def add_(self, update: torch.Tensor) -> None:
        self.master += update.float()
        self.weight = self.master.to(self.weight.dtype)


class MasterInFloat64:
    def __init__(self, weight: torch.Tensor) -> None:
        self.master, self.weight = weight.double(), weight.clone()

    def add_(self, update: torch.Tensor) -> None:
        self.master += update
        self.weight = self.master.to(self.weight.dtype)


class PythonFloats:
    def __init__(self, weight: torch.Tensor) -> None:
        self.values, self.weight = weight.tolist(), weight.clone()

    def add_(self, update: torch.Tensor) -> None:
        self.values = [a + b for a, b in zip(self.values, update.tolist())]
        self.weight = torch.tensor(self.values, dtype=self.weight.dtype)


class ItemByItem:
    """A Python float per element, read with ``.item()``: no ``tolist``, still 64 bits."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.values = [w.item() for w in weight.reshape(-1)]
        self.weight = weight.clone()

    def add_(self, update: torch.Tensor) -> None:
        self.values = [a + u.item() for a, u in zip(self.values, update.reshape(-1))]
        self.weight = torch.tensor(self.values, dtype=self.weight.dtype).reshape(
            self.weight.shape)


class History:
    """Keeps every update and sums them when the weight is read."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.start, self.updates = weight.clone(), []

    def add_(self, update: torch.Tensor) -> None:
        self.updates.append(update.clone())

    @property
    def weight(self) -> torch.Tensor:
        return self.start + torch.stack(self.updates).sum(0) if self.updates else self.start


class ReadsTheBufferLater:
    """Keeps a reference to the update buffer instead of using it now."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.pending = weight.clone(), []

    def add_(self, update: torch.Tensor) -> None:
        self.pending.append(update)
        if len(self.pending) == 4:
            for u in self.pending:
                self.weight = self.weight + u
            self.pending = []


class ThreeBuffers:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.lost = weight.clone(), torch.zeros_like(weight)
        self.spare = torch.zeros_like(weight)

    def add_(self, update: torch.Tensor) -> None:
        owed = update + self.lost
        new = self.weight + owed
        self.lost = owed - (new - self.weight)
        self.spare = self.lost.clone()
        self.weight = new


class Neumaier:
    """Compensation kept aside and added only when the weight is read: the compensation is a
    plain 16-bit running sum itself, and stalls."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.sum, self.comp = weight.clone(), torch.zeros_like(weight)

    def add_(self, update: torch.Tensor) -> None:
        total = self.sum + update
        big = torch.where(self.sum.abs() >= update.abs(), self.sum, update)
        small = torch.where(self.sum.abs() >= update.abs(), update, self.sum)
        self.comp = self.comp + ((big - total) + small)
        self.sum = total

    @property
    def weight(self) -> torch.Tensor:
        return self.sum + self.comp


class StochasticRounding:
    """Round each sum up or down at random in proportion to what was lost (in 16 bits)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.clone()
        self.gen = torch.Generator().manual_seed(0)

    def add_(self, update: torch.Tensor) -> None:
        total = self.weight + update
        lost = update - (total - self.weight)
        up = torch.nextafter(total, torch.full_like(total, float("inf")))
        down = torch.nextafter(total, torch.full_like(total, float("-inf")))
        step = torch.where(lost > 0, up - total, total - down)
        chance = lost.abs() / step.abs()
        draw = torch.rand(total.shape, generator=self.gen, dtype=total.dtype)
        self.weight = torch.where(draw < chance, torch.where(lost > 0, up, down), total)


class WrongDtype:
    """Returns the weight in fp32 although it keeps its state in 16 bits."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.inner = S2["CompensatedWeight"](weight)

    def add_(self, update: torch.Tensor) -> None:
        self.inner.add_(update)

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight.float()


@pytest.mark.parametrize(("cls", "why"), [
    (Plain, "a plain 16-bit \\+= ends at"),
    (Master, "made float32 tensors"),
    (MasterInFloat64, "made float64 tensors"),
    (PythonFloats, "moved tensor data out of torch"),
    (ItemByItem, "Python numbers"),
    (History, "one 16-bit buffer of its size"),
    (ReadsTheBufferLater, "exact sum"),
    (ThreeBuffers, "one 16-bit buffer of its size"),
    (Neumaier, "exact sum"),
    (StochasticRounding, "exact sum"),
    (WrongDtype, "made float32 tensors"),
], ids=["plain", "fp32-master", "fp64-master", "tolist", "item", "history", "buffer-later",
        "three-buffers", "neumaier", "stochastic-rounding", "fp32-weight"])
def test_skipping_the_compensation_fails(cls, why: str) -> None:  # noqa: ANN001
    with pytest.raises(CheckFailed, match=why):
        check.precision.compensated_weight(cls)


def test_the_plain_sum_breaks_the_bound_the_compensated_sum_keeps() -> None:
    """The bound the check holds is Kahan's: compensated summation stays inside it on the
    lab's running sum, plain summation does not."""
    n = 600
    step = torch.tensor(0.01, dtype=torch.bfloat16)
    exact = float(step.double()) * n
    bound = float(kahan_bound(torch.tensor(exact, dtype=torch.float64), n + 1, torch.bfloat16))
    plain = torch.zeros((), dtype=torch.bfloat16)
    weight, lost = torch.zeros((), dtype=torch.bfloat16), torch.zeros((), dtype=torch.bfloat16)
    for _ in range(n):
        plain = plain + step
        owed = step + lost
        new = weight + owed
        lost, weight = owed - (new - weight), new
    assert abs(float(weight) - exact) <= bound < abs(float(plain) - exact)
