"""Check for lab 02's FP8 exercise: a matmul whose operands are stored in E4M3 with scales, per
tensor or per block (``labsim.experiments.fp8``).

The oracle is the reference quantization run in the grader's process: for every case it
gives the exact product (fp64) and the reference FP8 product.  The learner's product must sit
near the reference one on the scale of FP8's own error: ``|got - ref| <= 0.35 |ref - exact|``
(Frobenius norms).  Rounding ties that a division by ``amax / 448`` breaks differently from a
multiplication by ``448 / amax``, or fp32 sums taken in another order, move the product by far
less than that; an fp32 or bf16 matmul (no FP8 at all), E5M2 instead of E4M3, no scaling, or
one scale where blocks were asked are as far from the reference as FP8's error or farther.  The
recorder must see E4M3 tensors made; the reference's functions are forbidden.
"""

from __future__ import annotations

from typing import Any

import torch

from labsim.checks._core import Case, Outcome, Spec
from labsim.experiments import fp8 as F

FORBID = ("labsim.experiments.fp8:fp8_matmul", "labsim.experiments.fp8:quantize")
NEAR = 0.35  # |got - ref| / |ref - exact| accepted


def _case(name: str, a: torch.Tensor, b: torch.Tensor, block: int | None) -> Case:
    exact = a.double() @ b.double()
    ref = F.fp8_matmul(a, b, block)
    return Case(name, (a, b, block), expected={"exact": exact, "reference": ref.double()},
                compare=_compare)


def _cases() -> list[Case]:
    gen = torch.Generator().manual_seed(8)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    outliers = randn(32, 256)
    outliers[:, [17, 200]] *= 1e5
    zero_tile = randn(16, 192)
    zero_tile[3, 64:128] = 0.0
    return [
        _case("per tensor: 16 x 64 @ 64 x 32, standard normal", randn(16, 64), randn(64, 32),
              None),
        _case("per tensor: values near 1e-6 (they underflow E4M3 unless scaled)",
              1e-6 * randn(8, 32), randn(32, 8), None),
        _case("per tensor: values near 1e4 (past E4M3's 448 unless scaled)",
              1e4 * randn(8, 32), 1e3 * randn(32, 16), None),
        _case("per tensor: b all zeros (a zero amax keeps a scale of 1)", randn(4, 16),
              torch.zeros(16, 8), None),
        _case("per 128-block: two outlier channels at 1e5 in 32 x 256 activations",
              outliers, randn(256, 128), 128),
        _case("per 64-block: a 1 x 64 tile of zeros among 16 x 192 activations", zero_tile,
              randn(192, 64), 64),
        _case("per 32-block: 24 x 96 @ 96 x 64, one scale per row tile and per block",
              3 * randn(24, 96), randn(96, 64) / 4, 32),
    ]


def _compare(got: Any, expected: dict) -> str | None:
    exact, ref = expected["exact"], expected["reference"]
    if not isinstance(got, torch.Tensor):
        return f"returned {type(got).__name__}; return the product as a torch tensor"
    if tuple(got.shape) != tuple(exact.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(exact.shape)} (m x n)"
    got = got.double()
    if not bool(torch.isfinite(got).all()):
        return "the product has inf or NaN: scale each group so its amax maps to 448"
    budget = float((ref - exact).norm())
    off = float((got - ref).norm())
    if budget == 0.0:
        return None if off == 0.0 else f"the exact product is zero; got |product| = {off:.3g}"
    if off > NEAR * budget:
        mine = float((got - exact).norm() / exact.norm())
        theirs = float((ref - exact).norm() / exact.norm())
        return (f"relative error against the exact product {mine:.3g}; stored in E4M3 with "
                f"the scaling asked for, it is {theirs:.3g} (and the product lands near that "
                "one: within 35 % of FP8's own error)")
    return None


def _made_e4m3(case: Case, out: Outcome) -> str | None:
    if "float8_e4m3fn" not in out.observed.get("float_dtypes", []):
        return ("it made no torch.float8_e4m3fn tensor: store each scaled operand with "
                ".to(torch.float8_e4m3fn) and read it back")
    return None


fp8_matmul = Spec("fp8_matmul", _cases, rules=(_made_e4m3,), forbid=FORBID, torch_only=True)
"""``fn(a, b, block)``: ``a @ b`` with both operands in E4M3, scaled per tensor (``block``
None) or per 1 x block tile of ``a`` and block x block block of ``b``, against the reference
quantization."""
