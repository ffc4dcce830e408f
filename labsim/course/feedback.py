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
        if state in ("fail", "waiting", "not run"):
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


def learner_ids(paths: Sequence[Path | str], lab: str,
                metadata: Sequence[str] = ()) -> list[str]:
    """Who each submission is from: the notebook's ``metadata.labsim.learner`` when it has
    one (``metadata``, same order; "" when not), else the file name without the lab's name
    (``alice_02_mixed_precision.ipynb`` -> ``alice``), else the folder holding it
    (``alice/02_mixed_precision.ipynb`` -> ``alice``)."""
    rel = _relative(paths)
    out = []
    for i, name in enumerate(rel):
        given = metadata[i] if i < len(metadata) else ""
        if given:
            out.append(given)
            continue
        path = Path(name)
        stem = path.stem[:-len(".ipynb")] if path.stem.endswith(".ipynb") else path.stem
        rest = re.sub(rf"[\s_\-.]*{re.escape(lab)}[\s_\-.]*", " ", stem, flags=re.I).strip()
        rest = re.sub(r"\s+", "_", rest)
        if not rest and len(path.parts) > 1:
            rest = path.parts[-2]
        out.append(rest or stem)
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
    writer.writerow(["submission", "learner", "status", *[c.name for c in report.checks],
                     "total", "max", "not_attempted", "reason", "review", "sandbox"])
    for r in report.results:
        todo = [s.check.name for s in r.scores if getattr(s, "state", "") == "not attempted"]
        writer.writerow([
            _cell(r.submission), _cell(getattr(r, "learner", "")), r.status,
            *[_fmt(s.score) for s in r.scores], _fmt(r.total), _fmt(r.maximum),
            _cell(" ".join(todo)), _cell("; ".join(r.reasons)), _cell("; ".join(r.flags)),
            _cell(r.sandbox),
        ])
    return buf.getvalue()


LMS_FORMATS = ("canvas", "moodle", "gradescope")


def lms_text(report: Any, kind: str) -> str:
    """The class's totals as a gradebook import: ``canvas`` (Canvas's gradebook CSV: Student,
    ID, SIS User ID, SIS Login ID, Section, then the lab, with a "Points Possible" row),
    ``moodle`` (Moodle's grade import: username, the lab's grade, feedback) or
    ``gradescope`` (Gradescope's score upload: Name, SID, Email, Total Score).  Learners are
    identified by the ``learner`` column (``learner_ids``)."""
    if kind not in LMS_FORMATS:
        raise ValueError(f"unknown gradebook format {kind!r}: use one of "
                         f"{', '.join(LMS_FORMATS)}")
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    maximum = report.results[0].maximum if report.results else 0.0
    if kind == "canvas":
        writer.writerow(["Student", "ID", "SIS User ID", "SIS Login ID", "Section",
                         report.lab])
        writer.writerow(["Points Possible", "", "", "", "", _fmt(maximum)])
        for r in report.results:
            who = _cell(getattr(r, "learner", "") or r.submission)
            writer.writerow([who, "", "", who, "", _fmt(r.total)])
    elif kind == "moodle":
        writer.writerow(["username", report.lab, "feedback"])
        for r in report.results:
            who = _cell(getattr(r, "learner", "") or r.submission)
            note = f"{r.status}; {sum(s.passed for s in r.scores)}/{len(r.scores)} checks pass"
            writer.writerow([who, _fmt(r.total), note])
    else:
        writer.writerow(["Name", "SID", "Email", "Total Score"])
        for r in report.results:
            who = _cell(getattr(r, "learner", "") or r.submission)
            writer.writerow([who, who, "", _fmt(r.total)])
    return buf.getvalue()


def summary_text(report: Any) -> str:
    """The class at a glance: submissions by status, the score distribution, and per check
    how many passed, failed or did not attempt it (hardest first)."""
    results = report.results
    n = len(results)
    lines = [f"Lab {report.lab}: {n} submission(s)"]
    if not n:
        return lines[0] + "\n"
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    lines.append("status: " + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())))
    totals = sorted(r.total for r in results)
    maximum = results[0].maximum
    mean = sum(totals) / n
    median = totals[n // 2] if n % 2 else (totals[n // 2 - 1] + totals[n // 2]) / 2
    full = sum(t == maximum for t in totals)
    lines.append(f"score out of {_fmt(maximum)}: mean {_fmt(mean)}, median {_fmt(median)}, "
                 f"min {_fmt(totals[0])}, max {_fmt(totals[-1])}; full marks {full} of {n}")
    lines += ["", f"{'check':28} {'pass':>5} {'share':>6} {'fail':>5} {'not attempted':>14}"]
    rows = []
    for i, check in enumerate(report.checks):
        scores = [r.scores[i] for r in results if i < len(r.scores)]
        passed = sum(s.passed for s in scores)
        todo = sum(getattr(s, "state", "") == "not attempted" for s in scores)
        rows.append((passed / max(1, len(scores)), check.name, passed,
                     len(scores) - passed - todo, todo))
    for rate, name, passed, failed, todo in sorted(rows):
        lines.append(f"{name[:28]:28} {passed:>5} {rate:>6.0%} {failed:>5} {todo:>14}")
    flagged = [r.submission for r in results if r.flags]
    if flagged:
        lines += ["", f"worth a look by hand (review column): {len(flagged)}"]
    return "\n".join(lines) + "\n"


def write_csv(report: Any, path: Path) -> None:
    """Write the CSV atomically (a reader never sees a half-written file)."""
    nbk.write_atomic(Path(path), csv_text(report))
