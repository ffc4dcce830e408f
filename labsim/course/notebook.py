"""Reading, classifying and writing course notebooks, shared by release and grade.

A course notebook has four kinds of cell, told apart by their source:

- **exercise**: a code cell with a ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` block;
- **check**: a code cell whose first line is ``# NBVAL_CHECK_OUTPUT``;
- **solution-only**: any cell tagged ``solution-only`` (dropped from the release);
- everything else: narrative (markdown) and ordinary code.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import nbformat

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"
SOLUTION_ONLY = "solution-only"
STUB = 'raise NotImplementedError("write your solution here, then run the check below")'


class NotebookError(ValueError):
    """A notebook the course tooling cannot use; the message names the file and the cell."""


def cell_label(index: int, cell: Any) -> str:
    return f"cell {index} (id {cell.get('id', '?')!r})"


def read(path: Path) -> nbformat.NotebookNode:
    """Read a notebook, turning JSON and schema errors into ``NotebookError`` naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise NotebookError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotebookError(
            f"{path}: not valid notebook JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg})"
        ) from None
    if not isinstance(raw, dict) or "cells" not in raw:
        raise NotebookError(f"{path}: not a Jupyter notebook (no 'cells' list)")
    try:
        nb = nbformat.reads(text, as_version=4)
    except Exception as exc:  # noqa: BLE001 - nbformat raises many kinds
        raise NotebookError(f"{path}: not a valid notebook: {exc}") from None
    return nb


def is_check(cell: Any) -> bool:
    return cell.cell_type == "code" and cell.source.lstrip().startswith(CHECK_MARK)


def is_solution_only(cell: Any) -> bool:
    return SOLUTION_ONLY in cell.get("metadata", {}).get("tags", [])


def has_solution(cell: Any) -> bool:
    return BEGIN in cell.source or END in cell.source


def role(cell: Any) -> str:
    """'check', 'exercise', 'markdown' or 'code'."""
    if is_check(cell):
        return "check"
    if cell.cell_type == "code" and has_solution(cell):
        return "exercise"
    return "markdown" if cell.cell_type == "markdown" else cell.cell_type


def stub_out(source: str, where: str) -> str:
    """Replace each solution block of ``source`` by an indented ``raise NotImplementedError``.

    ``where`` names the file and cell in error messages.  Markers must come in
    BEGIN/END pairs, not nested, each on a line of its own.
    """
    out: list[str] = []
    inside = False
    begin_line = 0
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if BEGIN in line:
            if stripped != BEGIN:
                raise NotebookError(
                    f"{where}, line {number}: put '{BEGIN}' on a line of its own"
                )
            if inside:
                raise NotebookError(
                    f"{where}, line {number}: '{BEGIN}' inside a solution block opened on "
                    f"line {begin_line}; close it with '{END}' first"
                )
            inside, begin_line = True, number
            indent = line[: len(line) - len(line.lstrip())]
            out.append(indent + STUB)
        elif END in line:
            if stripped != END:
                raise NotebookError(
                    f"{where}, line {number}: put '{END}' on a line of its own"
                )
            if not inside:
                raise NotebookError(f"{where}, line {number}: '{END}' without a '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise NotebookError(
            f"{where}: '{BEGIN}' on line {begin_line} is never closed; add '{END}'"
        )
    return "\n".join(out)


def dumps(nb: nbformat.NotebookNode) -> str:
    """Deterministic JSON text of a notebook (sorted keys, one-space indent, final newline)."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so no partial file is ever left."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
