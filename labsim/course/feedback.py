"""What grading writes: the class CSV and the feedback file each learner reads.

Feedback gives the score, each check, the first failing case, in words.  Hidden
(instructor-private) checks show only how many of their cases passed, never a case or an
expected value.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from labsim.course import notebook as nbk

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


MARKS = {"pass": "PASS", "fail": "FAIL", "not attempted": "TODO", "waiting": "WAIT",
         "not run": "----"}


def feedback_text(lab: str, result: Any) -> str:
    """Plain-text feedback for one ``grade.Result``."""
    full = result.status in ("ok", "tampered") and result.total == result.maximum > 0
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
        state = getattr(s, "status", "pass" if s.passed else "fail")
        lines.append(f"  {MARKS.get(state, 'FAIL')}  {kind} {s.check.name} ({pts})"
                     + ("" if state in ("pass", "fail") else f": {state}"))
        if state == "fail" or state == "waiting":
            lines.append(_indent(s.detail))
    broken = [s for s in result.scores if s.flags]
    if result.reasons or result.notes or broken:
        lines += ["", "What the grader noticed:"]
        lines += [f"  - {r}" for r in (*result.reasons, *result.notes)]
        lines += [f"  - check {s.check.name}: a rule of the exercise was broken (see above); "
                  "it earns 0" for s in broken]
    if full:
        lines += ["", "Full marks: every check passed. Well done."]
    else:
        todo = [s.check.name for s in result.scores if not s.passed]
        lines += [
            "",
            f"Next: {todo[0]}. " if todo else "",
        ]
        lines[-1] += ("Open the notebook, run it from the top (Kernel > Restart and Run All), "
                      "and fix the first check that fails; each check names its first failing "
                      "case. `labsim check NOTEBOOK` (or the notebook's last cell) checks the "
                      "whole notebook the way the grader does.")
    return "\n".join(lines) + "\n"


def _slug(name: str) -> str:
    stem = name[:-6] if name.endswith(".ipynb") else name
    return re.sub(r"[^\w.\-]+", "_", stem.replace(os.sep, "__")).strip("_") or "submission"


def _relative(paths: Sequence[Path | str]) -> list[str]:
    """Submission paths relative to the folder that holds them all."""
    if not paths:
        return []
    parents = [os.path.abspath(Path(p).parent) for p in paths]
    common = os.path.commonpath(parents)
    return [os.path.relpath(os.path.abspath(p), common) for p in paths]


def feedback_names(paths: Sequence[Path | str]) -> list[str]:
    """A distinct feedback file name per submission, from its path relative to the folder
    holding them all (``alice/00_roofline.ipynb`` -> ``alice__00_roofline.txt``)."""
    out, seen = [], set()
    for name in _relative(paths):
        base = _slug(name)
        cand, n = base, 1
        while cand in seen:
            n += 1
            cand = f"{base}-{n}"
        seen.add(cand)
        out.append(cand + ".txt")
    return out


def _cell(text: str) -> str:
    """A CSV cell safe to open in a spreadsheet: no formula (=, +, -, @ first) runs."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def csv_text(report: Any) -> str:
    """The CSV of a ``grade.Report``: submission, status, one column per check, total, max,
    reason, review (what is worth a look by hand: rules broken, references called, tools
    used), sandbox (the protections this run lacked; empty when it had all of them)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["submission", "status", *[c.name for c in report.checks], "total", "max",
                     "reason", "review", "sandbox"])
    for r in report.results:
        writer.writerow([
            _cell(r.submission), r.status, *[_fmt(s.score) for s in r.scores], _fmt(r.total),
            _fmt(r.maximum), _cell("; ".join(r.reasons)), _cell("; ".join(r.flags)),
            _cell(r.sandbox),
        ])
    return buf.getvalue()


def write_csv(report: Any, path: Path) -> None:
    """Write the CSV atomically (a reader never sees a half-written file)."""
    nbk.write_atomic(Path(path), csv_text(report))
