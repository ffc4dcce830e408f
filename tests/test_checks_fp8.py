"""Lab 02's FP8 matmul: the solution and honest variants pass; every way of skipping the idea
fails.

The idea is to store both operands in E4M3 with a scale per tensor or per block and multiply
what comes back.  The honest variants: dividing by ``amax / 448`` instead of multiplying by
``448 / amax`` (ties round differently), ``torch._scaled_mm`` on the FP8 tensors, and the
product accumulated block by block along k with the scales applied to each partial product
(DeepSeek-V3's promotion).  The shortcuts: fp32 or bf16 matmuls (with an E4M3 tensor made for
show), no scaling, E5M2 instead of E4M3, one scale where blocks were asked for, the
reference itself, numpy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from labsim import checks as check
from labsim.checks import CheckFailed
from labsim.course.notebook import as_shown
from labsim.experiments import fp8 as F

from .solution_cells import exercises

S2 = exercises("02_mixed_precision")
PASS = "PASS fp8_matmul: 7/7 cases passed"
E4M3 = torch.float8_e4m3fn


def _stored(x: torch.Tensor, rows: int | None, cols: int | None, *, divide: bool = False,
            dtype: torch.dtype = E4M3, top: float = 448.0) -> torch.Tensor:
    m, n = x.shape
    r, c = rows or m, cols or n
    t = x.float().reshape(m // r, r, n // c, c)
    amax = t.abs().amax(dim=(1, 3), keepdim=True)
    if divide:
        s = torch.where(amax > 0, amax / top, torch.ones_like(amax))
        return ((t / s).to(dtype).float() * s).reshape(m, n)
    s = torch.where(amax > 0, top / amax, torch.ones_like(amax))
    return ((t * s).to(dtype).float() / s).reshape(m, n)


def divided(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    return _stored(a, 1 if block else None, block, divide=True) @ _stored(
        b, block, block, divide=True)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    if block:
        return divided(a, b, block)
    sa = 448.0 / a.abs().max() if a.abs().max() > 0 else torch.tensor(1.0)
    sb = 448.0 / b.abs().max() if b.abs().max() > 0 else torch.tensor(1.0)
    qa = (a * sa).to(E4M3)
    qb = (b * sb).to(E4M3).t().contiguous().t()  # column-major, as _scaled_mm wants
    return torch._scaled_mm(qa, qb, scale_a=(1 / sa).float().reshape(()),
                            scale_b=(1 / sb).float().reshape(()), out_dtype=torch.float32)


def promoted(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Partial products of k-blocks in FP8 values, scaled and summed in fp32."""
    k = a.shape[1]
    step = block or k
    out = torch.zeros(a.shape[0], b.shape[1])
    for j in range(0, k, step):
        out += _stored(a[:, j:j + step], 1 if block else None, None) @ _stored(
            b[j:j + step], None, block)
    return out if block else _stored(a, None, None) @ _stored(b, None, None)


@pytest.mark.parametrize("fn", [S2["fp8_matmul"], divided, scaled_mm, promoted],
                         ids=["solution", "divided", "scaled_mm", "promoted"])
def test_fp8_matmuls_pass(fn: Callable, capsys: pytest.CaptureFixture) -> None:
    check.fp8.fp8_matmul(fn)
    assert as_shown(capsys.readouterr().out).strip() == PASS


def fp32(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    torch.zeros(1).to(E4M3)
    return a @ b


def bf16(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    torch.zeros(1).to(E4M3)
    return (a.bfloat16() @ b.bfloat16()).float()


def unscaled(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    return a.to(E4M3).float() @ b.to(E4M3).float()


def e5m2(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    torch.zeros(1).to(E4M3)
    return _stored(a, 1 if block else None, block, dtype=torch.float8_e5m2, top=57344.0) @ \
        _stored(b, block, block, dtype=torch.float8_e5m2, top=57344.0)


def one_scale(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    return divided(a, b, None)


def reference(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    return F.fp8_matmul(a, b, block)


def in_a_thread(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """The honest product, computed on a thread the function starts."""
    out: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: out.append(divided(a, b, block)))
    worker.start()
    worker.join()
    return out[0]


def in_numpy(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """E4M3 rounding emulated in numpy (3 mantissa bits), no FP8 tensor made."""
    def rnd(x: np.ndarray) -> np.ndarray:
        e = np.floor(np.log2(np.maximum(np.abs(x), 2.0**-9)))
        step = 2.0 ** (np.maximum(e, -6) - 3)
        return np.round(x / step) * step

    def stored(x: np.ndarray) -> np.ndarray:
        amax = np.abs(x).max()
        s = 448.0 / amax if amax > 0 else 1.0
        return rnd(x * s) / s
    return torch.from_numpy(stored(a.numpy()) @ stored(b.numpy())).float()


@pytest.mark.parametrize("fn, words", [
    (fp32, "relative error"), (bf16, "relative error"), (unscaled, "relative error"),
    (e5m2, "relative error"), (one_scale, "relative error"),
    (reference, "labsim.experiments.fp8"), (in_numpy, "out of torch"),
    (in_a_thread, "started threads"),
], ids=["fp32", "bf16", "unscaled", "e5m2", "one-scale", "reference", "numpy", "thread"])
def test_shortcuts_fail(fn: Callable, words: str) -> None:
    with pytest.raises(CheckFailed) as err:
        check.fp8.fp8_matmul(fn)
    assert words in str(err.value)


def test_outliers_need_blocks_and_a_jump_clips_delayed_scaling() -> None:
    rows = {r.magnitude: r for r in F.outlier_errors(F.fp8_matmul)}
    assert rows[1.0].per_tensor == pytest.approx(rows[1.0].per_block, rel=0.1)
    assert rows[1.0].bf16 < rows[1.0].per_tensor / 10  # three mantissa bits against eight
    assert rows[1e5].per_tensor > 10 * rows[1.0].per_tensor  # the ordinary values underflow
    assert rows[1e5].per_block < rows[1e5].per_tensor / 3
    trace = F.scaling_trace()
    jump = next(s for s in trace if s.amax > trace[0].amax)
    assert jump.delayed_saturated > 0.5 and jump.current_saturated == 0.0
    assert all(s.delayed_saturated == 0 for s in trace if s is not jump)
    assert max(s.current_error for s in trace) < 0.05 < jump.delayed_error


def test_published_fp8_speed_ups_are_below_two() -> None:
    rows = F.fp8_steps()
    assert [r.gpus for r in rows] == [16, 128, 512]
    for r in rows:
        assert 1.2 < r.measured_bf16_s / r.measured_fp8_s < 1.55
        assert r.measured_bf16_s / r.measured_fp8_s < r.labsim_bf16_s / r.labsim_fp8_s < 2


def test_a_matmul_that_makes_no_e4m3_tensor_breaks_the_rule() -> None:
    """A product whose numbers are right but that never stores an operand in E4M3 (its
    rounding written out in torch arithmetic) is refused by the rule."""
    def by_hand(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
        return _hand(a, block, True) @ _hand(b, block, False)

    with pytest.raises(CheckFailed) as err:
        check.fp8.fp8_matmul(by_hand)
    assert "float8_e4m3fn" in str(err.value)


def _hand(x: torch.Tensor, block: int | None, left: bool) -> torch.Tensor:
    """E4M3 rounding written with torch arithmetic (no FP8 dtype)."""
    m, n = x.shape
    r, c = ((1 if left else block) or m, block or n) if block else (m, n)
    t = x.float().reshape(m // r, r, n // c, c)
    amax = t.abs().amax(dim=(1, 3), keepdim=True)
    s = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    y = t * s
    e = torch.floor(torch.log2(y.abs().clamp_min(2.0**-9))).clamp_min(-6)
    step = 2.0 ** (e - 3)
    return (torch.round(y / step) * step / s).reshape(m, n)
