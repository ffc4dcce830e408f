"""Checks for the mixed-precision exercises: format limits and a dynamic loss scaler.

The oracle for the loss scaler is PyTorch's own ``torch.amp.GradScaler``: every scenario runs
once with it and once with the learner's class, on the same model and the same gradients,
and compares the scale after every step, which steps were skipped and the final weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from labsim.checks._core import Case, close, run_check
from labsim.experiments import precision as P

# (name, exponent bits, mantissa bits) of formats torch can store, to probe the answers.
_FORMATS = (
    ("fp16", 5, 10),
    ("bf16", 8, 7),
    ("fp32", 8, 23),
    ("fp64", 11, 52),
    ("fp8-e5m2", 5, 2),
)


def _limits_dict(name: str) -> dict[str, float]:
    lim = P.format_limits(name)
    return {
        "max": lim.max,
        "smallest_normal": lim.smallest_normal,
        "smallest_subnormal": lim.smallest_subnormal,
        "eps": lim.eps,
    }


def float_limits(fn: Callable[[int, int], dict[str, float]]) -> None:
    """``fn(exponent_bits, mantissa_bits)`` against ``torch.finfo`` and rounding probes."""
    cases = [
        Case(f"{name} (e{e} m{m})", (e, m), expected=_limits_dict(name))
        for name, e, m in _FORMATS
    ]
    # A format torch cannot store: the formula must still hold (IEEE-style e4 m3 with inf).
    cases.append(
        Case(
            "IEEE-style e4m3 (with inf/NaN; not the fp8 e4m3fn variant)",
            (4, 3),
            expected={
                "max": (2 - 2**-3) * 2.0**7,
                "smallest_normal": 2.0**-6,
                "smallest_subnormal": 2.0**-9,
                "eps": 2.0**-3,
            },
        )
    )
    run_check("float_limits", fn, cases, compare=close(rtol=1e-12))


# --------------------------------------------------------------------------------------
# Loss scaler

ScalerFactory = Callable[..., Any]


def _grad_scaler(**kwargs: Any) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **kwargs)


def _manual_run(make: ScalerFactory, pattern: tuple[float, ...], **kwargs: Any) -> dict:
    """A parameter whose gradient is (1, 2, g) for each g of ``pattern`` (inf and nan too)."""
    scaler = make(**kwargs)
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = torch.optim.SGD([p], lr=0.125)
    scales, weights = [], []
    for g in pattern:
        opt.zero_grad(set_to_none=True)
        loss = (p * torch.tensor([1.0, 2.0, g])).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        weights.append(p.detach().clone())
    return {"scale after each step": scales, "weights after each step": weights}


def _fresh(make: ScalerFactory, **kwargs: Any) -> dict:
    scaler = make(**kwargs)
    loss = torch.tensor(0.75, requires_grad=True)
    scaled = scaler.scale(loss)
    return {"get_scale()": float(scaler.get_scale()), "scale(0.75)": float(scaled.detach())}


def _unscale_then_step(make: ScalerFactory) -> dict:
    """``unscale_`` before ``step`` (to clip or log gradients) must not unscale twice."""
    scaler = make(init_scale=1024.0)
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler.scale((p * torch.tensor([3.0, -4.0])).sum()).backward()
    scaler.unscale_(opt)
    grad = p.grad.detach().clone()
    scaler.step(opt)
    scaler.update()
    return {"grad after unscale_": grad, "weights": p.detach().clone()}


def _training(make: ScalerFactory, **kwargs: Any) -> dict:
    run = P.train_amp(lambda: make(**kwargs), steps=24)
    return {
        "skipped steps": list(run.skipped_steps),
        "scale used on each step": list(run.scales),
        "final scale": run.final_scale,
        "final weights": list(run.weights),
    }


def _scenarios() -> list[tuple[str, Callable[[ScalerFactory], dict]]]:
    ones = (1.0,) * 7
    return [
        ("fresh scaler with default settings", lambda m: _fresh(m)),
        ("fresh scaler with init_scale=8", lambda m: _fresh(m, init_scale=8.0)),
        (
            "scale grows after growth_interval=3 finite steps",
            lambda m: _manual_run(m, ones, init_scale=4.0, growth_interval=3),
        ),
        (
            "inf gradient: skip the step and back off",
            lambda m: _manual_run(
                m, (1.0, math.inf, 1.0, 1.0, 1.0), init_scale=64.0, growth_interval=2
            ),
        ),
        (
            "NaN gradient: skip, back off, restart the growth count",
            lambda m: _manual_run(
                m, (1.0, 1.0, math.nan, 1.0, 1.0, 1.0, 1.0), init_scale=64.0,
                growth_interval=3,
            ),
        ),
        (
            "growth_factor=4, backoff_factor=0.25, two overflows in a row",
            lambda m: _manual_run(
                m, (math.inf, -math.inf, 1.0, 1.0, 1.0), init_scale=2.0**10, growth_factor=4.0,
                backoff_factor=0.25, growth_interval=2,
            ),
        ),
        ("unscale_ then step unscales once", _unscale_then_step),
        (
            "train_amp: fp16 MLP, init_scale=2**16, growth_interval=4",
            lambda m: _training(m, init_scale=2.0**16, growth_interval=4),
        ),
    ]


def loss_scaler(cls: type) -> None:
    """The learner's ``DynamicLossScaler`` class against ``torch.amp.GradScaler``."""
    scenarios = _scenarios()
    cases = [Case(name, (scenario,), expected=scenario(_grad_scaler)) for name, scenario in
             scenarios]
    if not callable(cls):
        run_check("loss_scaler", cls, cases)
        return
    run_check(
        "loss_scaler",
        lambda scenario: scenario(cls),
        cases,
        compare=close(rtol=1e-6, atol=1e-12),
    )
