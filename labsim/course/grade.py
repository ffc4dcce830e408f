"""Grade a class: every submission of one lab -> one CSV row and one feedback file each.

For each submission ``grade`` rebuilds the notebook from the released lab (``rebuild``), runs
it under nbval in a sandboxed process with its own kernel (``sandbox``), and scores each
check from what nbval saw:

- a check cell that nbval passes (it printed exactly the stored PASS line) earns its points;
- a check that raised ``CheckFailed`` earns ``points * passed / cases`` from its
  ``FAIL name: k/n cases passed`` line (``labsim.checks.SUMMARY_RE``), only when the name and
  the number of cases are those of the release;
- anything else (an error before the check could run, other printed output, a cell never
  reached because of a time limit or a dead kernel) earns 0, with the reason in words.

Status of a row: ``invalid`` (not a readable notebook of this lab), ``crashed`` (the kernel
died), ``timeout`` (a cell or the whole notebook ran over its limit), ``tampered`` (check cells,
their stored outputs or narrative differ from the release; graded with the released ones),
else ``ok``.  One row per submission, in the order given, whatever ``jobs`` is; the CSV is
written atomically at the end.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import nbformat

from labsim.checks._core import SUMMARY_RE
from labsim.course import notebook as nbk
from labsim.course import rebuild as rb
from labsim.course import sandbox as sb
from labsim.course.feedback import csv_text, feedback_names, feedback_text, write_csv

__all__ = ["CheckScore", "Options", "Report", "Result", "csv_text", "grade", "write_csv"]

STATUSES = ("ok", "tampered", "timeout", "crashed", "invalid")
MAX_SUBMISSION_BYTES = 50_000_000


@dataclass(frozen=True)
class CheckScore:
    """Score of one check for one submission; ``detail`` is safe to show the learner."""

    check: rb.Check
    score: float
    passed: bool
    detail: str


@dataclass(frozen=True)
class Result:
    """The grade of one submission."""

    submission: str
    status: str
    scores: tuple[CheckScore, ...]
    reasons: tuple[str, ...]
    notes: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    wall_s: float = 0.0

    @property
    def total(self) -> float:
        return sum(s.score for s in self.scores)

    @property
    def maximum(self) -> float:
        return sum(s.check.points for s in self.scores)


@dataclass(frozen=True)
class Report:
    """What a grading run produced: one result per submission, in input order."""

    lab: str
    checks: tuple[rb.Check, ...]
    results: tuple[Result, ...]
    warnings: tuple[str, ...]
    wall_s: float

    def __repr__(self) -> str:
        counts = {s: sum(r.status == s for r in self.results) for s in STATUSES}
        shown = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        return (f"Report({self.lab}: {len(self.results)} submissions ({shown}), "
                f"{self.wall_s:.1f} s)")


def _fmt(x: float) -> str:
    return f"{round(x, 2):g}"


def score_check(check: rb.Check, record: sb.CellRecord | None, why_not_run: str) -> CheckScore:
    """Score one check from the grader's record of its cell (None: the cell never ran)."""
    if record is None:
        return CheckScore(check, 0.0, False, f"not run: {why_not_run}")
    error = record.error
    printed = record.stdout.strip()
    if error is None and record.outcome == "passed":
        match = SUMMARY_RE.fullmatch(printed)
        if not check.hidden or (
            match and match["status"] == "PASS" and match["passed"] == match["total"]
        ):
            return CheckScore(check, check.points, True, "passed")
    if "Timeout of" in record.message:
        return CheckScore(check, 0.0, False, "interrupted: it ran over the cell time limit")
    if error is not None and error.ename == "CheckFailed":
        first, _, rest = error.evalue.partition("\n")
        match = SUMMARY_RE.fullmatch(first.strip())
        if match and match["status"] == "FAIL" and _same_check(check, match):
            passed, total = int(match["passed"]), int(match["total"])
            detail = f"{passed}/{total} cases passed"
            if check.hidden:
                detail += " (the cases of hidden checks are not shown)"
            elif rest.strip():
                detail += "\n" + rest.strip()
            return CheckScore(check, check.points * passed / total, False, detail)
    if error is not None:
        if check.hidden:
            return CheckScore(check, 0.0, False, f"the check could not run ({error.ename})")
        first = error.evalue.splitlines()[:1]
        what = error.ename + (f": {first[0][:300]}" if first else "")
        return CheckScore(check, 0.0, False, f"the check could not run: {what}")
    if not printed:
        return CheckScore(
            check, 0.0, False,
            "the check printed nothing (expected its PASS line); does code in an exercise "
            "cell hide error messages or printed output?",
        )
    return CheckScore(
        check, 0.0, False,
        "the check printed something besides its PASS line; remove print calls from your "
        "functions",
    )


def _same_check(check: rb.Check, match: re.Match) -> bool:
    passed, total = int(match["passed"]), int(match["total"])
    if total == 0 or not 0 <= passed <= total:
        return False
    return check.hidden or (check.cases == total and check.name.split("#")[0] == match["title"])


def score_run(
    rebuilt: rb.Rebuilt, run: sb.RunRecord, limits: sb.Limits
) -> tuple[str, list[CheckScore], list[str]]:
    """Status, per-check scores and reasons (in words) from one sandboxed run."""
    records = {r.cell: r for r in run.cells}
    status, stop, reasons = "ok", "", []
    code_errors = 0
    last = -1  # the last cell whose record counts
    for number, cell in enumerate(rebuilt.cells):
        record = records.get(number)
        if record is None:
            break
        message = record.message
        if record.phase == "setup":
            status, last = "crashed", number - 1
            stop = "the kernel could not start: " + (message.splitlines() or ["no message"])[0]
            reasons.append(stop)
            break
        if "Timeout of" in message:
            status = "timeout"
            reasons.append(
                f"{cell.label} ran over the {_fmt(limits.cell_s)} s cell limit and was stopped"
            )
            if not record.kernel_alive:
                reasons[-1] += "; it ignored the interrupt, so the kernel was stopped"
                last, stop = number, f"the kernel was stopped after {cell.label} ran too long"
                break
        elif record.error_kind == "KernelDied" or not record.kernel_alive:
            status = "crashed"
            stop = f"the kernel died in {cell.label}"
            reasons.append(f"{stop} (os._exit, a crash such as a segfault, or out of memory)")
            last = number
            break
        elif cell.role in ("exercise", "code") and record.outcome != "passed":
            error = record.error
            # an unfinished exercise (NotImplementedError) is reported by its checks
            if error is not None and error.ename != "NotImplementedError":
                if cell.role == "exercise" or not code_errors:
                    first = error.evalue.splitlines()[:1]
                    reasons.append(
                        f"{cell.label} raised {error.ename}"
                        + (f": {first[0][:200]}" if first else "")
                    )
                code_errors += cell.role == "code"
        last = number
    if code_errors > 1:
        reasons.append(f"{code_errors - 1} more code cell(s) raised errors")
    if not stop and last + 1 < len(rebuilt.cells):
        where = rebuilt.cells[last + 1].label
        if run.notebook_timed_out:
            status = "timeout"
            stop = f"the notebook ran over its {_fmt(limits.notebook_s)} s limit (in {where})"
        else:
            status = "crashed"
            stop = (f"the run stopped before {where} (the nbval process exited with code "
                    f"{run.returncode}; rerun with --keep-runs DIR to see its log)")
        reasons.append(stop)
    scores = []
    cell_of = {c.check: n for n, c in enumerate(rebuilt.cells) if c.check is not None}
    for index, check in enumerate(rebuilt.checks):
        number = cell_of[index]
        record = records.get(number) if number <= last else None
        scores.append(score_check(check, record, stop or "not reached"))
    return status, scores, reasons


@dataclass(frozen=True)
class Options:
    """How to grade: limits, parallel jobs, extra checks and where feedback goes."""

    limits: sb.Limits = sb.Limits()
    jobs: int = 1
    extra: rb.ExtraChecks | None = None
    feedback_dir: Path | None = None
    keep_dir: Path | None = None  # keep each run's working folder here (for debugging)
    work_dir: Path | None = None  # where runs' working folders go (default: system temp)

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {self.jobs}")


def _invalid(name: str, checks: Sequence[rb.Check], reason: str) -> Result:
    scores = tuple(CheckScore(c, 0.0, False, "not graded") for c in checks)
    return Result(name, "invalid", scores, (reason,))


def _read_submission(path: Path) -> tuple[object | None, str]:
    """(notebook, "") or (None, why it cannot be graded); reads the file once, never writes."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        return None, f"cannot read the file: {exc.strerror or exc}"
    if size > MAX_SUBMISSION_BYTES:
        limit_mb = MAX_SUBMISSION_BYTES // 10**6
        return None, f"the file is {size / 1e6:.0f} MB, over the {limit_mb} MB limit"
    try:
        nb = nbk.read(path)
    except nbk.NotebookError as exc:
        return None, str(exc).removeprefix(f"{path}: ")
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as exc:
        return None, f"not a valid notebook: {str(exc.message).splitlines()[0][:200]}"
    return nb, ""


def grade_one(
    lab: rb.ReleasedLab, name: str, sub: object | None, problem: str, options: Options,
    box: sb.Sandbox, ports: Callable[[], list[int]], threads: int, workroot: Path,
    cancel: threading.Event | None = None,
) -> Result:
    """Grade one submission (already read); never raises for anything in the submission."""
    checks = lab.checks + (options.extra.checks if options.extra else ())
    if sub is None:
        return _invalid(name, checks, problem)
    if not rb.is_this_lab(lab, sub):
        return _invalid(name, checks, f"no cell or exercise of {lab.path.name} in it (wrong lab?)")
    rebuilt = rb.rebuild(lab, sub, options.extra)
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=workroot))
    try:
        run = sb.run_notebook(nbk.dumps(rebuilt.notebook), workdir, options.limits, box,
                              ports(), threads, cancel)
    finally:
        if options.keep_dir is not None:
            keep = Path(options.keep_dir) / feedback_names([name])[0].removesuffix(".txt")
            shutil.copytree(workdir, keep, dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    status, scores, reasons = score_run(rebuilt, run, options.limits)
    if rebuilt.tampering:
        reasons = [*reasons, "changed from the release (the released cells were used): "
                   + "; ".join(rebuilt.tampering)]
        if status == "ok":
            status = "tampered"
    return Result(name, status, tuple(scores), tuple(reasons), rebuilt.notes, rebuilt.flags,
                  run.wall_s)


def grade(lab_path: Path, submissions: Sequence[Path], options: Options = Options(),
          box: sb.Sandbox | None = None) -> Report:
    """Grade every submission of one released lab (see the module docstring)."""
    start = time.monotonic()
    lab = rb.read_lab(lab_path)
    box = box if box is not None else sb.probe()
    names = [str(p) for p in submissions]
    read = [_read_submission(Path(p)) for p in submissions]  # all read before any run
    pool = sb.PortPool()
    lock = threading.Lock()
    cancel = threading.Event()

    def ports() -> list[int]:
        with lock:
            return pool.take()

    threads = max(1, (os.cpu_count() or 1) // options.jobs)
    if options.work_dir is not None:
        Path(options.work_dir).mkdir(parents=True, exist_ok=True)
    workroot = Path(tempfile.mkdtemp(prefix="labsim-grade-", dir=options.work_dir))
    fb_names = feedback_names(submissions)
    if options.feedback_dir is not None:
        Path(options.feedback_dir).mkdir(parents=True, exist_ok=True)

    def one(i: int) -> Result:
        try:
            result = grade_one(lab, names[i], read[i][0], read[i][1], options, box, ports,
                               threads, workroot, cancel)
        except Exception as exc:  # noqa: BLE001 - one bad submission never stops the class
            checks = lab.checks + (options.extra.checks if options.extra else ())
            result = Result(names[i], "crashed",
                            tuple(CheckScore(c, 0.0, False, "not graded") for c in checks),
                            (f"the grader failed on this submission: {type(exc).__name__}: "
                             f"{exc}",))
        if options.feedback_dir is not None:
            nbk.write_atomic(Path(options.feedback_dir) / fb_names[i],
                             feedback_text(lab.path.stem, result))
        return result

    executor = ThreadPoolExecutor(max_workers=options.jobs)
    try:
        results = tuple(executor.map(one, range(len(names))))
    except BaseException:  # Ctrl-C: stop the running notebooks, start no more
        cancel.set()
        raise
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(workroot, ignore_errors=True)
    checks = lab.checks + (options.extra.checks if options.extra else ())
    return Report(lab.path.stem, checks, results, box.warnings, time.monotonic() - start)
