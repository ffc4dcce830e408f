"""FP8 on real tensors: a scaled FP8 matmul, what its scaling loses on outliers, delayed
against current scaling, and FP8 against BF16 steps beside published runs.

- ``fp8_matmul`` is the reference of lab 02's exercise: both operands of ``a @ b`` stored in
  E4M3 (``torch.float8_e4m3fn``, max 448) with fp32 scales, one per tensor (Transformer
  Engine's per-tensor recipes; Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
  arXiv:2209.05433) or one per block (DeepSeek-AI 2024, DeepSeek-V3, arXiv:2412.19437, section
  3.3.1: 1 x 128 tiles of activations, 128 x 128 blocks of weights), then multiplied in fp32.
- ``outlier_errors`` measures what storing activations with a few outlier channels (as LLM
  activations have: Dettmers et al. 2022, LLM.int8(), arXiv:2208.07339; Sun et al. 2024,
  "Massive Activations in Large Language Models", arXiv:2402.17762) does to the ordinary
  channels: in bf16, and in FP8 per tensor and per block, through any FP8 matmul.
- ``scaling_trace`` runs delayed scaling (the scale from the largest amax of the last
  ``history`` steps, Transformer Engine's ``DelayedScaling``) and current scaling (this
  tensor's own amax) over a sequence of tensors whose range jumps, and counts the values each
  saturates at 448.
- ``fp8_steps`` sets labsim's FP8 and BF16 step times beside the published runs that measured
  both on the same layout (``labsim.published``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import labsim
from labsim.published import runs

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: no inf, the top exponent is finite


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales that map each group's amax to 448; 1 for a group of zeros."""
    amax = amax.float()
    return torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))


def quantize(x: torch.Tensor, rows: int | None, cols: int | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D) in E4M3 with one fp32 scale per ``rows x cols`` block (None: the whole
    dimension), as (FP8 tensor, scales expanded to ``x``'s shape)."""
    m, n = x.shape
    r, c = rows or m, cols or n
    if m % r or n % c:
        raise ValueError(f"a {m} x {n} tensor does not split into {r} x {c} blocks")
    blocks = x.float().reshape(m // r, r, n // c, c)
    scale = _scale(blocks.abs().amax(dim=(1, 3), keepdim=True)).expand_as(blocks)
    q = (blocks * scale).to(E4M3)
    return q.reshape(m, n), scale.reshape(m, n)


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``a @ b`` with both operands stored in E4M3 and read back as ``q / scale``: one scale
    per tensor (``block=None``), or per 1 x ``block`` tile of ``a`` along k and ``block`` x
    ``block`` block of ``b`` (DeepSeek-V3); the product in fp32."""
    qa, sa = quantize(a, 1 if block else None, block)
    qb, sb = quantize(b, block, block)
    return (qa.float() / sa) @ (qb.float() / sb)


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """``|got - exact|_F / |exact|_F``."""
    exact = exact.double()
    return float((got.double() - exact).norm() / exact.norm())


def outlier_inputs(m: int = 64, k: int = 512, outliers: int = 2, magnitude: float = 100.0,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations (m x k, fp32) whose ``outliers`` channels are ``magnitude`` times the
    rest, and the mask of the ordinary channels."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen)
    cols = torch.randperm(k, generator=gen)[:outliers]
    a[:, cols] *= magnitude
    ordinary = torch.ones(k, dtype=torch.bool)
    ordinary[cols] = False
    return a, ordinary


@dataclass(frozen=True)
class ErrorRow:
    """The relative error the ordinary channels of ``outlier_inputs`` come back with, per way
    of storing them, at one outlier magnitude."""

    magnitude: float
    bf16: float
    per_tensor: float
    per_block: float

    def __str__(self) -> str:
        return (f"outliers x{self.magnitude:<8g} ordinary values' error: bf16 {self.bf16:.1e}"
                f" | fp8 per tensor {self.per_tensor:.1e} | fp8 per block {self.per_block:.1e}")


def outlier_errors(matmul: Callable[..., torch.Tensor],
                   magnitudes: Sequence[float] = (1.0, 1e2, 1e4, 1e5),
                   block: int = 128) -> list[ErrorRow]:
    """What FP8 storage does to the ordinary channels of activations with a few outliers:
    ``matmul(a, I)`` returns ``a`` as the matmul stored it (the identity is exact in E4M3),
    per tensor and per ``block``; beside a bf16 round trip.  Each error is relative, over the
    ordinary channels only (the outliers themselves keep FP8's relative precision)."""
    rows = []
    for mag in magnitudes:
        a, ordinary = outlier_inputs(magnitude=mag)
        eye = torch.eye(a.shape[1])
        stored = (a.bfloat16().float(), matmul(a, eye), matmul(a, eye, block))
        rows.append(ErrorRow(mag, *(relative_error(x[:, ordinary], a[:, ordinary])
                                    for x in stored)))
    return rows


@dataclass(frozen=True)
class ScalingStep:
    """One step of ``scaling_trace``: the tensor's amax, and per recipe the fraction of its
    values saturated at 448 and the relative error of its FP8 copy."""

    step: int
    amax: float
    delayed_saturated: float
    delayed_error: float
    current_saturated: float
    current_error: float

    def __str__(self) -> str:
        return (f"step {self.step:2d} amax {self.amax:7.2f} | delayed: "
                f"{self.delayed_saturated:6.1%} saturated, error {self.delayed_error:.3f} | "
                f"current: {self.current_saturated:6.1%} saturated, error {self.current_error:.3f}")


def scaling_trace(amaxes: Sequence[float] = (1, 1, 1, 1, 1, 1, 8, 8, 8, 8),
                  history: int = 4, size: int = 4096, seed: int = 0) -> list[ScalingStep]:
    """A gradient-like tensor per step, scaled to each ``amaxes`` value, cast to E4M3 by
    delayed scaling (the scale from the largest amax of the ``history`` steps before; 1 on
    the first) and by current scaling (its own amax): what each saturates and its error."""
    gen = torch.Generator().manual_seed(seed)
    seen: list[float] = []
    out = []
    for i, amax in enumerate(amaxes):
        x = torch.randn(size, generator=gen)
        x = x / x.abs().max() * amax
        rows = []
        for scale_amax in (max(seen[-history:]) if seen else 1.0, float(x.abs().max())):
            s = E4M3_MAX / scale_amax
            scaled = x * s
            saturated = float((scaled.abs() > E4M3_MAX).float().mean())
            q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() / s
            rows.append((saturated, relative_error(q, x)))
        seen.append(float(x.abs().max()))
        out.append(ScalingStep(i, amax, rows[0][0], rows[0][1], rows[1][0], rows[1][1]))
    return out


@dataclass(frozen=True)
class FP8Step:
    """A published pair of runs, BF16 and FP8 on one layout, and labsim's two step times."""

    model: str
    gpus: int
    measured_bf16_s: float
    measured_fp8_s: float
    labsim_bf16_s: float
    labsim_fp8_s: float

    def __str__(self) -> str:
        measured = self.measured_bf16_s / self.measured_fp8_s
        model = self.labsim_bf16_s / self.labsim_fp8_s
        return (f"{self.model:<16} {self.gpus:5d} GPUs | measured BF16 {self.measured_bf16_s:6.2f}"
                f" s, FP8 {self.measured_fp8_s:6.2f} s (x{measured:.2f}) | labsim BF16 "
                f"{self.labsim_bf16_s:6.2f} s, FP8 {self.labsim_fp8_s:6.2f} s (x{model:.2f})")


def fp8_steps(ids: Sequence[str] = ("dgxc2411_nemotron4_15b_{}_16gpu",
                                    "dgxc2411_gpt3_175b_{}_128gpu",
                                    "dgxc2504_grok1_314b_{}_512gpu")) -> list[FP8Step]:
    """The published BF16 / FP8 pairs named by ``ids`` (``{}`` is the dtype) with labsim's
    ``estimate_step`` of each."""
    by_id = {r.id: r for r in runs()}
    out = []
    for pattern in ids:
        bf16, fp8 = by_id[pattern.format("bf16")], by_id[pattern.format("fp8")]
        est = [labsim.estimate_step(r.model, r.cluster, r.plan).step_time_s for r in (bf16, fp8)]
        out.append(FP8Step(bf16.model_spec["name"], bf16.gpus, bf16.measured_step_s(),
                           fp8.measured_step_s(), *est))
    return out
