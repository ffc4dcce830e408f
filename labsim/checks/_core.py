"""The machinery every check cell uses, in the notebook and in the grader.

A check (``Spec``) is three things kept apart, so that the grader can run the middle one in the
learner's sandbox and the other two in its own process:

1. ``build()`` makes the cases: inputs and expected values, from labsim's reference or an
   oracle (this never runs in the learner's process when grading);
2. ``drive(fns, cases)`` runs the learner's function(s) on the cases' inputs and returns one
   ``Outcome`` per case -- the value as plain data (``_plain``), or the error raised -- with what
   the recorder and tripwire saw (``_observe``);
3. ``judge(cases, outcomes)`` applies the rules of the exercise and compares each value with
   the expected one.

In a notebook, ``spec(fn)`` does all three and prints one deterministic line when every case
passes::

    PASS roofline_time: 7/7 cases passed

or raises ``CheckFailed`` whose short message (no traceback through labsim) starts with
``FAIL roofline_time: 5/7 cases passed`` and names the first failing case, what was expected
and what came back, with a hint.  Outcomes go through the plain-data codec in both places, so a
check judges exactly what the grader would.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from labsim.checks import _plain
from labsim.checks._observe import (
    LEAVES_TORCH,
    OUTSIDE,
    outside_reason,
    passed_references,
    watch,
)

SUMMARY_RE = re.compile(
    r"(?P<status>PASS|FAIL) (?P<title>[\w.\-]+): "
    r"(?P<passed>\d+)/(?P<total>\d+) cases passed"
)
MIN_CASES = 5
MESSAGE_CHARS = 300
NOT_DONE = "not implemented yet (the function raised NotImplementedError)"
HINT = ("hint: fix the first failing case above, rerun your exercise cell, then this check; "
        "Run All stops here until it passes")


class CheckFailed(AssertionError):
    """A learner's function gave a wrong answer (or raised, or broke a rule) on a case.

    Shown in a notebook as its message and a hint, without a traceback through labsim
    (IPython's ``_render_traceback_`` protocol)."""

    def __init__(self, message: str, hint: str = HINT) -> None:
        super().__init__(message)
        self.hint = hint

    def _render_traceback_(self) -> list[str]:
        lines = [f"{type(self).__name__}: " + str(self).splitlines()[0],
                 *str(self).splitlines()[1:]]
        return [*lines, self.hint] if self.hint else lines


class ExerciseNotDone(CheckFailed):
    """Every case failed because the exercise still raises ``NotImplementedError``."""


@dataclass(frozen=True)
class Case:
    """One input to a learner's function and what must come back.

    ``expected`` is the reference answer; ``compare(got, expected)`` returns None when they
    agree and otherwise a short reason.  ``name`` says in words what the case exercises.
    ``args``/``kwargs`` are plain data (they are sent to the learner's sandbox when grading).
    """

    name: str
    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    expected: Any = None
    compare: Callable[[Any, Any], str | None] | None = None

    def inputs(self) -> Case:
        """The case without its expected value: what the learner's side may see."""
        return Case(self.name, tuple(self.args), dict(self.kwargs))


@dataclass(frozen=True)
class Outcome:
    """What the learner's function did on one case, as plain data.

    ``value``: what it returned (plain data); ``error``: the name of the exception it raised
    ("" when it returned), ``error_types`` the names of that exception's classes (so
    ``raises(ValueError)`` accepts a subclass), ``message`` its text (short); ``observed``:
    what the recorder and tripwire saw (``_observe.watch.summary()``), or facts a driver
    measured.
    """

    value: Any = None
    error: str = ""
    error_types: tuple[str, ...] = ()
    message: str = ""
    observed: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of_error(cls, exc: BaseException, observed: Mapping[str, Any] | None = None
                 ) -> Outcome:
        names = tuple(k.__name__ for k in type(exc).__mro__ if k not in (object,))
        text = str(exc)
        return cls(None, type(exc).__name__, names, text[:MESSAGE_CHARS], dict(observed or {}))

    def to_plain(self) -> dict[str, Any]:
        return {"value": self.value, "error": self.error, "error_types": list(self.error_types),
                "message": self.message, "observed": dict(self.observed)}

    @classmethod
    def from_plain(cls, raw: Any) -> Outcome:
        """An outcome read back from plain data; ``PlainDataError`` if it is malformed."""
        if not isinstance(raw, dict) or set(raw) != {"value", "error", "error_types",
                                                     "message", "observed"}:
            raise _plain.PlainDataError("an outcome must have value, error, error_types, "
                                        "message and observed")
        types = raw["error_types"]
        if (not isinstance(raw["error"], str) or not isinstance(raw["message"], str)
                or not isinstance(types, list) or not all(isinstance(t, str) for t in types)
                or not isinstance(raw["observed"], dict)):
            raise _plain.PlainDataError("malformed outcome fields")
        return cls(raw["value"], raw["error"][:100], tuple(t[:100] for t in types[:50]),
                   raw["message"][:MESSAGE_CHARS], raw["observed"])


Rule = Callable[[Case, Outcome], "str | None"]
Driver = Callable[[Sequence[Callable[..., Any]], Sequence[Case], "Spec"], list[Outcome]]


def plain_outcome(value: Any, observed: Mapping[str, Any] | None = None) -> Outcome:
    """An ``Outcome`` for a returned ``value``; a value that is not plain data is an error."""
    try:
        value = _plain.roundtrip(value)
    except _plain.PlainDataError as exc:
        return Outcome(None, "PlainDataError", ("PlainDataError",),
                       f"returned something the check cannot read: {exc}", dict(observed or {}))
    return Outcome(value, observed=dict(observed or {}))


class CaseTimeout(Exception):
    """A case ran over its check's ``case_seconds``."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ``CaseTimeout`` in the block after ``seconds`` (CPU-bound Python code included:
    a timer signal, so on the main thread only; elsewhere no limit)."""
    import signal
    import threading

    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def alarm(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"this case ran over {seconds:g} s and was stopped")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def call_each(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
              ) -> list[Outcome]:
    """The default driver: ``fns[0](*case.args, **case.kwargs)`` for each case, watched (and
    stopped after ``spec.case_seconds``)."""
    outcomes = []
    for case in cases:
        with watch(spec.forbid, ops=spec.ops, functions=spec.names or spec.torch_only,
                   processes=spec.processes) as seen:
            try:
                with time_limit(spec.case_seconds):
                    value = fns[0](*case.args, **dict(case.kwargs))
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                error: BaseException | None = exc
            else:
                error = None
        outcomes.append(Outcome.of_error(error, seen.summary()) if error is not None
                        else plain_outcome(value, seen.summary()))
    return outcomes


@dataclass(frozen=True)
class Verdict:
    """The judgement of one check: cases passed, the first failure, the rules broken."""

    title: str
    passed: int
    total: int
    first: tuple[str, str] | None = None  # (case name, reason)
    not_done: bool = False
    broken: tuple[str, ...] = ()  # rules broken or references called, in words

    @property
    def ok(self) -> bool:
        return self.passed == self.total

    def line(self) -> str:
        return (f"{'PASS' if self.ok else 'FAIL'} {self.title}: {self.passed}/{self.total} "
                "cases passed")

    def message(self) -> str:
        if self.first is None:
            return self.line()
        name, reason = self.first
        return f"{self.line()}\nfirst failing case: {name}\n  {reason}"


@dataclass(frozen=True)
class Spec:
    """One check of an exercise (see the module docstring).

    ``build`` returns the cases (>= 5); ``drive`` runs the learner's ``functions`` (how many
    the check takes) on them; ``compare`` is the default comparison; ``rules`` each return a
    reason when an outcome took a forbidden shortcut; ``forbid`` lists the references
    (``"module:qualname"``) the learner's code must not call while it runs; ``ops`` turns the
    dispatcher recorder on, ``names`` the log of torch function names.  ``torch_only``: the
    rules read torch's operators, so moving tensor data out of torch (to numpy, Python lists
    or raw pointers) breaks a rule; ``processes``: the function may start processes (a
    DataLoader's workers); ``case_seconds``: each case is stopped (``CaseTimeout``) after
    that long, where a slower method than the exercise's would run for hours; ``gives``:
    library code the driver runs in the learner's process (a tool handed to the learner, or
    what sets the case up): a graded run withholds the labsim references of ``forbid``
    (``labsim.course.withhold``) except these, which the checks that forbid them then watch
    for.  Every check also holds the rules of ``outside_rule``: the work happens in the
    learner's function, on its thread, with nothing the graded run refuses.  A rule broken
    (or a reference called) on any case fails every case: a shortcut earns nothing.
    """

    title: str
    build: Callable[[], Sequence[Case]]
    drive: Driver = call_each
    compare: Callable[[Any, Any], str | None] | None = None
    rules: tuple[Rule, ...] = ()
    forbid: tuple[str, ...] = ()
    functions: int = 1
    ops: bool = True
    names: bool = False
    torch_only: bool = False
    processes: bool = False
    gives: tuple[str, ...] = ()
    case_seconds: float | None = None

    def cases(self) -> list[Case]:
        cases = list(self.build())
        if len(cases) < MIN_CASES:
            raise ValueError(f"check {self.title} has {len(cases)} cases; a check needs >= "
                             f"{MIN_CASES}")
        return cases

    def run(self, fns: Sequence[Callable[..., Any]], cases: Sequence[Case]) -> list[Outcome]:
        """The learner's side: outcomes of ``fns`` on the cases' inputs (never expected)."""
        inputs = [c.inputs() for c in cases]
        if len(fns) != self.functions or not all(callable(f) for f in fns):
            kinds = ", ".join(type(f).__name__ for f in fns)
            msg = (f"the check takes {self.functions} function(s), got {len(fns)} ({kinds}): "
                   "pass the function itself, e.g. check(my_fn) rather than check(my_fn())")
            return [Outcome(None, "TypeError", ("TypeError",), msg)] * len(inputs)
        outcomes = list(self.drive(fns, inputs, self))
        if len(outcomes) != len(inputs):  # pragma: no cover - a driver bug
            raise RuntimeError(f"{self.title}: {len(outcomes)} outcomes for {len(inputs)} cases")
        direct = passed_references(fns, self.forbid)
        if direct:  # the reference itself handed to the check
            outcomes = [replace(o, observed={**o.observed, "references": [
                *o.observed.get("references", []), *direct]}) for o in outcomes]
        return outcomes

    def judge(self, cases: Sequence[Case], outcomes: Sequence[Outcome]) -> Verdict:
        return judge(self, cases, outcomes)

    def __call__(self, *fns: Callable[..., Any]) -> None:
        """Run the check in this process: print the PASS line or raise ``CheckFailed``."""
        cases = self.cases()
        outcomes = [Outcome.from_plain(_plain.roundtrip(o.to_plain()))
                    for o in self.run(fns, cases)]
        verdict = judge(self, cases, outcomes)
        if verdict.ok:
            print(verdict.line())
            return
        kind = ExerciseNotDone if verdict.not_done else CheckFailed
        raise kind(verdict.message())


@dataclass(frozen=True)
class Hidden:
    """An instructor's private check for ``labsim grade --extra-checks``: its cases never
    enter the learner's sandbox with their expected values, and learners see only how many
    passed.

    ``functions``: the name(s) of the exercise function(s) it checks, as the lab defines them;
    ``cases``: at least five; ``like``: ``"labsim.checks.<topic>:<name>"`` of a public check
    whose driver, rules and forbidden references apply (its inputs must then have the form
    that check's cases have), else each case calls the function on its inputs;
    ``forbid``: more references the learner's code must not call.
    """

    name: str
    functions: tuple[str, ...] | str
    cases: Sequence[Case]
    points: float = 1.0
    compare: Callable[[Any, Any], str | None] | None = None
    like: str = ""
    forbid: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[\w.\-]+", self.name):
            raise ValueError(f"hidden check name {self.name!r}: letters, digits, . _ - only")
        if not all(n.isidentifier() for n in self.function_names) or not self.function_names:
            raise ValueError(f"hidden check {self.name}: functions must be Python names, got "
                             f"{self.functions!r}")
        if isinstance(self.points, bool) or not isinstance(self.points, (int, float)) or not (
                0 <= self.points < float("inf")):
            raise ValueError(f"hidden check {self.name}: points must be a number >= 0")

    @property
    def function_names(self) -> tuple[str, ...]:
        return (self.functions,) if isinstance(self.functions, str) else tuple(self.functions)

    def public(self) -> Spec | None:
        if not self.like:
            return None
        import importlib

        module, _, name = self.like.partition(":")
        spec = getattr(importlib.import_module(module), name, None)
        if not isinstance(spec, Spec):
            raise ValueError(f"hidden check {self.name}: like={self.like!r} is not a check")
        return spec

    def spec(self) -> Spec:
        """The check as the grader judges it."""
        like = self.public()
        cases = list(self.cases)
        return Spec(self.name, lambda: cases, drive=like.drive if like else call_each,
                    compare=self.compare or (like.compare if like else None),
                    rules=like.rules if like else (),
                    forbid=(like.forbid if like else ()) + tuple(self.forbid),
                    functions=len(self.function_names), ops=like.ops if like else True,
                    names=like.names if like else False,
                    torch_only=like.torch_only if like else False,
                    processes=like.processes if like else False,
                    gives=like.gives if like else (),
                    case_seconds=like.case_seconds if like else None)


def outside_rule(spec: Spec, out: Outcome) -> str | None:
    """The rules every check holds, from what ``watch`` saw outside the learner's operators
    (``_observe.outside_reason``: nothing the graded run's guard refused, no thread started
    or left running, no work on other threads), and, for a ``torch_only`` check, no tensor
    data handed to numpy, lists or pointers by the learner's code."""
    obs = out.observed if isinstance(out.observed, Mapping) else {}
    reason = outside_reason(obs)
    if reason is not None:
        return reason
    if spec.torch_only:
        left_torch = sorted(set(obs.get("functions") or ()) & LEAVES_TORCH)
        if left_torch:
            return (f"it moved tensor data out of torch (`Tensor.{left_torch[0]}`): this "
                    "exercise's rules are checked on torch's operators, so write it with "
                    "torch tensors")
    return None


def _error_reason(case: Case, out: Outcome) -> str | None:
    """None when the error is what the case expects, else the reason it fails."""
    cmp = case.compare
    expects = getattr(cmp, "expects_exception", None)
    if expects is not None:
        if expects.__name__ in out.error_types:
            return None
        return f"expected {expects.__name__} to be raised, got {out.error}"
    if out.error == "NotImplementedError":
        return NOT_DONE
    if out.error == "NotebookBusy":  # the collector's own refusal to run beside other work
        return "breaks a rule of this exercise: the check did not run: " + out.message
    message = out.message.splitlines()[0] if out.message else ""
    return f"raised {out.error}" + (f": {message}" if message else "")


def judge(spec: Spec, cases: Sequence[Case], outcomes: Sequence[Outcome]) -> Verdict:
    """Apply ``spec``'s rules and comparisons to the outcomes (one per case, same order)."""
    passed = 0
    first: tuple[str, str] | None = None
    broken: list[str] = []
    errors = 0
    reasons: list[tuple[Case, str]] = []
    for case, out in zip(cases, outcomes, strict=True):
        seen = out.observed.get("references") if isinstance(out.observed, Mapping) else None
        seen = [str(r) for r in seen or []]
        refs = [r for r in seen if not r.startswith(OUTSIDE)]
        broke = [r[len(OUTSIDE):] for r in seen if r.startswith(OUTSIDE)]
        reason: str | None = None
        withheld = "ReferenceWithheld" in out.error_types
        if refs or withheld:
            names = refs[:3] or [out.message.split(" is withheld", 1)[0][:100]]
            reason = ("calls labsim's own reference "
                      + ", ".join(f"`{r}`" for r in names)
                      + ": write the exercise yourself")
        elif broke:  # what a worker's watch saw outside the function, carried as a reference
            reason = "breaks a rule of this exercise: " + broke[0]
        else:
            reason = _broken(outside_rule, spec, out)
            if reason is None and out.error:
                reason = _error_reason(case, out)
                errors += out.error == "NotImplementedError"
            elif reason is None:
                expects = getattr(case.compare, "expects_exception", None)
                if expects is not None:
                    reason = f"expected {expects.__name__} to be raised, got a value"
        if reason is None and not out.error:
            for rule in spec.rules:
                reason = _broken(rule, case, out)
                if reason is not None:
                    break
            if reason is None:
                cmp = case.compare or spec.compare or close()
                try:
                    reason = cmp(out.value, case.expected)
                except Exception as exc:  # noqa: BLE001 - a value of the wrong kind fails
                    reason = f"returned a value that cannot be compared ({type(exc).__name__})"
        if reason is None:
            passed += 1
            continue
        reasons.append((case, reason))
        if reason.startswith(("calls labsim", "breaks a rule")) and _rule_key(reason) not in {
                _rule_key(b) for b in broken}:
            broken.append(reason)  # one per rule: the cases' numbers and lists differ
        if first is None:
            first = (case.name, reason)
    if broken:  # a shortcut on one case voids the others: they may pass by the same shortcut
        passed = 0
        first = next((c.name, r) for c, r in reasons if r in broken)
    return Verdict(spec.title, passed, len(cases), first,
                   not_done=passed == 0 and errors == len(cases), broken=tuple(broken))


def _broken(rule: Callable[..., str | None], *args: Any) -> str | None:
    """``rule(*args)``'s reason as a broken rule (observations it cannot read break it too)."""
    try:
        reason = rule(*args)
    except Exception as exc:  # noqa: BLE001 - malformed observations fail the case
        reason = f"its observations could not be read ({type(exc).__name__})"
    return None if reason is None else "breaks a rule of this exercise: " + reason


def _rule_key(reason: str) -> str:
    """A broken rule's reason without what differs from case to case (numbers, the lists in
    parentheses): one review flag per rule."""
    return re.sub(r"\([^)]*\)|\[[^\]]*\]|`[^`]*`|[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", "#",
                  reason)


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
                f"{where}keys {_short(sorted(map(str, got)))} instead of "
                f"{sorted(map(str, expected))}"
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
            None if got == expected and type(got) is type(expected)
            else f"{where}{_short(got)} instead of {_short(expected)}"
        )
    if isinstance(expected, (int, float)):
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            if _as_float_list(got) is None or getattr(got, "shape", None) != ():
                return f"{where}expected a number, got {type(got).__name__}"
        try:
            g = float(got)
        except (TypeError, ValueError, OverflowError):
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
    """Use as ``compare`` for a case that must raise ``kind`` (or a subclass)."""

    def compare(got: Any, expected: Any) -> str | None:
        return f"expected {kind.__name__} to be raised, got {_short(got)}"

    compare.expects_exception = kind  # type: ignore[attr-defined]
    return compare


def run_check(title: str, fn: Callable[..., Any], cases: Sequence[Case], *,
              compare: Callable[[Any, Any], str | None] | None = None) -> None:
    """One-off check of ``fn`` on ``cases`` (for notebooks and instructors' own checks): the
    same as ``Spec(title, lambda: cases, compare=compare)(fn)``."""
    Spec(title, lambda: cases, compare=compare, ops=False)(fn)


__all__ = ["SUMMARY_RE", "Case", "CaseTimeout", "CheckFailed", "ExerciseNotDone", "Hidden",
           "Outcome", "Spec", "Verdict", "call_each", "close", "equal", "judge",
           "outside_rule", "plain_outcome", "raises", "run_check", "time_limit"]
