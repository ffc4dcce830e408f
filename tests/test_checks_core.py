"""run_check: one PASS line on success, a CheckFailed naming the first failing case."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from labsim.checks import SUMMARY_RE, Case, CheckFailed, close, equal, raises, run_check

CASES = [Case(f"x={x}", (x,), expected=x * x) for x in (-3, 0, 1, 2.5, 10)]


def test_pass_prints_exactly_one_line(capsys) -> None:
    run_check("square", lambda x: x * x, CASES)
    out = capsys.readouterr().out
    assert out == "PASS square: 5/5 cases passed\n"
    assert SUMMARY_RE.fullmatch(out.strip()).group("passed") == "5"


def test_failure_counts_every_case_and_names_the_first_failure(capsys) -> None:
    with pytest.raises(CheckFailed) as info:
        run_check("square", lambda x: x * x if x > 0 else 0, CASES)
    message = str(info.value)
    m = SUMMARY_RE.match(message)
    assert (m.group("status"), m.group("passed"), m.group("total")) == ("FAIL", "4", "5")
    assert "x=-3" in message and "0.0 instead of 9.0" in message
    assert capsys.readouterr().out == ""  # nothing that could be mistaken for a pass


def test_not_implemented_and_exceptions_are_failed_cases() -> None:
    def stub(x):
        raise NotImplementedError

    with pytest.raises(CheckFailed, match="(?s)0/5 cases passed.*not implemented"):
        run_check("square", stub, CASES)
    with pytest.raises(CheckFailed, match="raised ZeroDivisionError"):
        run_check("square", lambda x: 1 / 0, CASES)


def test_a_check_needs_five_cases_and_a_function() -> None:
    with pytest.raises(ValueError, match=">= 5"):
        run_check("few", abs, CASES[:4])
    with pytest.raises(CheckFailed, match="pass the function itself"):
        run_check("square", 42, CASES)


def test_close_handles_tensors_arrays_nested_and_special_values() -> None:
    cmp = close(rtol=1e-6)
    assert cmp(torch.tensor([1.0, 2.0]), np.array([1.0, 2.0])) is None
    assert "shape" in cmp(torch.zeros(2, 2), np.zeros(4))
    assert "element 1" in cmp(np.array([1.0, 2.1]), np.array([1.0, 2.0]))
    assert cmp({"a": [1.0, (2.0, 3.0)]}, {"a": [1.0, (2.0, 3.0)]}) is None
    assert "keys" in cmp({"a": 1}, {"b": 1})
    assert cmp(float("nan"), math.nan) is None
    assert cmp(float("inf"), math.inf) is None
    assert cmp(1e308 * 10, 1.0) is not None
    assert "expected a number" in cmp("x", 1.0)
    assert equal("a", "a") is None and equal(1, 2) == "1 instead of 2"


def test_raises_expects_the_exception() -> None:
    cases = [Case(f"bad {v}", (v,), compare=raises(ValueError)) for v in (-1, -2, -3, -4, -5)]

    def sqrt(v):
        if v < 0:
            raise ValueError("negative")
        return v**0.5

    run_check("sqrt", sqrt, cases)
    with pytest.raises(CheckFailed, match="expected ValueError"):
        run_check("sqrt", lambda v: 0.0, cases)
