"""A learner checks their own notebook the way the grader will: ``labsim check`` (and the
Check button at the end of every lab, ``labsim.widgets.check``, which runs it).

Both grade the notebook with ``labsim grade``'s own pipeline -- rebuilt from the lab's release
(the copy ``labsim release`` keeps in the package, ``labsim/data/labs/``), run in a fresh
kernel against the graded copy of labsim, every check judged by the grader's comparisons --
so a check passes here exactly when it passes for the instructor.  What is printed is one line
per check, in the notebook's words::

    PASS  matmul_flops
    FAIL  matmul_bytes: case "square, bf16": 1.0 instead of 100663296.0
    TODO  roofline_time: not started
    2 of 8 checks pass; next: matmul_bytes

Outputs saved in the notebook (a stale FAIL from an earlier run) are never read.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labsim.course import notebook as nbk

MARK = {"pass": "PASS", "fail": "FAIL", "not attempted": "TODO", "waiting": "WAIT",
        "not run": "----"}


def package_labs() -> Path:
    """Where the package keeps the released labs (``labsim release`` writes them)."""
    import labsim

    return Path(labsim.__file__).resolve().parent / "data" / "labs"


def find_notebook(name: str | Path, cwd: Path | None = None) -> Path:
    """The notebook ``name`` names: a path; else the file of that name (or lab number, or
    stem) in the current folder or in a ``labs/`` folder of it or above it."""
    cwd = Path(cwd or Path.cwd())
    path = Path(name)
    if path.is_file():
        return path
    text = str(name)
    folders = [cwd, *(p / "labs" for p in (cwd, *cwd.parents))]
    for folder in folders:
        if not folder.is_dir():
            continue
        candidate = folder / path.name
        if candidate.is_file():
            return candidate
        for found in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
            if found.stem == text or found.stem.split("_", 1)[0] == text or (
                    text.endswith(".ipynb") and found.name == Path(text).name):
                return found
    raise ValueError(f"{name}: no such notebook (give its path, e.g. labs/00_why_gpus.ipynb, "
                     "or a lab number, e.g. 00)")


def find_release(notebook: Path, nb: Any | None = None) -> Path:
    """The released lab a learner's notebook is a copy of: the packaged release of the same
    name, else the one whose exercise cells the notebook has (a renamed copy)."""
    folder = package_labs()
    same = folder / notebook.name
    if same.is_file():
        return same
    if nb is None:
        nb = nbk.read(notebook)
    ids = {c.get("id") for c in nb.cells}
    for candidate in sorted(folder.glob("*.ipynb")):
        lab = json.loads(candidate.read_text(encoding="utf-8"))
        exercises = {c.get("id") for c in lab["cells"]
                     if c.get("metadata", {}).get("labsim", {}).get("role") == "exercise"}
        if exercises and exercises <= ids:
            return candidate
    raise ValueError(f"{notebook}: not a copy of one of the course's labs (no released lab "
                     "has its exercises); check the notebook the course gave you")


@dataclass(frozen=True)
class SelfCheck:
    """What ``run`` found: the grade of the notebook and its lines."""

    notebook: Path
    result: Any  # grade.Result
    wall_s: float

    @property
    def passed(self) -> int:
        return sum(s.passed for s in self.result.scores)

    @property
    def total(self) -> int:
        return len(self.result.scores)

    @property
    def ok(self) -> bool:
        return self.passed == self.total and self.result.status in ("ok", "tampered")

    def lines(self) -> list[str]:
        out = []
        for s in self.result.scores:
            state = s.status
            line = f"{MARK.get(state, 'FAIL')}  {s.check.name}"
            if state == "fail" and s.first is not None:
                line += f": case \"{s.first[0]}\": {s.first[1]}"
            elif state == "fail":
                line += ": " + s.detail.splitlines()[0]
            elif state == "not attempted":
                line += ": not started"
            elif state == "waiting":
                line += (": written, but it calls an exercise that is not started yet ("
                         + (s.first[1] if s.first else "NotImplementedError") + ")")
            elif state == "not run":
                line += ": " + s.detail
            out.append(line[:300])
        todo = [s.check.name for s in self.result.scores if not s.passed]
        summary = f"{self.passed} of {self.total} checks pass"
        if todo:
            summary += f"; next: {todo[0]}"
        elif self.ok:
            summary += ": the notebook is complete"
        out.append(summary)
        out += [f"note: {r}" for r in self.result.reasons]
        return out


def run(notebook: Path, *, timeout_cell: float = 300.0, timeout_notebook: float = 1800.0,
        keep: Path | None = None, release: Path | None = None) -> SelfCheck:
    """Grade ``notebook`` as the grader would (see the module docstring), against
    ``release`` (default: the package's copy of its lab)."""
    from labsim.course import grade as gr
    from labsim.course import sandbox as sb

    notebook = Path(notebook)
    if release is None:
        release = find_release(notebook, nbk.read(notebook))
    limits = sb.Limits(timeout_cell, max(timeout_notebook, timeout_cell), 4 * sb.GiB)
    options = gr.Options(limits=limits, jobs=1, keep_dir=keep, cache_dir=cache_dir())
    report = gr.grade(release, [notebook], options)
    return SelfCheck(notebook, report.results[0], report.wall_s)


def cache_dir() -> Path:
    """Where built graded copies are kept between checks (``$XDG_CACHE_HOME/labsim``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "labsim"
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        return Path(tempfile.gettempdir()) / "labsim-cache"


__all__ = ["SelfCheck", "cache_dir", "find_notebook", "find_release", "package_labs", "run"]
