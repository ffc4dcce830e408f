"""Checks of the integer-only int8 layer (Jacob et al. 2018, "Quantization and Training of
Neural Networks for Efficient Integer-Arithmetic-Only Inference", section 2.2): the real
rescale as a fixed-point multiplier and shift, and the requantization of an int32
accumulator to int8 output codes without floating point.

The oracle of ``requantize`` is the reference's exact integer arithmetic: ``round(acc * M) +
z`` with ``M = m0 * 2**-(31 + shift)`` represented exactly, rounded once, half away from
zero, then clamped.  Truncating shifts, round-half-to-even and float arithmetic are each one
code off somewhere in the cases (exact halves, int32 extremes); the recorder must see no
floating-point tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from labsim.checks._core import Case, Outcome, Spec
from labsim.checks.quantization import reference as ref

_R = "labsim.checks.quantization.reference"
FORBID = (f"{_R}:quantize_multiplier", f"{_R}:requantize")


def _multiplier_cases() -> list[Case]:
    reals = [("a half: m0 = 2**30, shift 0", 0.5), ("three quarters", 0.75),
             ("just below 1", 0.999999999), ("small: 1e-6", 1e-6),
             ("a typical layer: 0.02 * 0.004 / 0.05", 0.02 * 0.004 / 0.05),
             ("a mantissa that rounds up to 1 (renormalised)", 1 - 2**-33)]
    return [Case(name, (m,), expected=ref.quantize_multiplier(m)) for name, m in reals]


def _same_pair(got: Any, expected: tuple[int, int]) -> str | None:
    if (not isinstance(got, (tuple, list)) or len(got) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in got)):
        return f"expected a pair of Python ints (m0, shift), got {got!r}"
    m0, shift = got
    if not 2**30 <= m0 < 2**31:
        return f"m0 = {m0} is not in [2**30, 2**31): normalise M0 into [0.5, 1)"
    if (m0, shift) != tuple(expected):
        return f"(m0, shift) = {tuple(got)} instead of {tuple(expected)}"
    return None


quantize_multiplier = Spec("quantize_multiplier", _multiplier_cases, compare=_same_pair,
                           forbid=FORBID, ops=False)
"""``fn(real) -> (m0, shift)``: ``real`` in (0, 1) as ``m0 * 2**-(31 + shift)`` with ``m0``
an int in [2**30, 2**31), the mantissa rounded to nearest."""


def _acc(seed: int, n: int, lo: int, hi: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(torch.int32)


def _requantize_cases() -> list[Case]:
    specs = [("typical accumulators, zero point 0", _acc(1, 64, -40000, 40000), 3e-3, 0),
             ("asymmetric output: zero point -128", _acc(2, 64, 0, 80000), 1.5e-3, -128),
             ("outputs beyond int8 clamp to -128 and 127", _acc(3, 64, -10**7, 10**7),
              2e-4, 5),
             ("accumulators near the int32 limits", torch.tensor(
                 [2**31 - 1, -2**31, 2**30, -2**30, 0, 1, -1], dtype=torch.int32), 5e-8, 0),
             ("exact halves round away from zero", torch.tensor(
                 [1, 3, 5, -1, -3, -5, 7, -7], dtype=torch.int32), 0.5, 0),
             ("tiny multiplier (a large shift)", _acc(4, 32, -2**31, 2**31 - 1), 1e-9, 17)]
    cases = []
    for name, acc, real, zp in specs:
        m0, shift = ref.quantize_multiplier(real)
        cases.append(Case(name, (acc, m0, shift, zp),
                          expected=ref.requantize(acc, m0, shift, zp)))
    return cases


def _same_codes(got: Any, expected: torch.Tensor) -> str | None:
    if not isinstance(got, torch.Tensor) or got.dtype != torch.int8:
        kind = got.dtype if isinstance(got, torch.Tensor) else type(got).__name__
        return f"expected an int8 tensor, got {kind}"
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)} instead of {tuple(expected.shape)}"
    diff = (got.long() - expected.long()).abs()
    if got.numel() and int(diff.max()):
        i = int(diff.argmax())
        hint = (" (round once, half away from zero, after the whole product)"
                if int(diff.max()) == 1 else "")
        return (f"code {int(got.reshape(-1)[i])} where round(acc * M) + z gives "
                f"{int(expected.reshape(-1)[i])}{hint}")
    return None


def _no_float(case: Case, out: Outcome) -> str | None:
    made = sorted(set(out.observed.get("float_dtypes", [])))
    if made:
        return (f"it creates {', '.join(made)} tensors; integer-only inference rescales with "
                "an int64 product and a shift")
    return None


requantize = Spec("requantize", _requantize_cases, compare=_same_codes,
                  rules=(_no_float,), forbid=FORBID, torch_only=True)
"""``fn(acc, m0, shift, zero_point) -> int8``: the output codes of an int32 accumulator,
``clamp(round(acc * m0 * 2**-(31 + shift)) + zero_point, -128, 127)`` rounded half away from
zero, without floating point."""
