"""Grade a class: every submission of one lab -> one CSV row and one feedback file each.

For each submission ``grade`` rebuilds the notebook from the released lab (``rebuild``: the
learner's exercise cells and the cells they added, and a collector cell in place of each check
cell), runs it in a sandbox (``sandbox``) against the graded copy of labsim (``withhold``: the
lab's references withheld) and scores each check **from the grader's own comparisons**:

- the cases of every check are built here, once, with labsim's reference or oracle
  (``Spec.cases()``); only their names and inputs are sent into the sandbox, each check's
  while its collector runs;
- the collector cell runs the check's driver on those inputs and writes each case's outcome
  as plain data (never pickle); the grader takes it only as the finished collector left it
  (``records.digest_problem``), and the judging process (``judge``) decodes it under a budget
  and judges it with the check's rules and comparisons (``Spec.judge``);
- a check earns ``points * passed / cases``; a rule broken or a reference called earns 0 and
  is named in the ``review`` column; a check whose results are missing (the exercise is
  missing, the kernel died, a time limit) earns 0, with the reason in words; a check whose
  exercise is the released stub is ``not attempted``.

Nothing the learner's process prints, raises or writes decides a score: the text nbval saw
only explains the status and the reasons (``records.CellRecord``), cut to a short sanitised
excerpt.  Status of a row: ``invalid`` (not a readable notebook of this lab), ``crashed`` (the
kernel died), ``timeout`` (a cell or the whole notebook ran over its limit), ``tampered``
(check cells or narrative differ from the release; the released ones were graded), else
``ok``.  One row per submission, in the order given, whatever ``jobs`` is (or the Dask
cluster: ``distributed``); the CSV is written atomically at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from labsim.checks import Spec, _plain
from labsim.checks._core import Verdict
from labsim.checks._observe import reference_codes
from labsim.course import notebook as nbk
from labsim.course import rebuild as rb
from labsim.course import sandbox as sb
from labsim.course import withhold
from labsim.course.feedback import (
    csv_text,
    feedback_names,
    feedback_text,
    learner_ids,
    write_csv,
)
from labsim.course.judge import Judge
from labsim.course.records import (
    CellRecord,
    digest_problem,
    read_records,
    sanitize,
)
from labsim.course.submission import read_submission

__all__ = ["CheckScore", "Options", "Report", "Result", "csv_text", "grade", "write_csv"]

STATUSES = ("ok", "tampered", "timeout", "crashed", "invalid")


@dataclass(frozen=True)
class CheckScore:
    """Score of one check for one submission; ``detail`` is grader-composed text, safe to
    show the learner; ``flags`` go to the review column.  ``state`` in a word: ``pass``,
    ``fail``, ``not attempted`` (its exercise is the released stub), ``waiting`` (its
    exercise is written but calls one that is not), ``not run`` (the run stopped before it);
    ``first`` is the first failing case's (name, reason) of a public check."""

    check: rb.Check
    score: float
    passed: bool
    detail: str
    flags: tuple[str, ...] = ()
    state: str = ""
    first: tuple[str, str] | None = None

    @property
    def status(self) -> str:
        return self.state or ("pass" if self.passed else "fail")


@dataclass(frozen=True)
class Result:
    """The grade of one submission (``sandbox``: what the sandbox could not provide)."""

    submission: str
    status: str
    scores: tuple[CheckScore, ...]
    reasons: tuple[str, ...]
    notes: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    wall_s: float = 0.0
    sandbox: str = ""
    learner: str = ""  # who it is from (``feedback.learner_ids``)

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


@dataclass
class Expectations:
    """The cases of every check of a grading run, built once in the grader's process, and
    the files that carry their *inputs* (never their expected values) into each run."""

    checks: tuple[rb.Check, ...]
    specs: list[Spec] = field(default_factory=list)
    cases: list[list[Any]] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)  # into every run's in/
    inputs: dict[str, bytes] = field(default_factory=dict)  # held by nbval until a check runs
    forbidden: list[set[str]] = field(default_factory=list)
    judge: Any = None  # a ``judge.Judge``: results are decoded and judged in its process

    @classmethod
    def build(cls, checks: Sequence[rb.Check]) -> Expectations:
        from labsim.course.release import resolve_check

        self = cls(tuple(checks))
        entries = []
        for i, check in enumerate(checks):
            if check.extra is not None:
                spec = check.extra.spec()
                entries.append({"title": check.name, "driver": check.extra.like or None,
                                "functions": len(check.functions),
                                "forbid": list(check.extra.forbid)})
            else:
                spec = resolve_check(check.spec, f"check `{check.name}`")
                entries.append({"title": check.name, "driver": check.spec,
                                "functions": len(check.functions), "forbid": []})
            cases = spec.cases()
            if not check.hidden and check.cases and len(cases) != check.cases:
                raise ValueError(f"check {check.name}: the release expects {check.cases} cases, "
                                 f"labsim's check has {len(cases)}; release the lab again")
            text, blob = _plain.encode([[c.name, tuple(c.args), dict(c.kwargs)] for c in cases])
            self.inputs[f"check-{i}.json"], self.inputs[f"check-{i}.bin"] = text.encode(), blob
            self.specs.append(spec)
            self.cases.append(cases)
            self.forbidden.append(set(reference_codes(spec.forbid).values()))
        self.files["checks.json"] = json.dumps(entries).encode()
        return self

    def exports(self) -> tuple[str, ...]:
        names = [f"check-{i}.{ext}" for i in range(len(self.checks)) for ext in ("json", "bin")]
        return (*names, "exercises.json", "exercises.bin")

    def withheld(self) -> list[str]:
        """What the graded copy withholds: the labsim targets the checks of the run forbid,
        but for what a check's driver needs in the learner's process (``Spec.gives``)."""
        from labsim.checks._observe import expand

        forbid = {t for s in self.specs for raw in s.forbid if raw.startswith("labsim.")
                  for t in expand(raw)}
        gives = {t for s in self.specs for raw in s.gives for t in expand(raw)}
        return sorted(forbid - gives)

    def kernel_config(self, rebuilt: rb.Rebuilt) -> bytes:
        forbid = sorted({t for s in self.specs for t in s.forbid})
        hashes = [hashlib.sha256(src.encode()).hexdigest() for src in rebuilt.exercise_sources]
        released = sorted({hashlib.sha256(src.encode()).hexdigest()
                           for src in rebuilt.released_sources})
        return json.dumps({"exercise_hashes": hashes, "forbid": forbid,
                           "released": released}).encode()


def _flag(reason: str) -> str:
    """A review flag from a broken rule's reason: the rule ("breaks a rule of this exercise:
    RULE") or the reference named ("calls labsim's own reference `X`")."""
    if reason.startswith("calls labsim"):
        return sanitize(reason.split(": write", 1)[0], 120)
    return sanitize(reason.split(": ", 1)[-1], 100)


def judge_check(index: int, check: rb.Check, exp: Expectations, out_dir: Path,
                record: CellRecord | None, why_not_run: str) -> CheckScore:
    """Score one check from the outcomes its collector wrote (see the module docstring)."""
    stem = f"check-{index}"
    if record is not None and record.digests is not None:
        changed = digest_problem(out_dir, stem, record.digests)
        if changed:
            return CheckScore(check, 0.0, False, f"its results were not the check's own: "
                              f"{changed}", (f"results rewritten: {check.name}",))
        got = _verdict(exp, index, out_dir, stem)
    else:  # the collector did not finish (or never ran): nothing it left counts
        got = "missing"
    if isinstance(got, str):
        if got != "missing":
            return CheckScore(check, 0.0, False, f"the check could not be read: {got}",
                              (f"invalid results: {check.name}",))
        if record is None:
            return CheckScore(check, 0.0, False, f"not run: {why_not_run}", state="not run")
        if "Timeout of" in record.message:
            return CheckScore(check, 0.0, False, "interrupted: it ran over the cell time limit")
        error = record.error
        if error is not None and not check.hidden:
            first = error.evalue.splitlines()[:1]
            what = sanitize(error.ename, 60) + (f": {sanitize(first[0])}" if first else "")
            return CheckScore(check, 0.0, False, f"the check could not run: {what}")
        if error is not None:
            return CheckScore(check, 0.0, False,
                              f"the check could not run ({sanitize(error.ename, 60)})")
        return CheckScore(check, 0.0, False, "the check left no results (was its collector "
                          "replaced?)", (f"no results: {check.name}",))
    verdict = got
    flags = tuple(f"{check.name}: {_flag(b)}" for b in verdict.broken)
    score = check.points * verdict.passed / verdict.total
    if check.hidden:
        detail = f"{verdict.passed}/{verdict.total} cases passed (the cases of hidden checks " \
                 "are not shown)"
        if verdict.broken:
            detail += "; it takes a forbidden shortcut on a hidden case"
        return CheckScore(check, score, verdict.ok, detail, flags)
    if verdict.ok:
        return CheckScore(check, score, True, "passed", flags, "pass")
    lines = verdict.message().splitlines()[1:]
    detail = "\n".join([f"{verdict.passed}/{verdict.total} cases passed",
                        *(sanitize(line, 240) for line in lines[:4])])
    first = ((sanitize(verdict.first[0], 120), sanitize(verdict.first[1], 240))
             if verdict.first else None)
    return CheckScore(check, score, False, detail, flags,
                      "waiting" if verdict.not_done else "fail", first)


def _verdict(exp: Expectations, index: int, out_dir: Path, stem: str) -> Verdict | str:
    """The verdict on a check's results, decoded and judged in the judging process (or here,
    when the expectations have none), or why its results cannot be used."""
    if exp.judge is None:
        from labsim.course.judge import verdict_of

        answer = verdict_of(exp.specs[index], exp.cases[index], out_dir, stem)
    else:
        answer = exp.judge.verdict(index, out_dir, stem)
    if "unreadable" in answer:
        reason = str(answer["unreadable"])
        return reason if reason != "missing" else "missing"
    first = answer.get("first")
    return Verdict(exp.specs[index].title if index < len(exp.specs) else "check",
                   int(answer["passed"]), int(answer["total"]),
                   (str(first[0]), str(first[1])) if first else None,
                   bool(answer["not_done"]), tuple(map(str, answer["broken"])))


def score_run(
    rebuilt: rb.Rebuilt, run: sb.RunRecord, limits: sb.Limits, exp: Expectations
) -> tuple[str, list[CheckScore], list[str], list[str]]:
    """Status, per-check scores, reasons (in words) and review flags from one run."""
    records = {r.cell: r for r in read_records(run.records)}
    status, stop, reasons = "ok", "", []
    code_errors = 0
    seen_exercise = False
    skipped: set[str] = set()  # names of the lab's cells that could not run while grading
    code_sources = ([c.source for c in rebuilt.notebook.cells if c.cell_type == "code"]
                    if rebuilt.notebook is not None else [""] * len(rebuilt.cells))
    last = -1  # the last cell whose record counts
    for number, cell in enumerate(rebuilt.cells):
        record = records.get(number)
        if record is None:
            break
        message = record.message
        if record.phase == "setup":
            status, last = "crashed", number - 1
            stop = "the kernel could not start: " + sanitize(
                (message.splitlines() or ["no message"])[0])
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
        elif cell.role in ("exercise", "added", "code") and record.outcome != "passed":
            error = record.error
            if error is None or error.ename == "NotImplementedError":
                pass  # an unfinished exercise is reported by its checks
            elif cell.role == "code":
                # the release's own cells: one that needs a withheld reference does not run
                # while grading, and never counts; others matter only before any exercise
                # (the set-up), where they explain what failed after
                if error.ename == "ReferenceWithheld":
                    skipped.update(rb.defined_names(code_sources[number]))
                elif not seen_exercise and not code_errors:
                    first = error.evalue.splitlines()[:1]
                    reasons.append(f"{cell.label} raised {sanitize(error.ename, 60)}"
                                   + (f": {sanitize(first[0])}" if first else ""))
                    code_errors += 1
            else:
                first = error.evalue.splitlines()[:1]
                reason = (f"{cell.label} raised {sanitize(error.ename, 60)}"
                          + (f": {sanitize(first[0])}" if first else ""))
                missing = _missing_name(error)
                if missing and missing in skipped:
                    reason += (f" (`{missing}` is defined by a cell of the lab that does not run "
                               "while grading, because it uses an exercise's reference: define "
                               "what your code needs in your own cells)")
                reasons.append(reason)
        seen_exercise = seen_exercise or cell.role in ("exercise", "added")
        last = number
    if not stop and last + 1 < len(rebuilt.cells):
        where = rebuilt.cells[last + 1].label
        if run.notebook_timed_out:
            status = "timeout"
            stop = f"the notebook ran over its {_fmt(limits.notebook_s)} s limit (in {where})"
        else:
            status = "crashed"
            stop = (f"the run stopped before {where} (nbval exited with code "
                    f"{run.returncode}; rerun with --keep-runs DIR to see its log)")
        reasons.append(stop)
    cell_of = {c.check: n for n, c in enumerate(rebuilt.cells) if c.check is not None}
    scores = []
    for index, check in enumerate(rebuilt.checks):
        number = cell_of[index]
        record = records.get(number) if number <= last else None
        scores.append(judge_check(index, check, exp, run.out_dir, record, stop or "not reached"))
    flags = _exercise_references(run.out_dir, exp, scores)
    return status, scores, reasons, flags


def _attempted(score: CheckScore, attempted: dict[str, bool]) -> CheckScore:
    """A failed check whose exercise was left as released is ``not attempted``; one whose
    exercise was written but that still raised NotImplementedError on every case waits on
    another exercise that was not."""
    if score.passed:
        return score
    fns = [f for f in score.check.functions if f in attempted]
    if fns and not any(attempted[f] for f in fns):
        return replace(score, state="not attempted", detail="not attempted: the exercise is "
                       "still the released stub")
    return score


def _missing_name(error: Any) -> str:
    """The name of a ``NameError`` ("name 'x' is not defined"), else ""."""
    if error.ename != "NameError":
        return ""
    import re

    match = re.search(r"name '(\w+)' is not defined", error.evalue)
    return match.group(1) if match else ""


def _exercise_references(out_dir: Path, exp: Expectations, scores: list[CheckScore]
                         ) -> list[str]:
    """References an exercise cell called while it was defined: flagged, and every check
    forbidding one of them scores 0."""
    got = _exercise_calls(out_dir)
    seen = [sanitize(r, 120) for _, refs in got for r in refs if isinstance(r, str)]
    tried = list(dict.fromkeys(r.removeprefix("refused: ") for r in seen
                               if r.startswith("refused: ")))
    flags = [f"an exercise cell tried {', '.join(tried)[:200]} (refused)"] if tried else []
    called = {r for r in seen if not r.startswith("refused: ")}
    if not called:
        return flags
    for i, s in enumerate(scores):
        if exp.forbidden[i] & called and s.score:
            scores[i] = CheckScore(s.check, 0.0, False, "an exercise cell called labsim's own "
                                   "reference (" + ", ".join(sorted(called))[:200] + ")",
                                   s.flags)
    return [*flags, f"an exercise cell calls {', '.join(sorted(called))[:200]}"]


def _exercise_calls(out_dir: Path) -> list[Any]:
    """[cell digest, [reference names]] pairs the exercise-cell tripwire wrote, or []."""
    from labsim.course.records import read_regular

    text = read_regular(out_dir / "exercises.json", 1 << 20)
    if text is None:
        return []
    try:
        value = _plain.decode(text, read_regular(out_dir / "exercises.bin", 1 << 20) or b"")
    except _plain.PlainDataError:
        return [["", ["an unreadable record of reference calls"]]]
    if not isinstance(value, list):
        return []
    return [v for v in value if isinstance(v, list) and len(v) == 2
            and isinstance(v[1], list)][:50]


@dataclass(frozen=True)
class Options:
    """How to grade: limits, parallel jobs, extra checks and where feedback goes."""

    limits: sb.Limits = sb.Limits()
    jobs: int = 1
    extra: rb.ExtraChecks | None = None
    feedback_dir: Path | None = None
    keep_dir: Path | None = None  # keep each run's folder here (for debugging)
    work_dir: Path | None = None  # where runs' folders go (default: system temp)
    cache_dir: Path | None = None  # keep built graded copies here, to reuse (default: none)

    def __post_init__(self) -> None:
        if isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or not (
                1 <= self.jobs <= 256):
            raise ValueError(f"jobs must be a whole number from 1 to 256, got {self.jobs!r}")


def _invalid(name: str, checks: Sequence[rb.Check], reason: str) -> Result:
    scores = tuple(CheckScore(c, 0.0, False, "not graded") for c in checks)
    return Result(name, "invalid", scores, (reason,))


KEEP_FILE_BYTES = 64 * 2**20
KEEP_TOTAL_BYTES = 256 * 2**20


def keep_run(folder: Path, target: Path) -> None:
    """Copy a run's folder for ``--keep-runs``: regular files only, never following a link,
    at most ``KEEP_FILE_BYTES`` each and ``KEEP_TOTAL_BYTES`` in all."""
    from labsim.course.records import read_regular

    total = 0
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        rel = Path(dirpath).relative_to(folder)
        if rel.parts[:1] == ("root",):
            dirnames[:] = []
            continue
        for name in sorted(filenames):
            data = read_regular(Path(dirpath) / name, KEEP_FILE_BYTES)
            if data is None or total + len(data) > KEEP_TOTAL_BYTES:
                continue
            total += len(data)
            dest = target / rel / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)


def grade_one(
    lab: rb.ReleasedLab, name: str, path: Path, options: Options, box: sb.Sandbox,
    ports: Callable[[], list[int]], threads: int, workroot: Path, exp: Expectations,
    cancel: threading.Event | None = None, keep_name: str = "", graded: Path | None = None,
    learner: str = "",
) -> Result:
    """Read and grade one submission; never raises for anything in the submission."""
    checks = exp.checks
    sub, problem = read_submission(path)
    if sub is None:
        return replace(_invalid(name, checks, problem), learner=learner)
    if not rb.is_this_lab(lab, sub):
        return replace(_invalid(name, checks, f"no cell or exercise of {lab.path.name} in it "
                                "(wrong lab?)"), learner=learner)
    given = sub.metadata.get("labsim", {}).get("learner") if isinstance(
        sub.metadata.get("labsim"), dict) else None
    if isinstance(given, str) and given.strip():
        learner = sanitize(given.strip(), 80)
    rebuilt = rb.rebuild(lab, sub, options.extra)
    del sub
    folder = Path(tempfile.mkdtemp(prefix="run-", dir=workroot))
    files = {**exp.files, "kernel.json": exp.kernel_config(rebuilt)}
    try:
        run = sb.run_notebook(nbk.dumps(rebuilt.notebook), folder / "run", options.limits, box,
                              ports(), threads, cancel, files=files, exports=exp.exports(),
                              secret=exp.inputs, graded=graded)
        status, scores, reasons, flags = score_run(rebuilt, run, options.limits, exp)
    finally:
        if options.keep_dir is not None:
            keep_run(folder, Path(options.keep_dir) / keep_name)
        shutil.rmtree(folder, ignore_errors=True)
    if rebuilt.tampering:
        reasons = [*reasons, "changed from the release (the released cells were used): "
                   + "; ".join(rebuilt.tampering)]
        if status == "ok":
            status = "tampered"
    scores = [_attempted(s, rebuilt.attempted) for s in scores]
    missing = list(run.jail.get("missing", [])) if run.jail else ["no report from the sandbox"]
    review = [*flags, *(f for s in scores for f in s.flags), *rebuilt.flags]
    return Result(name, status, tuple(scores), tuple(reasons), rebuilt.notes, tuple(review),
                  run.wall_s, "; ".join(sanitize(m, 120) for m in missing), learner)


def graded_copy(targets: Sequence[str], workroot: Path, cache: Path | None) -> Path:
    """The folder of the graded copy of labsim with ``targets`` withheld: built in
    ``workroot``, or taken from (and first built into) ``cache`` by the package's fingerprint."""
    if cache is None:
        return withhold.build(targets, workroot / "graded").root
    folder = Path(cache) / f"graded-{withhold.fingerprint(withhold.source_package(), targets)}"
    if not (folder / "sitecustomize.py").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=".graded-", dir=cache))
        withhold.build(targets, tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another check built it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    os.chmod(folder, 0o755)
    return folder


class Grader:
    """What grading one lab needs, set up once: the released lab, the expectations, the
    judging process, the graded copy of labsim, a work folder and the sandbox.  ``one``
    grades one submission (thread-safe: ``Options.jobs`` threads share it); ``close`` ends
    the judging process and removes the work folder.  A Dask worker keeps one per lab
    (``labsim.course.distributed``)."""

    def __init__(self, lab_path: Path, options: Options = Options(),
                 box: sb.Sandbox | None = None, jobs: int | None = None) -> None:
        self.options = options
        self.lab = rb.read_lab(lab_path)
        self.checks = self.lab.checks + (options.extra.checks if options.extra else ())
        self.exp = Expectations.build(self.checks)
        self.exp.judge = Judge(self.lab.path, options.extra.path if options.extra else None)
        self.box = box if box is not None else sb.probe()
        self._pool = sb.PortPool()
        self._lock = threading.Lock()
        self.cancel = threading.Event()
        self.threads = max(1, (os.cpu_count() or 1) // (jobs or options.jobs))
        if options.work_dir is not None:
            Path(options.work_dir).mkdir(parents=True, exist_ok=True)
        self.workroot = Path(tempfile.mkdtemp(prefix="labsim-grade-", dir=options.work_dir))
        os.chmod(self.workroot, 0o711)  # the sandbox (another uid) must reach its run folder
        try:
            self.graded = graded_copy(self.exp.withheld(), self.workroot, options.cache_dir)
        except BaseException:
            self.close()
            raise

    def _ports(self) -> list[int]:
        with self._lock:
            return self._pool.take()

    def one(self, path: Path, name: str, learner: str = "", keep_name: str = "") -> Result:
        """The grade of one submission; never raises for anything in it."""
        try:
            return grade_one(self.lab, name, Path(path), self.options, self.box, self._ports,
                             self.threads, self.workroot, self.exp, self.cancel,
                             keep_name=keep_name or Path(name).stem, graded=self.graded,
                             learner=learner)
        except Exception as exc:  # noqa: BLE001 - one bad submission never stops the class
            return Result(name, "crashed",
                          tuple(CheckScore(c, 0.0, False, "not graded") for c in self.checks),
                          (f"the grader failed on this submission: {type(exc).__name__}: "
                           f"{sanitize(exc)}",), learner=learner)

    def close(self) -> None:
        self.cancel.set()
        judge = getattr(getattr(self, "exp", None), "judge", None)
        if judge is not None:
            judge.close()
        shutil.rmtree(self.workroot, ignore_errors=True)


def grade(lab_path: Path, submissions: Sequence[Path], options: Options = Options(),
          box: sb.Sandbox | None = None, engine: Any = None) -> Report:
    """Grade every submission of one released lab (see the module docstring).  Submissions
    are read one at a time, by the job that grades them.  ``engine``: a
    ``labsim.course.distributed.DaskEngine`` grades them on a Dask cluster instead of
    ``options.jobs`` threads here (each submission still in a sandbox of its own)."""
    start = time.monotonic()
    names = [str(p) for p in submissions]
    lab_stem = Path(lab_path).stem
    fb_names = feedback_names(submissions)
    learners = learner_ids(submissions, lab_stem)
    for d in (options.feedback_dir, options.keep_dir):
        if d is not None:
            Path(d).mkdir(parents=True, exist_ok=True)

    def feedback(i: int, result: Result) -> Result:
        if options.feedback_dir is not None:
            nbk.write_atomic(Path(options.feedback_dir) / fb_names[i],
                             feedback_text(lab_stem, result))
        return result

    if engine is not None:
        checks, results, warnings = engine.grade(Path(lab_path), submissions, names, learners,
                                                 options)
        results = tuple(feedback(i, r) for i, r in enumerate(results))
        return Report(lab_stem, checks, results, warnings, time.monotonic() - start)
    grader = Grader(lab_path, options, box)

    def one(i: int) -> Result:
        return feedback(i, grader.one(Path(submissions[i]), names[i], learners[i],
                                      fb_names[i].removesuffix(".txt")))

    executor = ThreadPoolExecutor(max_workers=options.jobs)
    try:
        results = tuple(executor.map(one, range(len(names))))
    except BaseException:  # Ctrl-C: stop the running notebooks, start no more
        grader.cancel.set()
        raise
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
        grader.close()
    return Report(lab_stem, grader.checks, results, grader.box.warnings,
                  time.monotonic() - start)
