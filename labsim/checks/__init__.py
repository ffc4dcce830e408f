"""Checks that notebook check cells call: ``check.<topic>.<name>(learner_fn)``.

One module per topic (``labsim/checks/<topic>.py``), imported on first use, so
``from labsim import checks as check; check.roofline.matmul_flops(fn)`` works for every
topic module.  Each public check is a ``Spec``: at least five cases (edge cases included), a
driver that runs the learner's function on their inputs under the operator recorder and the
reference tripwire, and the rules of the exercise; it prints one PASS line on success.
``labsim grade`` runs the same driver in the learner's sandbox and judges in its own process.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from labsim.checks._core import (
    SUMMARY_RE,
    Case,
    CheckFailed,
    ExerciseNotDone,
    Hidden,
    Outcome,
    Spec,
    close,
    equal,
    raises,
    run_check,
)

__all__ = ["SUMMARY_RE", "Case", "CheckFailed", "ExerciseNotDone", "Hidden", "Outcome", "Spec",
           "close", "equal", "raises", "run_check"]


def __getattr__(name: str) -> ModuleType:
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{__name__}.{name}":
            raise AttributeError(f"labsim.checks has no topic {name!r}") from None
        raise
