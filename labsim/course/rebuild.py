"""Rebuild the notebook that is graded from a released lab and a learner's submission.

From the submission come the learner's exercise cells (matched by the stable cell id the
release gave them) and every code cell the learner added (an answer written below the stub, a
helper in a cell of its own), each placed after the released cell it follows in the
submission, so the graded notebook runs as the learner's Run All did.  Everything else
(setup, narrative, the release's code cells) comes from the release, and each check cell
becomes a *collector* cell: it runs the check's driver on the grader's inputs and writes what
the learner's functions did (``labsim.checks._collect``); the grader judges it
(``grade.py``).  The rebuild records what was changed (``Rebuilt.tampering`` for check cells
and narrative, ``notes`` for anything else worth telling), which exercises were attempted
(``attempted``: the learner changed the cell or defined its function elsewhere) and what of
the learner's code is worth a look (``flags``, matched as tokens of the code).

Extra checks an instructor keeps private come from a Python file defining ``CHECKS``, a list
of ``labsim.checks.Hidden`` (``read_extra_checks``); it runs in the grader's process only.
"""

from __future__ import annotations

import copy
import re
import runpy
from dataclasses import dataclass, field
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

    role: str  # exercise, check, extra-check, code, added (a learner's own cell)
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
    """An instructor's private checks, appended after the lab's (``path``: their file)."""

    checks: tuple[Check, ...]
    path: Path | None = None


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
    attempted: dict[str, bool] = field(default_factory=dict)
    released_sources: tuple[str, ...] = ()  # the release's code cells as graded (trusted)


def _role(cell: Any) -> str:
    return cell.get("metadata", {}).get("labsim", {}).get("role") or nbk.role(cell)


def defined_names(source: str) -> set[str]:
    """The names a cell binds at its top level (assignments, definitions, imports)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
    return names


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
    return ExtraChecks(tuple(checks), path)


def _find_exercise(sub: Any, cid: str, names: tuple[str, ...]) -> Any | None:
    by_id = {c.get("id"): c for c in sub.cells}
    cell = by_id.get(cid)
    if cell is not None and cell.cell_type == "code":
        return cell
    for candidate in reversed(sub.cells):
        if candidate.cell_type == "code" and _defines_any(candidate.source, names):
            return candidate
    return None


# What the review column names when a learner's code uses it (matched as tokens of the code:
# names, dotted names, or text inside string literals for the last group).  Most are
# innocent; each says where to look.
SUSPICIOUS_NAMES = frozenset({
    "get_ipython", "showtraceback", "set_custom_exc", "sys.modules", "builtins",
    "__builtins__", "labsim.checks", "labsim.course", "labsim.lab.guard", "_collect",
    "run_check", "CheckFailed", "sys.stdout", "ctypes", "os._exit", "sys.exit", "socket",
    "subprocess", "os.system", "os.fork", "shutil.rmtree", "os.remove", "os.unlink", "exec",
    "eval", "compile", "__import__", "importlib", "signal", "_getframe", "currentframe",
    "f_locals", "f_back", "f_globals", "__code__", "__closure__", "cell_contents",
    "__globals__", "setprofile", "settrace", "TorchDispatchMode", "_python_dispatch",
    "DisableTorchFunction", "_disable_current_modes", "threading", "_thread",
    "concurrent.futures", "multiprocessing", "register_at_fork", "gc", "addaudithook",
    "_pop_mode", "_pop_torch_function_stack", "_disable_profiler", "setattr", "delattr",
})
SUSPICIOUS_TEXT = ("PASS ", "LABSIM_GRADE", "/proc", "ptrace", "/run/labsim")
# attribute names that say the same after any object (``get_ipython().set_custom_exc``)
SUSPICIOUS_ATTRIBUTES = frozenset({
    "showtraceback", "set_custom_exc", "__code__", "__closure__", "cell_contents",
    "__globals__", "f_locals", "f_back", "f_globals", "_getframe", "currentframe",
    "setprofile", "settrace", "_current_frames", "register_at_fork", "addaudithook",
    "_disable_profiler", "_pop_torch_function_stack", "_exit",
})


def suspicious(source: str) -> list[str]:
    """The names of ``SUSPICIOUS_NAMES`` the code uses and the ``SUSPICIOUS_TEXT`` its string
    literals hold, each once, in order of appearance (code that does not parse: its words)."""
    import io
    import tokenize

    found: list[str] = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        tokens = []
        words = re.findall(r"[A-Za-z_][\w.]*", source)
        return list(dict.fromkeys(w for w in words if w in SUSPICIOUS_NAMES))
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.type == tokenize.NAME:
            name, j = tok.string, i + 1
            while (j + 1 < len(tokens) and tokens[j].string == "."
                   and tokens[j + 1].type == tokenize.NAME):
                name += "." + tokens[j + 1].string
                j += 2
            parts = name.split(".")
            prev = tokens[i - 1].string if i else ""
            if prev != ".":  # not an attribute of something else (model.eval)
                for k in range(len(parts), 0, -1):
                    if ".".join(parts[:k]) in SUSPICIOUS_NAMES:
                        found.append(".".join(parts[:k]))
                        break
            attributes = parts if prev == "." else parts[1:]
            for part in attributes:  # attributes that matter wherever they appear
                if part in SUSPICIOUS_ATTRIBUTES:
                    found.append(part)
            i = j
            continue
        if tok.type == tokenize.STRING:
            found += [t.strip() for t in SUSPICIOUS_TEXT if t in tok.string]
        i += 1
    return list(dict.fromkeys(found))


def _take_defining(added: dict[Any, list[Any]], names: tuple[str, ...]) -> Any | None:
    """Remove from ``added`` and return the last added cell defining one of ``names``."""
    found = None
    for cells in added.values():
        for cell in cells:
            if names and _defines_any(cell.source, names):
                found = (cells, cell)
    if found is None:
        return None
    found[0].remove(found[1])
    return found[1]


def _same(a: str, b: str) -> bool:
    return a.strip() == b.strip()


def _defines_any(source: str, names: tuple[str, ...]) -> bool:
    return any(re.search(DEF_RE.format(name=re.escape(n)), source, flags=re.M) for n in names)


def rebuild(lab: ReleasedLab, sub: Any, extra: ExtraChecks | None = None) -> Rebuilt:
    """The graded notebook for submission ``sub`` (a parsed notebook).

    Every code cell the learner added (a cell whose id and source are not the release's) is
    kept, after the released cell it follows in the submission, so a notebook that works
    under Run All -- answers in a new cell, helpers in cells of their own -- is graded as it
    runs.  Exercise cells are the learner's; every other released cell is the release's."""
    out = nbformat.v4.new_notebook()
    out.metadata = copy.deepcopy(lab.notebook.metadata)
    released_ids = {c.get("id") for c in lab.notebook.cells}
    by_source: dict[str, str] = {}
    for c in lab.notebook.cells:
        by_source.setdefault(c.source.strip(), c.get("id"))
    # map each submission cell to a released cell id, or mark it the learner's own
    anchor = None
    added: dict[Any, list[Any]] = {}
    mine_by_id: dict[str, Any] = {}
    for cell in sub.cells:
        cid = cell.get("id")
        if cid in released_ids and cid not in mine_by_id:
            mine_by_id[cid] = cell
            anchor = cid
        elif cell.source.strip() in by_source and by_source[cell.source.strip()] not in mine_by_id:
            mine_by_id[by_source[cell.source.strip()]] = cell
            anchor = by_source[cell.source.strip()]
        elif cell.cell_type == "code" and cell.source.strip():
            added.setdefault(anchor, []).append(cell)
    added_sources = [c.source for cells in added.values() for c in cells]
    cells: list[Cell] = []
    tampering: list[str] = []
    notes: list[str] = []
    flags: list[str] = []
    exercise_sources: list[str] = []
    attempted: dict[str, bool] = {}
    narrative_changed = 0
    check_no = 0

    def add_learner_cells(key: Any) -> None:
        for cell in added.get(key, []):
            new = nbformat.v4.new_code_cell(cell.source)
            out.cells.append(new)
            number = len(cells)
            cells.append(Cell("added", f"your cell {number} (not in the release)"))
            exercise_sources.append(cell.source)
            flags.extend(suspicious(cell.source))

    add_learner_cells(None)
    for cell in lab.notebook.cells:
        new = copy.deepcopy(cell)
        new.outputs = [] if cell.cell_type == "code" else new.get("outputs", [])
        kind = _role(cell)
        mine = mine_by_id.get(cell.get("id"))
        if kind == "exercise":
            names = lab.exercises.get(cell.id, ())
            what = f"exercise `{names[0]}`" if names else f"exercise cell {cell.id}"
            if mine is None or mine.cell_type != "code":
                # deleted: the learner's last cell defining it takes its place (moved)
                moved = _take_defining(added, names)
                if moved is not None:
                    new.source = moved.source
                    flags.extend(suspicious(moved.source))
                else:
                    notes.append(f"{what}: not found in the submission (deleted?); the "
                                 "unanswered exercise was graded")
            else:
                new.source = mine.source
                flags.extend(suspicious(mine.source))
            touched = not _same(new.source, cell.source) or any(
                _defines_any(src, names) for src in added_sources)
            for name in names:
                attempted[name] = touched
            exercise_sources.append(new.source)
            cells.append(Cell("exercise", what))
        elif kind == "check":
            check = lab.checks[check_no]
            if mine is None:
                tampering.append(f"check `{check.name}` deleted or edited")
            elif not _same(mine.source, cell.source):
                tampering.append(f"check `{check.name}` edited")
            new.source = COLLECT.format(index=check_no, fns=", ".join(check.functions))
            new.metadata.setdefault("labsim", {})["collect"] = check_no
            cells.append(Cell("check", f"check `{check.name}`", check_no))
            check_no += 1
        elif cell.cell_type == "code":
            if mine is not None and not _same(mine.source, cell.source):
                notes.append(f"code cell {len(cells)} was changed; the released version was run")
            cells.append(Cell("code", f"code cell {len(cells)}"))
        elif cell.source.strip() and (mine is None or not _same(mine.source, cell.source)):
            narrative_changed += 1
        out.cells.append(new)
        add_learner_cells(cell.get("id"))
    if narrative_changed:
        tampering.append(f"{narrative_changed} narrative cell(s) edited or deleted")
    checks = list(lab.checks)
    for check in extra.checks if extra is not None else ():
        index = len(checks)
        collector = nbformat.v4.new_code_cell(
            COLLECT.format(index=index, fns=", ".join(check.functions)))
        collector.metadata["labsim"] = {"collect": index}
        out.cells.append(collector)
        cells.append(Cell("extra-check", f"hidden check `{check.name}`", index))
        checks.append(check)
    for i, c in enumerate(out.cells):
        c.id = f"graded-{i}"
    released = tuple(c.source for c, cell in zip(
        (c for c in out.cells if c.cell_type == "code"), cells, strict=True)
        if cell.role in ("code", "check", "extra-check"))
    return Rebuilt(out, tuple(cells), tuple(checks), tuple(tampering), tuple(notes),
                   tuple(dict.fromkeys(flags)), tuple(exercise_sources), attempted, released)


def is_this_lab(lab: ReleasedLab, sub: Any) -> bool:
    """Whether a submission shares anything with the release (a cell id or an exercise)."""
    ids = {c.get("id") for c in lab.notebook.cells}
    if any(c.get("id") in ids for c in sub.cells):
        return True
    return any(_find_exercise(sub, cid, names) is not None
               for cid, names in lab.exercises.items() if names)
