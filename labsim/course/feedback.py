"""The feedback file a learner reads: score, each check, the first failing case, in words.

Hidden (instructor-private) checks show only how many of their cases passed, never a case
or an expected value.
"""

from __future__ import annotations

from typing import Any

INTRO = {
    "ok": "Your notebook ran to the end.",
    "tampered": (
        "Your notebook ran to the end. Some cells that are not exercises were changed (see "
        "below); the grader always runs the released version of those cells, so the changes "
        "did not affect your score."
    ),
    "timeout": "Your notebook ran over a time limit; cells after that point were not graded.",
    "crashed": (
        "The Python kernel running your notebook stopped (a crash, os._exit or sys.exit-like "
        "call, or too much memory); checks after that point were not graded."
    ),
    "invalid": "Your file could not be graded.",
}


def _fmt(x: float) -> str:
    return f"{round(x, 2):g}"


def _indent(text: str, prefix: str = "      ") -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def feedback_text(lab: str, result: Any) -> str:
    """Plain-text feedback for one ``grade.Result``."""
    lines = [
        f"Lab: {lab}",
        f"Submission: {result.submission}",
        f"Score: {_fmt(result.total)} / {_fmt(result.maximum)}",
        f"Status: {result.status}",
        "",
        INTRO.get(result.status, ""),
        "",
        "Checks:",
    ]
    for s in result.scores:
        pts = f"{_fmt(s.score)}/{_fmt(s.check.points)} point{'s' if s.check.points != 1 else ''}"
        kind = "hidden check" if s.check.hidden else "check"
        mark = "PASS" if s.passed else "FAIL"
        lines.append(f"  {mark}  {kind} {s.check.name} ({pts})")
        if not s.passed:
            lines.append(_indent(s.detail))
    if result.reasons or result.notes:
        lines += ["", "What the grader noticed:"]
        lines += [f"  - {r}" for r in (*result.reasons, *result.notes)]
    lines += [
        "",
        "How to improve: open the notebook, run it from the top (Kernel > Restart and Run "
        "All), and fix the first check that fails; each check names its first failing case.",
    ]
    return "\n".join(lines) + "\n"
