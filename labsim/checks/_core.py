"""The machinery every check cell uses.

A check runs a learner's function on many cases against a reference and prints exactly one
deterministic line when every case passes::

    PASS roofline_time: 7/7 cases passed

When a case fails it raises ``CheckFailed`` whose message starts with the same kind of line
(``FAIL roofline_time: 5/7 cases passed``) and then names the first failing case, what was
expected and what came back.  The release stores the PASS line as the expected output of the
check cell, so nbval fails the cell on any other output, even if an earlier cell has hidden
tracebacks.  ``labsim grade`` reads the counts for partial credit (see ``SUMMARY_RE``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SUMMARY_RE = re.compile(
    r"(?P<status>PASS|FAIL) (?P<title>[\w.\-]+): "
    r"(?P<passed>\d+)/(?P<total>\d+) cases passed"
)
MIN_CASES = 5


class CheckFailed(AssertionError):
    """A learner's function gave a wrong answer (or raised) on at least one case."""


@dataclass(frozen=True)
class Case:
    """One input to a learner's function and what must come back.

    ``expected`` is the reference answer; ``compare(got, expected)`` returns None when they
    agree and otherwise a short reason.  ``name`` says in words what the case exercises.
    """

    name: str
    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    expected: Any = None
    compare: Callable[[Any, Any], str | None] | None = None


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def close(rtol: float = 1e-6, atol: float = 0.0) -> Callable[[Any, Any], str | None]:
    """A comparison for numbers, arrays, tensors and nested sequences/mappings of them."""

    def compare(got: Any, expected: Any) -> str | None:
        return _close(got, expected, rtol, atol, "")

    return compare


def _as_float_list(value: Any) -> list[float] | None:
    if hasattr(value, "detach"):  # torch tensor
        value = value.detach().cpu().double().numpy()
    if hasattr(value, "tolist") and hasattr(value, "shape"):
        flat = value.reshape(-1).tolist()
        return [float(x) for x in flat]
    return None


def _close(got: Any, expected: Any, rtol: float, atol: float, where: str) -> str | None:
    exp_list = _as_float_list(expected)
    if exp_list is not None:
        got_list = _as_float_list(got)
        if got_list is None:
            return f"{where}expected an array/tensor, got {type(got).__name__}"
        exp_shape = tuple(getattr(expected, "shape", ()))
        got_shape = tuple(getattr(got, "shape", ()))
        if exp_shape != got_shape:
            return f"{where}shape {got_shape} instead of {exp_shape}"
        for i, (g, e) in enumerate(zip(got_list, exp_list)):
            if not _num_close(g, e, rtol, atol):
                return f"{where}element {i}: {g!r} instead of {e!r}"
        return None
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping):
            return f"{where}expected a mapping, got {type(got).__name__}"
        if set(got) != set(expected):
            return (
                f"{where}keys {sorted(map(str, got))} instead of {sorted(map(str, expected))}"
            )
        for key in expected:
            reason = _close(got[key], expected[key], rtol, atol, f"{where}[{key!r}] ")
            if reason:
                return reason
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return f"{where}expected a sequence, got {type(got).__name__}"
        if len(got) != len(expected):
            return f"{where}length {len(got)} instead of {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            reason = _close(g, e, rtol, atol, f"{where}[{i}] ")
            if reason:
                return reason
        return None
    if isinstance(expected, bool) or expected is None or isinstance(expected, str):
        return (
            None if got == expected else f"{where}{_short(got)} instead of {_short(expected)}"
        )
    if isinstance(expected, (int, float)):
        try:
            g = float(got)
        except (TypeError, ValueError):
            return f"{where}expected a number, got {type(got).__name__}"
        if not _num_close(g, float(expected), rtol, atol):
            return f"{where}{g!r} instead of {float(expected)!r}"
        return None
    return None if got == expected else f"{where}{_short(got)} instead of {_short(expected)}"


def _num_close(g: float, e: float, rtol: float, atol: float) -> bool:
    if math.isnan(e):
        return math.isnan(g)
    if math.isinf(e):
        return g == e
    return math.isfinite(g) and abs(g - e) <= atol + rtol * abs(e)


def equal(got: Any, expected: Any) -> str | None:
    """Exact equality."""
    return None if got == expected else f"{_short(got)} instead of {_short(expected)}"


def raises(kind: type[BaseException]) -> Callable[[Any, Any], str | None]:
    """Use as ``compare`` with ``expected=None`` for a case that must raise ``kind``.

    The runner passes the raised exception as ``got``.
    """

    def compare(got: Any, expected: Any) -> str | None:
        if isinstance(got, kind):
            return None
        return f"expected {kind.__name__} to be raised, got {_short(got)}"

    compare.expects_exception = kind  # type: ignore[attr-defined]
    return compare


def run_check(
    title: str,
    fn: Callable[..., Any],
    cases: Sequence[Case] | Iterable[Case],
    *,
    compare: Callable[[Any, Any], str | None] | None = None,
) -> None:
    """Run ``fn`` on every case; print one PASS line or raise ``CheckFailed``.

    Every case is run (so the count of passed cases is known for partial credit); the error
    names the first one that failed.  A case whose function raises counts as failed, with
    the exception in the reason (``NotImplementedError`` means the exercise is not done).
    """
    cases = list(cases)
    if len(cases) < MIN_CASES:
        raise ValueError(f"check {title} has {len(cases)} cases; a check needs >= {MIN_CASES}")
    if not callable(fn):
        raise CheckFailed(
            f"FAIL {title}: 0/{len(cases)} cases passed\n"
            f"expected a function, got {type(fn).__name__}: pass the function itself, "
            "e.g. check(my_fn) rather than check(my_fn())"
        )
    default = compare or close()
    passed = 0
    first: str | None = None
    for case in cases:
        cmp = case.compare or default
        expects = getattr(cmp, "expects_exception", None)
        try:
            got: Any = fn(*case.args, **dict(case.kwargs))
        except NotImplementedError:
            reason: str | None = (
                "not implemented yet (the function raised NotImplementedError)"
            )
        except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
            reason = (
                cmp(exc, case.expected) if expects else (f"raised {type(exc).__name__}: {exc}")
            )
        else:
            reason = cmp(got, case.expected)
        if reason is None:
            passed += 1
        elif first is None:
            first = f"first failing case: {case.name}\n  {reason}"
    if passed == len(cases):
        print(f"PASS {title}: {passed}/{len(cases)} cases passed")
        return
    raise CheckFailed(f"FAIL {title}: {passed}/{len(cases)} cases passed\n{first}")
