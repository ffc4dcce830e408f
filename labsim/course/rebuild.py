"""Rebuild the notebook that is graded from a released lab and a learner's submission.

Only the learner's exercise cells are taken from the submission, matched by the stable cell id
the release gave them, or -- for a learner who deleted and recreated a cell -- by the
function the exercise defines (the last submission cell defining it wins, as it would when the
notebook runs top to bottom).  Everything else (setup, narrative, check cells and their stored
PASS lines) comes from the release, so editing or deleting those changes nothing; the rebuild
records what was changed (``Rebuilt.tampering`` for check cells and narrative, ``notes`` for
anything else worth telling).

Extra checks an instructor keeps private are appended from a ``.py`` file in the "percent"
cell format (``ExtraChecks``).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from labsim.checks._core import SUMMARY_RE
from labsim.course import notebook as nbk

EXTRA_HEADER_RE = re.compile(r"^# %%(?P<rest>.*)$")
EXTRA_CHECK_RE = re.compile(
    r"^\s*extra-check\s+(?P<name>[\w.\-]+)(?:\s+points=(?P<pts>[\d.]+))?\s*$"
)
DEF_RE = r"^(?:async\s+)?(?:def|class)\s+{name}\b"


@dataclass(frozen=True)
class Check:
    """One scored check: its column name, points, and what a pass prints.

    ``expected`` is the stored PASS line (empty for an extra check, which is judged by the
    line it prints); ``cases`` the number of cases that line reports (0 when unknown);
    ``hidden`` marks an instructor's extra check, whose cases are never shown to learners.
    """

    name: str
    points: float
    expected: str = ""
    cases: int = 0
    hidden: bool = False


@dataclass(frozen=True)
class Cell:
    """A code cell of the graded notebook as nbval numbers them (code cells only)."""

    role: str  # exercise, check, extra-check, code, extra-code
    label: str  # words for feedback: "exercise `roofline_time`", "check `x`", "cell 3"
    check: int | None = None  # index into the lab's checks


@dataclass(frozen=True)
class ReleasedLab:
    """A released lab read once: the notebook, its checks and its exercises' names."""

    path: Path
    notebook: Any
    checks: tuple[Check, ...]
    exercises: dict[str, tuple[str, ...]]  # cell id -> names the exercise defines


@dataclass(frozen=True)
class ExtraChecks:
    """Instructor-private cells appended after the lab: setup code and scored checks."""

    cells: tuple[tuple[str, Check | None], ...]  # (source, check or None for setup code)

    @property
    def checks(self) -> tuple[Check, ...]:
        return tuple(c for _, c in self.cells if c is not None)


@dataclass(frozen=True)
class Rebuilt:
    """The notebook to grade, what each of its code cells is, and what the learner changed."""

    notebook: Any
    cells: tuple[Cell, ...]
    checks: tuple[Check, ...]
    tampering: tuple[str, ...]
    notes: tuple[str, ...]
    flags: tuple[str, ...]


def _stdout(cell: Any) -> str:
    return "".join(
        o.get("text", "") for o in cell.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == "stdout"
    )


def _role(cell: Any) -> str:
    return cell.get("metadata", {}).get("labsim", {}).get("role") or nbk.role(cell)


def _defined_names(source: str) -> tuple[str, ...]:
    return tuple(re.findall(r"^(?:async\s+)?(?:def|class)\s+(\w+)", source, flags=re.M))


def read_lab(path: Path) -> ReleasedLab:
    """Read a released lab; ``ValueError`` if it is not one (no check with a stored PASS)."""
    nb = nbk.read(Path(path))
    checks: list[Check] = []
    exercises: dict[str, tuple[str, ...]] = {}
    seen: dict[str, int] = {}
    for index, cell in enumerate(nb.cells):
        kind = _role(cell)
        if kind == "check":
            match = SUMMARY_RE.search(_stdout(cell))
            if not match or match["status"] != "PASS":
                raise ValueError(
                    f"{path}: {nbk.cell_label(index, cell)} is a check cell without a stored "
                    "PASS line; grade against a lab written by `labsim release`"
                )
            name = match["title"]
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name = f"{name}#{seen[name]}"
            checks.append(Check(name, _points(cell, path, index), match.group(0),
                                int(match["total"])))
        elif kind == "exercise":
            exercises[cell.id] = _defined_names(cell.source)
    if not checks:
        raise ValueError(f"{path}: no check cells; is this a lab released by `labsim release`?")
    return ReleasedLab(Path(path), nb, tuple(checks), exercises)


def _points(cell: Any, path: Path, index: int) -> float:
    points = cell.get("metadata", {}).get("points", 1)
    if isinstance(points, bool) or not isinstance(points, (int, float)) or points < 0:
        raise ValueError(f"{path}: {nbk.cell_label(index, cell)}: points must be a number >= 0")
    return float(points)


def read_extra_checks(path: Path) -> ExtraChecks:
    """Parse an extra-checks file: cells start at ``# %%`` lines; a cell whose header is
    ``# %% extra-check NAME [points=N]`` is scored, the others are setup code."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the extra checks: {exc.strerror}") from None
    cells: list[tuple[str, Check | None]] = []
    header: str | None = None
    body: list[str] = []

    def flush() -> None:
        source = "\n".join(body).strip("\n")
        if header is None:
            if source.strip():
                cells.append((source, None))
            return
        match = EXTRA_CHECK_RE.match(header)
        if match is None:
            if header.strip():
                raise ValueError(
                    f"{path}: cell header '# %%{header}' not understood; write "
                    "'# %% extra-check NAME points=N' for a scored check or '# %%' for code"
                )
            if source.strip():
                cells.append((source, None))
            return
        cells.append((source, Check(match["name"], float(match["pts"] or 1), hidden=True)))

    for line in text.splitlines():
        match = EXTRA_HEADER_RE.match(line)
        if match:
            flush()
            header, body = match["rest"], []
        else:
            body.append(line)
    flush()
    extra = ExtraChecks(tuple(cells))
    names = [c.name for c in extra.checks]
    if not names:
        raise ValueError(f"{path}: no '# %% extra-check NAME' cell; nothing to grade")
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: extra check names must be unique, got {names}")
    return extra


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
    "get_ipython", "showtraceback", "sys.modules", "builtins", "labsim.checks", "run_check",
    "CheckFailed", "sys.stdout", "PASS ", "ctypes", "os._exit", "sys.exit", "socket",
    "subprocess", "os.system", "shutil.rmtree", "os.remove", "unlink", "exec(", "eval(",
    "__import__", "signal",
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
    narrative_changed = 0
    check_no = 0
    for cell in lab.notebook.cells:
        new = copy.deepcopy(cell)
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
            cells.append(Cell("exercise", what))
        elif kind == "check":
            check = lab.checks[check_no]
            if mine is None and cell.source.strip() not in sources:
                tampering.append(f"check `{check.name}` deleted or edited")
            elif mine is not None and mine.source.strip() != cell.source.strip():
                tampering.append(f"check `{check.name}` edited")
            elif mine is not None and _output_edited(mine, cell):
                tampering.append(f"stored output of check `{check.name}` edited")
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
    if extra is not None:
        extra_no = len(lab.checks)
        for source, check in extra.cells:
            new = nbformat.v4.new_code_cell(source)
            if check is None:
                cells.append(Cell("extra-code", "an instructor's hidden code cell"))
            else:
                cells.append(Cell("extra-check", f"hidden check `{check.name}`", extra_no))
                extra_no += 1
            out.cells.append(new)
    for i, c in enumerate(out.cells):
        c.id = f"graded-{i}"
    checks = lab.checks + (extra.checks if extra is not None else ())
    return Rebuilt(out, tuple(cells), checks, tuple(tampering), tuple(notes), tuple(sorted(flags)))


def _output_edited(mine: Any, released: Any) -> bool:
    """True when a submitted check cell shows printed output the check could not have made:
    neither empty, nor the released PASS line, nor the result of a run that raised."""
    if any(o.get("output_type") == "error" for o in mine.get("outputs", [])):
        return False
    text = _stdout(mine).strip()
    return bool(text) and text != _stdout(released).strip()


def is_this_lab(lab: ReleasedLab, sub: Any) -> bool:
    """Whether a submission shares anything with the release (a cell id or an exercise)."""
    ids = {c.get("id") for c in lab.notebook.cells}
    if any(c.get("id") in ids for c in sub.cells):
        return True
    return any(_find_exercise(sub, cid, names) is not None
               for cid, names in lab.exercises.items() if names)
