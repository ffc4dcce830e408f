"""Rebuild the notebook that is graded from a released lab and a learner's submission.

Only the learner's exercise cells are taken from the submission, matched by the stable cell id
the release gave them, or -- for a learner who deleted and recreated a cell -- by the
function the exercise defines (the last submission cell defining it wins, as it would when the
notebook runs top to bottom).  Everything else (setup, narrative, code cells) comes from the
release, and each check cell becomes a *collector* cell: it runs the check's driver on the
grader's inputs and writes what the learner's functions did (``labsim.checks._collect``); the
grader judges it (``grade.py``).  The rebuild records what was changed (``Rebuilt.tampering``
for check cells and narrative, ``notes`` for anything else worth telling).

Extra checks an instructor keeps private come from a Python file defining ``CHECKS``, a list
of ``labsim.checks.Hidden`` (``read_extra_checks``); it runs in the grader's process only.
"""

from __future__ import annotations

import copy
import re
import runpy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from labsim.checks import SUMMARY_RE, Hidden
from labsim.course import notebook as nbk

DEF_RE = r"^(?:async\s+)?(?:def|class)\s+{name}\b"
COLLECT = '__import__("labsim.checks._collect", fromlist=["collect"]).collect({index}, {fns})'


@dataclass(frozen=True)
class Check:
    """One scored check: its column name, points, the labsim check it calls (``spec``,
    ``"module:name"``) with which functions, and what a pass prints.

    ``expected`` is the PASS line the release stored and ``cases`` its number of cases (0 for
    an extra check); ``hidden`` marks an instructor's extra check, whose cases are never shown
    to learners (``extra`` holds its definition)."""

    name: str
    points: float
    spec: str = ""
    functions: tuple[str, ...] = ()
    expected: str = ""
    cases: int = 0
    hidden: bool = False
    extra: Hidden | None = None


@dataclass(frozen=True)
class Cell:
    """A code cell of the graded notebook as nbval numbers them (code cells only)."""

    role: str  # exercise, check, extra-check, code
    label: str  # words for feedback: "exercise `roofline_time`", "check `x`", "cell 3"
    check: int | None = None  # index into the graded checks


@dataclass(frozen=True)
class ReleasedLab:
    """A released lab read once: the notebook, its checks and its exercises' names."""

    path: Path
    notebook: Any
    checks: tuple[Check, ...]
    exercises: dict[str, tuple[str, ...]]  # cell id -> names the exercise defines


@dataclass(frozen=True)
class ExtraChecks:
    """An instructor's private checks, appended after the lab's."""

    checks: tuple[Check, ...]


@dataclass(frozen=True)
class Rebuilt:
    """The notebook to grade, what each of its code cells is, and what the learner changed."""

    notebook: Any
    cells: tuple[Cell, ...]
    checks: tuple[Check, ...]
    tampering: tuple[str, ...]
    notes: tuple[str, ...]
    flags: tuple[str, ...]
    exercise_sources: tuple[str, ...] = ()


def _role(cell: Any) -> str:
    return cell.get("metadata", {}).get("labsim", {}).get("role") or nbk.role(cell)


def _defined_names(source: str) -> tuple[str, ...]:
    return tuple(re.findall(r"^(?:async\s+)?(?:def|class)\s+(\w+)", source, flags=re.M))


def read_lab(path: Path) -> ReleasedLab:
    """Read a released lab; ``ValueError`` if it is not one (no check with its metadata)."""
    nb = nbk.read(Path(path))
    checks: list[Check] = []
    exercises: dict[str, tuple[str, ...]] = {}
    seen: dict[str, int] = {}
    for index, cell in enumerate(nb.cells):
        kind = _role(cell)
        where = f"{path}: {nbk.cell_label(index, cell)}"
        if kind == "check":
            meta = cell.get("metadata", {}).get("labsim", {})
            match = SUMMARY_RE.fullmatch(str(meta.get("expected", "")))
            spec, fns = meta.get("check"), meta.get("functions")
            if (not match or match["status"] != "PASS" or not isinstance(spec, str)
                    or not isinstance(fns, list) or not all(isinstance(f, str) for f in fns)):
                raise ValueError(f"{where} is a check cell without its release metadata; grade "
                                 "against a lab written by `labsim release`")
            name = match["title"]
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name = f"{name}#{seen[name]}"
            checks.append(Check(name, _points(cell, path, index), spec, tuple(fns),
                                match.group(0), int(match["total"])))
        elif kind == "exercise":
            exercises[cell.id] = _defined_names(cell.source)
    if not checks:
        raise ValueError(f"{path}: no check cells; is this a lab released by `labsim release`?")
    return ReleasedLab(Path(path), nb, tuple(checks), exercises)


def _points(cell: Any, path: Path, index: int) -> float:
    points = cell.get("metadata", {}).get("points", 1)
    if isinstance(points, bool) or not isinstance(points, (int, float)) or not (
            0 <= points < float("inf")):
        raise ValueError(f"{path}: {nbk.cell_label(index, cell)}: points must be a number >= 0")
    return float(points)


def read_extra_checks(path: Path, lab: ReleasedLab | None = None) -> ExtraChecks:
    """Run an instructor's extra-checks file (in this process: it is trusted) and return its
    ``CHECKS``; ``ValueError`` naming the file for anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--extra-checks {path}: no such file")
    try:
        ns = runpy.run_path(str(path), run_name="labsim_extra_checks")
    except Exception as exc:  # noqa: BLE001 - the instructor's file: say what went wrong
        raise ValueError(f"{path}: running the extra checks failed: {type(exc).__name__}: "
                         f"{exc}") from None
    items = ns.get("CHECKS")
    if not isinstance(items, (list, tuple)) or not items or not all(
            isinstance(h, Hidden) for h in items):
        raise ValueError(f"{path}: define CHECKS = [labsim.checks.Hidden(...), ...]")
    names = [h.name for h in items]
    taken = {c.name for c in lab.checks} if lab is not None else set()
    if len(set(names)) != len(names) or taken & set(names):
        raise ValueError(f"{path}: extra check names must be unique and differ from the "
                         f"lab's checks, got {names}")
    checks = []
    for h in items:
        try:
            h.spec().cases()
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{path}: extra check {h.name}: {exc}") from None
        checks.append(Check(h.name, float(h.points), h.like, h.function_names, "",
                            len(h.spec().cases()), hidden=True, extra=h))
    return ExtraChecks(tuple(checks))


def _find_exercise(sub: Any, cid: str, names: tuple[str, ...]) -> Any | None:
    by_id = {c.get("id"): c for c in sub.cells}
    cell = by_id.get(cid)
    if cell is not None and cell.cell_type == "code":
        return cell
    for candidate in reversed(sub.cells):
        if candidate.cell_type == "code" and any(
            re.search(DEF_RE.format(name=re.escape(n)), candidate.source, flags=re.M)
            for n in names
        ):
            return candidate
    return None


SUSPICIOUS = (
    "get_ipython", "showtraceback", "set_custom_exc", "sys.modules", "builtins", "__builtins__",
    "labsim.checks", "labsim.course", "_collect", "run_check", "CheckFailed", "sys.stdout",
    "PASS ", "ctypes", "os._exit", "sys.exit", "socket", "subprocess", "os.system", "os.fork",
    "shutil.rmtree", "os.remove", "unlink", "exec(", "eval(", "compile(", "__import__",
    "importlib", "signal", "_getframe", "f_locals", "f_back", "__code__", "__closure__",
    "setprofile", "settrace", "TorchDispatchMode", "_python_dispatch", "DisableTorchFunction",
    "_disable_current_modes", "reference", "LABSIM_GRADE", "/proc", "ptrace",
)


def rebuild(lab: ReleasedLab, sub: Any, extra: ExtraChecks | None = None) -> Rebuilt:
    """The graded notebook for submission ``sub`` (a parsed notebook)."""
    out = nbformat.v4.new_notebook()
    out.metadata = copy.deepcopy(lab.notebook.metadata)
    by_id = {c.get("id"): c for c in sub.cells}
    sources = {c.source.strip() for c in sub.cells}
    cells: list[Cell] = []
    tampering: list[str] = []
    notes: list[str] = []
    flags: set[str] = set()
    exercise_sources: list[str] = []
    narrative_changed = 0
    check_no = 0
    for cell in lab.notebook.cells:
        new = copy.deepcopy(cell)
        new.outputs = [] if cell.cell_type == "code" else new.get("outputs", [])
        kind = _role(cell)
        mine = by_id.get(cell.get("id"))
        if kind == "exercise":
            names = lab.exercises.get(cell.id, ())
            what = f"exercise `{names[0]}`" if names else f"exercise cell {cell.id}"
            found = _find_exercise(sub, cell.id, names)
            if found is None:
                notes.append(f"{what}: not found in the submission (deleted?); the unanswered "
                             "exercise was graded")
            else:
                new.source = found.source
                flags.update(w.strip("(. ") for w in SUSPICIOUS if w in found.source)
            exercise_sources.append(new.source)
            cells.append(Cell("exercise", what))
        elif kind == "check":
            check = lab.checks[check_no]
            if mine is None and cell.source.strip() not in sources:
                tampering.append(f"check `{check.name}` deleted or edited")
            elif mine is not None and mine.source.strip() != cell.source.strip():
                tampering.append(f"check `{check.name}` edited")
            new.source = COLLECT.format(index=check_no, fns=", ".join(check.functions))
            cells.append(Cell("check", f"check `{check.name}`", check_no))
            check_no += 1
        elif cell.cell_type == "code":
            if mine is not None and mine.source.strip() != cell.source.strip():
                notes.append(f"code cell {len(cells)} was changed; the released version was run")
            cells.append(Cell("code", f"code cell {len(cells)}"))
        elif cell.source.strip() and mine is None and cell.source.strip() not in sources:
            narrative_changed += 1
        elif mine is not None and mine.source.strip() != cell.source.strip():
            narrative_changed += 1
        out.cells.append(new)
    if narrative_changed:
        tampering.append(f"{narrative_changed} narrative cell(s) edited or deleted")
    checks = list(lab.checks)
    for check in extra.checks if extra is not None else ():
        index = len(checks)
        out.cells.append(nbformat.v4.new_code_cell(
            COLLECT.format(index=index, fns=", ".join(check.functions))))
        cells.append(Cell("extra-check", f"hidden check `{check.name}`", index))
        checks.append(check)
    for i, c in enumerate(out.cells):
        c.id = f"graded-{i}"
    return Rebuilt(out, tuple(cells), tuple(checks), tuple(tampering), tuple(notes),
                   tuple(sorted(flags)), tuple(exercise_sources))


def is_this_lab(lab: ReleasedLab, sub: Any) -> bool:
    """Whether a submission shares anything with the release (a cell id or an exercise)."""
    ids = {c.get("id") for c in lab.notebook.cells}
    if any(c.get("id") in ids for c in sub.cells):
        return True
    return any(_find_exercise(sub, cid, names) is not None
               for cid, names in lab.exercises.items() if names)
