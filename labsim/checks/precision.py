"""Checks for the mixed-precision exercises: format limits, a dynamic loss scaler and a 16-bit
weight that keeps its small updates.

The oracle for the loss scaler is PyTorch's own ``torch.amp.GradScaler``: every scenario runs
once with it (in the grader's process when grading) and once with the learner's class, on the
same model and the same gradients, and compares the scale after every step, which steps were
skipped and the final weights.  The learner's class must not be, wrap or call a GradScaler:
the tripwire watches GradScaler's code, the recorder its kernels
(``_amp_foreach_non_finite_check_and_unscale_``, ``_amp_update_scale_``).

The oracle for the compensated weight is exact arithmetic: every case's updates are summed in
float64, and the learner's 16-bit weight must stay within the error bound of compensated
(Kahan) summation at four points of the run, while the recorder sees that no tensor wider
than 16 bits was made, no value left torch for Python numbers, and no more state was kept
than one 16-bit buffer beside the weight.
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


# -- a 16-bit weight that keeps its small updates -------------------------------------------

SIXTEEN_BITS = ("bfloat16", "float16")
STATE_LIMIT = 2  # the weight and one buffer of its size: 2 + 2 bytes per parameter


def kahan_bound(terms_abs_sum: torch.Tensor, n_terms: int, dtype: torch.dtype) -> torch.Tensor:
    """Error bound of compensated summation, (2u + n u^2) * sum |x_i| with u the unit roundoff
    eps / 2 (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed. 2002, section
    4.3); recursive (plain) summation's is (n - 1) u * sum |x_i|."""
    u = torch.finfo(dtype).eps / 2
    return (2 * u + n_terms * u * u) * terms_abs_sum


def _marks(n: int) -> list[int]:
    return sorted({max(1, n // 4), max(1, n // 2), max(1, 3 * n // 4), n})


def _weight_case(name: str, start: torch.Tensor, updates: torch.Tensor) -> Case:
    """``updates`` (n, *start.shape) applied one by one to ``start``; expected: the exact
    running sums at the marks, the bound there and where a plain 16-bit ``+=`` ends up."""
    dtype, n = start.dtype, updates.shape[0]
    exact = start.double() + updates.double().cumsum(0)
    abs_sum = start.double().abs() + updates.double().abs().cumsum(0)
    plain, plain_at = start.clone(), []
    marks = _marks(n)
    for i in range(n):
        plain = plain + updates[i]
        if i + 1 in marks:
            plain_at.append(plain.double())
    expected = {
        "dtype": str(dtype).replace("torch.", ""), "shape": list(start.shape), "marks": marks,
        "exact": [exact[m - 1] for m in marks],
        "bound": [kahan_bound(abs_sum[m - 1], m + 1, dtype) for m in marks],
        "plain": plain_at,
    }
    return Case(name, (start, updates), expected=expected, compare=_weight_compare)


def _weight_compare(got: Any, expected: Any) -> str | None:
    if not isinstance(got, dict) or set(got) != {"weights", "dtype", "shape"}:
        return f"the check could not read the weight: {got!r}"[:200]
    if got["dtype"] != expected["dtype"] or list(got["shape"]) != expected["shape"]:
        return (f"`weight` is a {got['dtype']} tensor of shape {got['shape']}; it must stay "
                f"{expected['dtype']} of shape {expected['shape']}")
    n = expected["marks"][-1]
    for k, mark in enumerate(expected["marks"]):
        w = torch.as_tensor(got["weights"][k], dtype=torch.float64).reshape(-1)
        exact = torch.as_tensor(expected["exact"][k]).reshape(-1)
        bound = torch.as_tensor(expected["bound"][k]).reshape(-1)
        err = (w - exact).abs()
        if not bool((err <= bound).all()) or not bool(torch.isfinite(w).all()):
            i = int(torch.argmax(torch.nan_to_num(err / bound.clamp_min(1e-300), nan=math.inf)))
            plain = float(torch.as_tensor(expected["plain"][k]).reshape(-1)[i])
            return (f"after {mark} of {n} updates, element {i} is {float(w[i]):.7g}; the exact "
                    f"sum is {float(exact[i]):.7g} (off by {float(err[i]):.3g}; compensated "
                    f"summation stays within {float(bound[i]):.3g}, a plain 16-bit += ends "
                    f"at {plain:.7g})")
    return None


def _weight_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(11)
    bf, fp16 = torch.bfloat16, torch.float16
    steady = torch.randn(64, generator=gen)
    w_mixed = torch.randn(32, generator=gen)
    big = torch.zeros(160, 32)
    big[::40] = 3 * torch.randn(4, 32, generator=gen)
    cases = [
        ("bf16: 1 + 100 updates of -0.001 (the section's weight)",
         torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=bf), torch.full((100, 4), -1e-3, dtype=bf)),
        ("bf16: 0 + 600 updates of 0.01 (a running sum)",
         torch.zeros(2, dtype=bf), torch.full((600, 2), 0.01, dtype=bf)),
        ("bf16: 256 weights, 300 noisy SGD-like updates of ~1e-3 (some cross zero)",
         torch.randn(256, generator=gen).to(bf),
         (1e-3 * torch.randn(300, 256, generator=gen)).to(bf)),
        ("bf16: 64 weights drifting steadily by ~1e-3 per update, with noise",
         torch.randn(64, generator=gen).to(bf),
         (-1e-3 * steady + 5e-4 * torch.randn(300, 64, generator=gen)).to(bf)),
        ("fp16: 64 weights, 400 updates of ~1e-4",
         torch.randn(64, generator=gen).to(fp16),
         (1e-4 * torch.randn(400, 64, generator=gen)).to(fp16)),
        ("bf16: a few updates larger than the weights among small ones",
         w_mixed.to(bf), (big + 1e-3 * torch.randn(160, 32, generator=gen)).to(bf)),
        ("bf16: zero updates leave the weight as it was",
         torch.tensor([0.0, 1.5, -3.0], dtype=bf), torch.zeros(20, 3, dtype=bf)),
    ]
    return [_weight_case(name, start, updates) for name, start, updates in cases]


def _drive_weight(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
                  ) -> list[Outcome]:
    """``cls(start)``, then ``add_(update)`` for every update, handed over in one buffer that
    is overwritten for the next (as an optimizer reuses its gradient buffer); ``weight`` is
    copied at the marks.  Watched: the dtypes of the tensors made, the operators, the torch
    functions, and the bytes still held at the end by tensors the learner's code made."""
    cls = fns[0]
    outcomes = []
    for case in cases:
        start, updates = case.args
        marks = set(_marks(int(updates.shape[0])))
        start = start.clone()
        buffer = torch.empty_like(updates[0])
        copies: list[torch.Tensor] = []
        weight_bytes = start.numel() * start.element_size()
        with watch(spec.forbid, keep_created=True, functions=True) as seen:
            try:
                obj = cls(start)
                for i in range(int(updates.shape[0])):
                    buffer.copy_(updates[i])
                    obj.add_(buffer)
                    if i + 1 in marks:
                        copies.append(obj.weight.detach().clone())
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                error: BaseException | None = exc
            else:
                error = None
        log = seen.log
        held = log.held_bytes(exclude=copies) if log is not None else 0
        observed = {**seen.summary(), "held_bytes": held, "weight_bytes": weight_bytes}
        if error is not None:
            outcomes.append(Outcome.of_error(error, observed))
            continue
        last = copies[-1]
        value = {"weights": [c.double().reshape(-1) for c in copies],
                 "dtype": str(last.dtype).replace("torch.", ""), "shape": list(last.shape)}
        outcomes.append(plain_outcome(value, observed))
        del obj
    return outcomes


def _sixteen_bit_state(case: Case, out: Outcome) -> str | None:
    wide = [d for d in out.observed.get("float_dtypes", []) if d not in SIXTEEN_BITS]
    if wide:
        return (f"it made {', '.join(wide)} tensors: a wider copy of the weight is the fp32 "
                "master this exercise does without; keep the weight and what rounding lost "
                "in 16-bit tensors")
    if out.observed.get("ops", {}).get("aten::_local_scalar_dense"):
        return ("it reads values out of tensors into Python numbers (.item(), float()): "
                "Python floats are 64-bit; keep the state in 16-bit tensors")
    return None


def _one_buffer(case: Case, out: Outcome) -> str | None:
    held, size = out.observed.get("held_bytes", 0), out.observed.get("weight_bytes", 1)
    if held > STATE_LIMIT * size:
        return (f"it keeps {held} bytes of tensors for a {size}-byte weight: the weight and "
                "one 16-bit buffer of its size are enough (4 bytes per parameter, against 6 "
                "for an fp32 master and its 16-bit copy)")
    return None


compensated_weight = Spec("compensated_weight", _weight_cases, drive=_drive_weight,
                          rules=(_sixteen_bit_state, _one_buffer), torch_only=True)
"""``cls(weight)`` with ``add_(update)`` and ``.weight``: a 16-bit weight that ends within the
error bound of compensated summation of the exact sum, holding only 16-bit tensors, at most
twice the weight's bytes."""
