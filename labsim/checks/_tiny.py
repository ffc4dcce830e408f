"""The three checks of the tiny lab the grader's tests and benchmark use (not a course topic).

``add`` (a + b), ``scale`` (x * k) and ``mean`` (of a list): five or six plain cases each, so a
grading run exercises every path of the grader in seconds.  A lab calls them as
``check._tiny.add(add)`` after ``import labsim.checks._tiny``.
"""

from __future__ import annotations

from labsim.checks._core import Case, Spec


def _add_cases() -> list[Case]:
    return [Case(f"{a}+{b}", (a, b), expected=a + b)
            for a, b in [(0, 0), (1, 2), (-3, 3), (2.5, 0.5), (10**6, 1)]]


def _scale_cases() -> list[Case]:
    return [Case(f"{x}*{k}", (x, k), expected=x * k)
            for x, k in [(0, 5), (1, 1), (2, -3), (1.5, 2), (7, 0), (3, 3)]]


def _mean_cases() -> list[Case]:
    return [Case(f"mean{xs}", (xs,), expected=sum(xs) / len(xs))
            for xs in [[1], [1, 2], [0, 0, 3], [-1, 1], [2.5, 3.5]]]


add = Spec("add", _add_cases, ops=False)
scale = Spec("scale", _scale_cases, ops=False)
mean = Spec("mean", _mean_cases, ops=False)
