"""Checks for the mixed-precision exercises: format limits and a dynamic loss scaler.

The oracle for the loss scaler is PyTorch's own ``torch.amp.GradScaler``: every scenario runs
once with it (in the grader's process when grading) and once with the learner's class, on the
same model and the same gradients, and compares the scale after every step, which steps were
skipped and the final weights.  The learner's class must not be, wrap or call a GradScaler:
the tripwire watches GradScaler's code, the recorder its kernels
(``_amp_foreach_non_finite_check_and_unscale_``, ``_amp_update_scale_``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from labsim.checks._core import Case, Outcome, Spec, close, plain_outcome
from labsim.checks._observe import watch
from labsim.experiments import precision as P

# (name, exponent bits, mantissa bits) of formats torch can store, to probe the answers.
_FORMATS = (
    ("fp16", 5, 10),
    ("bf16", 8, 7),
    ("fp32", 8, 23),
    ("fp64", 11, 52),
    ("fp8-e5m2", 5, 2),
)
FORBID_LIMITS = ("labsim.experiments.precision:format_limits",
                 "labsim.experiments.precision:round_trip")
FORBID_SCALER = ("torch.amp.grad_scaler:GradScaler", "torch.cuda.amp.grad_scaler:GradScaler",
                 "labsim.experiments.precision:grad_scaler")
AMP_KERNELS = ("aten::_amp_foreach_non_finite_check_and_unscale_", "aten::_amp_update_scale_")


def _limits_dict(name: str) -> dict[str, float]:
    lim = P.format_limits(name)
    return {
        "max": lim.max,
        "smallest_normal": lim.smallest_normal,
        "smallest_subnormal": lim.smallest_subnormal,
        "eps": lim.eps,
    }


def _float_limits_cases() -> list[Case]:
    cases = [Case(f"{name} (e{e} m{m})", (e, m), expected=_limits_dict(name))
             for name, e, m in _FORMATS]
    # A format torch cannot store: the formula must still hold (IEEE-style e4 m3 with inf).
    cases.append(Case(
        "IEEE-style e4m3 (with inf/NaN; not the fp8 e4m3fn variant)", (4, 3),
        expected={"max": (2 - 2**-3) * 2.0**7, "smallest_normal": 2.0**-6,
                  "smallest_subnormal": 2.0**-9, "eps": 2.0**-3}))
    return cases


float_limits = Spec("float_limits", _float_limits_cases, compare=close(rtol=1e-12),
                    forbid=FORBID_LIMITS, ops=False)
"""``fn(exponent_bits, mantissa_bits)`` against ``torch.finfo`` and rounding probes."""


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


def _unscale_twice(make: ScalerFactory) -> dict:
    """A second ``unscale_`` of the same optimizer before ``update`` is an error (it would
    divide the gradients twice): GradScaler raises RuntimeError."""
    scaler = make(init_scale=8.0)
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler.scale((p * torch.tensor([4.0, 8.0])).sum()).backward()
    scaler.unscale_(opt)
    try:
        scaler.unscale_(opt)
        raised = "no error"
    except RuntimeError:
        raised = "RuntimeError"
    return {"second unscale_ before update()": raised, "grad": p.grad.detach().clone()}


def _two_optimizers(make: ScalerFactory) -> dict:
    """One scaler, two optimizers: each is unscaled once and steps only when its own
    gradients are finite; an overflow in either backs the scale off."""
    scaler = make(init_scale=2.0**10, growth_interval=2)
    a = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    b = torch.nn.Parameter(torch.tensor([3.0, -1.0]))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.25), torch.optim.SGD([b], lr=0.5)
    scales, weights = [], []
    for g in (1.0, math.inf, 1.0, 1.0, 1.0):  # the inf is in b's gradient only
        opt_a.zero_grad(set_to_none=True)
        opt_b.zero_grad(set_to_none=True)
        loss = (a * torch.tensor([1.0, 2.0])).sum() + (b * torch.tensor([g, 1.0])).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(opt_a)  # as one would to clip a's gradients
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        weights.append((a.detach().clone(), b.detach().clone()))
    return {"scale after each step": scales, "weights (a, b) after each step": weights}


def _training(make: ScalerFactory, **kwargs: Any) -> dict:
    run = P.train_amp(lambda: make(**kwargs), steps=24)
    return {
        "skipped steps": list(run.skipped_steps),
        "scale used on each step": list(run.scales),
        "final scale": run.final_scale,
        "final weights": list(run.weights),
    }


SCENARIOS: dict[str, Callable[[ScalerFactory], dict]] = {
    "fresh scaler with default settings": lambda m: _fresh(m),
    "fresh scaler with init_scale=8": lambda m: _fresh(m, init_scale=8.0),
    "scale grows after growth_interval=3 finite steps":
        lambda m: _manual_run(m, (1.0,) * 7, init_scale=4.0, growth_interval=3),
    "inf gradient: skip the step and back off":
        lambda m: _manual_run(m, (1.0, math.inf, 1.0, 1.0, 1.0), init_scale=64.0,
                              growth_interval=2),
    "NaN gradient: skip, back off, restart the growth count":
        lambda m: _manual_run(m, (1.0, 1.0, math.nan, 1.0, 1.0, 1.0, 1.0), init_scale=64.0,
                              growth_interval=3),
    "growth_factor=4, backoff_factor=0.25, two overflows in a row":
        lambda m: _manual_run(m, (math.inf, -math.inf, 1.0, 1.0, 1.0), init_scale=2.0**10,
                              growth_factor=4.0, backoff_factor=0.25, growth_interval=2),
    "unscale_ then step unscales once": _unscale_then_step,
    "unscale_ twice before update() raises RuntimeError": _unscale_twice,
    "two optimizers: each unscaled once, each skipped only on its own overflow":
        _two_optimizers,
    "train_amp: fp16 MLP, init_scale=2**16, growth_interval=4":
        lambda m: _training(m, init_scale=2.0**16, growth_interval=4),
}


def _loss_scaler_cases() -> list[Case]:
    return [Case(name, (name,), expected=scenario(_grad_scaler))
            for name, scenario in SCENARIOS.items()]


def _drive_scaler(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
                  ) -> list[Outcome]:
    cls = fns[0]
    mro = [f"{k.__module__}.{k.__qualname__}" for k in getattr(cls, "__mro__", ())]
    outcomes = []
    for case in cases:
        scenario = SCENARIOS.get(case.args[0]) if case.args else None
        with watch(spec.forbid) as seen:
            try:
                if scenario is None:
                    raise KeyError(f"no scenario {case.args!r}")
                value = scenario(cls)
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                error: BaseException | None = exc
            else:
                error = None
        observed = {**seen.summary(), "mro": mro}
        outcomes.append(Outcome.of_error(error, observed) if error is not None
                        else plain_outcome(value, observed))
    return outcomes


def _not_a_grad_scaler(case: Case, out: Outcome) -> str | None:
    mro = out.observed.get("mro", [])
    if any("GradScaler" in k for k in mro):
        return "the scaler is (a subclass of) torch.amp.GradScaler; write it from scratch"
    used = [k for k in AMP_KERNELS if out.observed.get("ops", {}).get(k)]
    if used:
        return f"it runs GradScaler's own kernels ({', '.join(used)}); write the update yourself"
    return None


loss_scaler = Spec("loss_scaler", _loss_scaler_cases, drive=_drive_scaler,
                   compare=close(rtol=1e-6, atol=1e-12), rules=(_not_a_grad_scaler,),
                   forbid=FORBID_SCALER)
"""The learner's ``DynamicLossScaler`` class against ``torch.amp.GradScaler``."""


# -- a running sum kept in a 16-bit accumulator ---------------------------------------------

def _accumulate_cases() -> list[Case]:
    specs = [(0.01, 1000, "fp32"), (0.01, 1000, "fp16"), (0.01, 1000, "bf16"),
             (1.0, 300, "bf16"), (1e-4, 5000, "fp16"), (0.1, 100, "bf16"), (3.0, 10, "fp32")]
    return [Case(f"{times} x {value:g} in {dtype}", (value, times, dtype),
                 expected=P.accumulate(value, times, dtype)) for value, times, dtype in specs]


accumulate = Spec("accumulate", _accumulate_cases, compare=close(rtol=0),
                  forbid=("labsim.experiments.precision:accumulate",), ops=False)
"""``fn(value, times, dtype) -> float``: ``value`` added ``times`` times into an accumulator of
``dtype`` ("fp32", "fp16", "bf16"), rounded after every addition; exact to the last bit."""
