"""Reading, classifying and writing course notebooks, shared by release and grade.

A course notebook has four kinds of cell, told apart by their source:

- **exercise**: a code cell with a ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` block;
- **check**: a code cell whose first line is ``# NBVAL_CHECK_OUTPUT``;
- **solution-only**: any cell tagged ``solution-only`` (dropped from the release);
- everything else: narrative (markdown) and ordinary code.
"""

from __future__ import annotations

import ast
import json
import os
import re
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


def as_shown(text: str) -> str:
    """A stream's text as a front end shows it: a line redrawn after ``\r`` (a progress bar)
    keeps only its last drawing, as JupyterLab, Colab and nbval read it."""
    return re.sub(r"^.*\r(?=[^\n])", "", text, flags=re.MULTILINE)


def cell_label(index: int, cell: Any) -> str:
    return f"cell {index} (id {cell.get('id', '?')!r})"


MAX_NOTEBOOK_BYTES = 64 * 2**20


def read(path: Path) -> nbformat.NotebookNode:
    """Read a notebook (a regular file, never a FIFO or device, at most 64 MiB), turning
    decoding, JSON and schema errors into ``NotebookError`` naming the file."""
    import stat

    path = Path(path)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise NotebookError(f"{path}: not a regular file")
        if info.st_size > MAX_NOTEBOOK_BYTES:
            raise NotebookError(f"{path}: {info.st_size} bytes, over the {MAX_NOTEBOOK_BYTES} "
                                "byte limit of a notebook")
        with open(path, "rb") as fh:
            data = fh.read(MAX_NOTEBOOK_BYTES + 1)
    except OSError as exc:
        raise NotebookError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotebookError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    try:
        raw = json.loads(text)
    except RecursionError:
        raise NotebookError(f"{path}: JSON nested too deeply") from None
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


def check_call(source: str, where: str) -> tuple[str, tuple[str, ...]]:
    """``("labsim.checks.<topic>:<name>", (function names...))`` of a check cell, whose code
    must be one call ``check.<topic>.<name>(fn, ...)`` (``check`` is ``labsim.checks``)
    taking the exercises' functions by name."""
    try:
        body = ast.parse(source).body
    except SyntaxError as exc:
        raise NotebookError(f"{where}: the check cell is not valid Python ({exc.msg})") from None
    call = body[0].value if len(body) == 1 and isinstance(body[0], ast.Expr) else None
    chain: list[str] = []
    func = call.func if isinstance(call, ast.Call) else None
    while isinstance(func, ast.Attribute):
        chain.insert(0, func.attr)
        func = func.value
    if (not isinstance(call, ast.Call) or not isinstance(func, ast.Name) or func.id != "check"
            or len(chain) < 2 or call.keywords
            or not all(isinstance(a, ast.Name) for a in call.args)):
        raise NotebookError(
            f"{where}: a check cell makes one call, check.<topic>.<name>(fn, ...), passing the "
            "exercise functions by name"
        )
    module = ".".join(["labsim.checks", *chain[:-1]])
    return f"{module}:{chain[-1]}", tuple(a.id for a in call.args)  # type: ignore[attr-defined]


def stub_defines(source: str, where: str) -> None:
    """Raise ``NotebookError`` unless every ``raise NotImplementedError`` of a stubbed
    exercise sits inside a function body, so running the released cell defines its functions
    and classes (a stub in a class body or at the top level would raise at once)."""
    tree = ast.parse(source)

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Raise) and not in_function and STUB.split("(")[0].split()[
                    -1] in ast.unparse(child):
                raise NotebookError(
                    f"{where}, line {child.lineno}: a solution block outside a function body "
                    "becomes a raise that runs when the cell is defined; put the block inside "
                    "a method or function"
                )
            walk(child, in_function or isinstance(child, (ast.FunctionDef,
                                                          ast.AsyncFunctionDef)))

    walk(tree, False)


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
