"""Checks for the planning lab (lab 15): how long a run takes, what slows a step, and when
owning GPUs beats renting them.

``training_days`` is compared with labsim's cost model (``labsim.cost``: 6 N D at an MFU);
``diagnose`` and ``break_even_utilisation`` with the references beside them here (the library
does not need them).  The learner's functions must not call ``labsim.cost``.
"""

from __future__ import annotations

import math

from labsim.checks._core import Case, Spec, close, equal, raises
from labsim.cost import owned_usd_per_gpu_hour, run_cost
from labsim.hardware import GPU

FORBID = ("labsim.cost:*",)
A100, H100 = 312e12, 989.4e12


def _days(params: float, tokens: float, gpus: int, peak: float, mfu: float) -> float:
    chip = GPU("chip", {"bf16": peak}, 80e9, 2e12, "a check's made-up chip", tdp_W=400)
    return run_cost(params, tokens, chip, gpus, mfu).days


def _training_days_cases() -> list[Case]:
    good = [("13B on 1T tokens, 8 A100 at 40 % MFU", 13e9, 1e12, 8, A100, 0.4),
            ("GPT-3 175B on 300B tokens, 1024 A100 at 45 %", 175e9, 300e9, 1024, A100, 0.45),
            ("Llama-2 70B on 2T tokens, 2048 H100 at 50 %", 70e9, 2e12, 2048, H100, 0.5),
            ("124M on 10B tokens, one H100 at 30 %", 124e6, 10e9, 1, H100, 0.3),
            ("perfect utilisation", 7e9, 1e11, 64, H100, 1.0)]
    cases = [Case(n, (p, d, g, pk, m), expected=_days(p, d, g, pk, m))
             for n, p, d, g, pk, m in good]
    cases += [Case("MFU of 0 (nothing runs): ValueError", (7e9, 1e9, 8, A100, 0.0),
                   compare=raises(ValueError)),
              Case("MFU above 1 (faster than the peak): ValueError", (7e9, 1e9, 8, A100, 1.2),
                   compare=raises(ValueError))]
    return cases


training_days = Spec("training_days", _training_days_cases, compare=close(rtol=1e-6),
                     forbid=FORBID)
"""``fn(params, tokens, gpus, peak_flops, mfu)`` = days to train: 6 N D / (gpus peak mfu)
/ 86400; ValueError unless 0 < mfu <= 1."""

STALLS = ("data", "communication", "memory")
LABELS = {"data": "data-starved", "communication": "communication-bound",
          "memory": "memory-bound"}


def reference_diagnose(shares: dict[str, float], threshold: float = 0.15) -> str:
    """The largest stall (share of the step waiting for input, in exposed communication, or
    in memory-bound kernels) if it is above ``threshold``; else ``"compute-bound"``."""
    worst = max(STALLS, key=lambda k: shares.get(k, 0.0))
    return LABELS[worst] if shares.get(worst, 0.0) > threshold else "compute-bound"


def _diagnose_cases() -> list[Case]:
    runs = [
        ("one loader worker: GPU waits 75 % of the time",
         {"data": 0.75, "communication": 0.0, "memory": 0.05, "compute": 0.2}),
        ("DP over PCIe without accumulation: 77 % exposed all-reduce",
         {"data": 0.0, "communication": 0.77, "memory": 0.03, "compute": 0.2}),
        ("standard attention at long context: softmax and dropout",
         {"data": 0.0, "communication": 0.05, "memory": 0.45, "compute": 0.5}),
        ("compute is the largest share, but 20 % is spent waiting for data",
         {"data": 0.2, "communication": 0.1, "memory": 0.1, "compute": 0.6}),
        ("a healthy step: every stall under 15 %",
         {"data": 0.05, "communication": 0.1, "memory": 0.1, "compute": 0.75}),
        ("exactly at the threshold is still healthy",
         {"data": 0.15, "communication": 0.0, "memory": 0.0, "compute": 0.85}),
        ("two stalls: the larger one is fixed first",
         {"data": 0.2, "communication": 0.3, "memory": 0.0, "compute": 0.5}),
    ]
    return [Case(name, (shares,), expected=reference_diagnose(shares)) for name, shares in runs]


diagnose = Spec("diagnose", _diagnose_cases, compare=equal)
"""``fn(shares)`` -> ``"data-starved"``, ``"communication-bound"``, ``"memory-bound"`` or
``"compute-bound"``: the largest stall above 15 % of the step, else compute-bound."""


def reference_break_even(purchase_usd: float, years: float, power_W: float,
                         usd_per_kwh: float, pue: float, cloud_usd_per_gpu_hour: float) -> float:
    """The fraction of hours an owned GPU must be busy for its cost per busy hour (purchase
    spread over its life, plus electricity) to equal the cloud's price; ``math.inf`` when
    electricity alone costs more than the cloud."""
    energy = owned_usd_per_gpu_hour(purchase_usd, years, power_W=power_W,
                                    usd_per_kwh=usd_per_kwh, pue=pue) - \
        purchase_usd / (years * 365.25 * 24)
    if cloud_usd_per_gpu_hour <= energy:
        return math.inf
    return purchase_usd / (years * 365.25 * 24) / (cloud_usd_per_gpu_hour - energy)


def _break_even_cases() -> list[Case]:
    rows = [("H100 at $30,000 over 4 years vs $4.92/h", (30000, 4, 700, 0.10, 1.3, 4.916)),
            ("A100 at $15,000 over 5 years vs $4.10/h", (15000, 5, 400, 0.10, 1.5, 32.77 / 8)),
            ("RTX 4090 at $1,599 over 3 years vs $0.40/h", (1599, 3, 450, 0.15, 1.0, 0.40)),
            ("cheap cloud: break-even above full use", (30000, 3, 700, 0.10, 1.3, 1.0)),
            ("free electricity", (30000, 4, 700, 0.0, 1.0, 2.0)),
            ("electricity alone dearer than the cloud: never", (20000, 4, 700, 0.5, 2.0, 0.5))]
    return [Case(n, a, expected=reference_break_even(*a)) for n, a in rows]


break_even_utilisation = Spec("break_even_utilisation", _break_even_cases,
                              compare=close(rtol=1e-6), forbid=FORBID)
"""``fn(purchase_usd, years, power_W, usd_per_kwh, pue, cloud_usd_per_gpu_hour)`` = the
busy fraction at which owning costs what renting does (``math.inf``: never)."""
