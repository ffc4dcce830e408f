"""What every multi-process check shares: fail at once on a stub, launch one worker driver for
all cases, guard each learner call, and turn per-case results into ``Case`` rows.

A check is three small parts kept apart so that each can move: the cases (plain inputs), a
driver that runs the learner's code on real processes and returns plain tensors and numbers
per case (or the error the case raised), and the comparison with expected values computed in
the checking process (``check_outcomes``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from labsim.checks._core import Case, CheckFailed, run_check
from labsim.lab.launcher import LaunchTimeout, WorkerError, launch

Compare = Callable[[Any, Any], str | None]


def fail_if_stub(title: str, n_cases: int, *probes: Callable[[], Any]) -> None:
    """Raise ``CheckFailed`` (no processes started) when a probe raises
    NotImplementedError: the exercise is still the released stub.  Other errors are expected
    (no process group in the checking process) and ignored."""
    for probe in probes:
        try:
            probe()
        except NotImplementedError:
            raise CheckFailed(f"FAIL {title}: 0/{n_cases} cases passed\nthe exercise raises "
                              "NotImplementedError: write it first") from None
        except Exception:  # noqa: BLE001 - expected: no process group in this process
            pass


def run_workers(title: str, n_cases: int, driver: Callable[..., Any], nprocs: int,
                args: tuple, timeout_s: float) -> tuple[Any, ...]:
    """One launch of ``driver`` on ``nprocs`` gloo processes; a hang or a crash is a FAIL
    of every case, with the worker's traceback."""
    try:
        return launch(driver, nprocs, args=args, timeout_s=timeout_s).values
    except (LaunchTimeout, WorkerError) as exc:
        raise CheckFailed(f"FAIL {title}: 0/{n_cases} cases passed\n{exc}") from None


def guard(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or the error it raised as a picklable exception (a learner's bug is a
    failed case, not a crashed worker)."""
    try:
        return fn(*args)
    except NotImplementedError:
        return NotImplementedError("the exercise raised NotImplementedError")
    except Exception as exc:  # noqa: BLE001 - reported as the case's outcome
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def check_outcomes(title: str, rows: Sequence[tuple[str, Any, Any, Compare]]) -> None:
    """``run_check`` over results computed already: each row is (case name, got, expected,
    compare); a ``got`` that is an exception fails its case with that error."""
    def value(i: int) -> Any:
        got = rows[i][1]
        if isinstance(got, BaseException):
            raise got
        return got

    run_check(title, value, [Case(name, (i,), expected=exp, compare=cmp)
                             for i, (name, _, exp, cmp) in enumerate(rows)])


def reference_codes(*owners: Any, names: Sequence[str] | None = None) -> dict[Any, str]:
    """The code objects of the functions and methods defined in ``owners`` (modules or
    classes; only ``names`` if given), mapped to their qualified names: what a learner's
    exercise must not call (``calls``)."""
    import inspect

    codes: dict[Any, str] = {}
    for owner in owners:
        for name, obj in vars(owner).items():
            if names is not None and name not in names:
                continue
            if isinstance(obj, staticmethod):
                obj = obj.__func__
            if inspect.isfunction(obj):
                if getattr(owner, "__name__", "") == obj.__module__ or inspect.isclass(owner):
                    codes[obj.__code__] = f"{obj.__module__}.{obj.__qualname__}"
            elif inspect.isclass(obj) and obj.__module__ == getattr(owner, "__name__", ""):
                codes.update(reference_codes(obj))
    return codes


def calls(codes: dict[Any, str], fn: Callable[..., Any], *args: Any) -> tuple[Any, set[str]]:
    """``fn(*args)`` and the names of the ``codes`` it entered (seen by a profile hook, so
    an alias or a wrapper does not hide a call)."""
    import sys

    entered: set[str] = set()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            entered.add(codes[frame.f_code])

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(previous)
    return result, entered
