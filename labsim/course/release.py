"""Release: turn ``solutions/NN_topic.ipynb`` (the single source of a lab) into ``labs/``.

``release`` executes each solution notebook, keeps the output of every check cell (the PASS
line of a correct solution) and writes two files:

- ``solutions/NN_topic.ipynb`` normalised: ids on every cell, only check-cell outputs kept,
  so ``pytest --nbval-lax solutions/`` compares those lines against a fresh run;
- ``labs/NN_topic.ipynb``: solution blocks replaced by ``raise NotImplementedError(...)``,
  ``solution-only`` cells dropped, every output cleared.  A released lab shows no result it
  has not produced: each check cell keeps, in its metadata (``metadata.labsim``), which check
  it calls (``check``: ``"labsim.checks.<topic>:<name>"``), with which functions
  (``functions``) and the line the solution printed (``expected``:
  ``PASS <name>: k/k cases passed``) -- what ``labsim check`` compares a learner's run with
  and what ``labsim grade`` scores against.

A figure a cell draws must reach the learner: the release refuses a solution in which a cell
calls a ``labsim.plots`` function (``plots.gantt(...)``, or a name imported from
``labsim.plots``) and shows no image, unless every such call sits under an ``if`` on
``cuda`` (a figure only a GPU draws).

Both are written atomically and deterministically: releasing twice gives identical bytes.
``check`` derives the labs from the solutions as they are stored (without executing) and
names every lab that differs from ``labs/``.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from labsim.checks import SUMMARY_RE
from labsim.course import notebook as nbk
from labsim.course.notebook import NotebookError

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
KEPT_CELL_METADATA = ("tags", "points")
CELL_TIMEOUT_S = 600


@dataclass(frozen=True)
class Outcome:
    """What release did (or would do) for one lab."""

    name: str
    lab_path: Path
    changed: bool
    reason: str = ""


def _cell_id(stem: str, index: int, source: str) -> str:
    digest = hashlib.sha1(f"{stem}:{index}:{source}".encode()).hexdigest()
    return digest[:12]


def resolve_check(path: str, where: str) -> Any:
    """The ``labsim.checks`` ``Spec`` a check cell calls (``"module:name"``)."""
    from labsim.checks import Spec

    module, _, name = path.partition(":")
    try:
        spec = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        spec = None
    if not isinstance(spec, Spec):
        raise NotebookError(f"{where}: {module}.{name} is not a check of labsim.checks")
    return spec


def validate(nb: nbformat.NotebookNode, path: Path) -> None:
    """Raise ``NotebookError`` naming the file and cell for any misplaced or unbalanced marker,
    a stub that would raise when its cell is defined, or a check cell that is not one call of
    a labsim check."""
    for index, cell in enumerate(nb.cells):
        where = f"{path}: {nbk.cell_label(index, cell)}"
        if nbk.has_solution(cell):
            if cell.cell_type != "code":
                raise NotebookError(
                    f"{where}: solution markers are only allowed in code cells "
                    f"(this is a {cell.cell_type} cell)"
                )
            if nbk.is_check(cell):
                raise NotebookError(f"{where}: a check cell cannot contain a solution block")
            nbk.stub_defines(nbk.stub_out(cell.source, where), where)
        elif nbk.is_check(cell):
            spec_path, fns = nbk.check_call(cell.source, where)
            spec = resolve_check(spec_path, where)
            if len(fns) != spec.functions:
                raise NotebookError(f"{where}: {spec.title} takes {spec.functions} "
                                    f"function(s), the cell passes {len(fns)}")


def _clean_outputs(outputs: list) -> list:
    """Keep what a check printed, without timing metadata; merge adjacent stream pieces;
    keep a redrawn line's last drawing only."""
    cleaned: list = []
    for out in outputs:
        out = copy.deepcopy(out)
        if out.output_type == "stream":
            if (
                cleaned
                and cleaned[-1].output_type == "stream"
                and cleaned[-1].name == out.name
            ):
                cleaned[-1].text += out.text
                continue
            cleaned.append(nbformat.v4.new_output("stream", name=out.name, text=out.text))
        elif out.output_type in ("display_data", "execute_result"):
            cleaned.append(nbformat.v4.new_output("display_data", data=out.data))
        else:  # error
            cleaned.append(out)
    for out in cleaned:
        if out.output_type == "stream":
            out.text = nbk.as_shown(out.text)
    return [o for o in cleaned if o.output_type != "stream" or o.text]


def normalize_solution(
    nb: nbformat.NotebookNode, stem: str, executed: nbformat.NotebookNode | None = None
) -> nbformat.NotebookNode:
    """The stored form of a solution notebook: ids, check outputs only, minimal metadata.

    With ``executed`` (the same notebook after a run) check outputs come from that run;
    otherwise the check outputs already stored are kept.
    """
    out = nbformat.v4.new_notebook()
    out.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
    seen: set[str] = set()
    for index, cell in enumerate(nb.cells):
        source = cell.source
        cid = cell.get("id") or _cell_id(stem, index, source)
        if cid in seen:
            cid = _cell_id(stem, index, source)
        seen.add(cid)
        meta = {k: cell.metadata[k] for k in KEPT_CELL_METADATA if k in cell.metadata}
        if cell.cell_type == "code":
            new = nbformat.v4.new_code_cell(source, metadata=meta)
            if nbk.is_check(cell):
                src = executed.cells[index] if executed is not None else cell
                new.outputs = _clean_outputs(src.get("outputs", []))
                new.execution_count = index + 1 if new.outputs else None
        elif cell.cell_type == "markdown":
            new = nbformat.v4.new_markdown_cell(source, metadata=meta)
        else:
            new = nbformat.v4.new_raw_cell(source, metadata=meta)
        new.id = cid
        out.cells.append(new)
    return out


def _pass_line(cell: Any, where: str, title: str) -> str:
    text = "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")
    match = SUMMARY_RE.fullmatch(text.strip())
    if not match or match["status"] != "PASS" or match["passed"] != match["total"]:
        raise NotebookError(f"{where}: the solution's check printed {text.strip()[:80]!r}, "
                            "not its PASS line; run `labsim release` to execute it")
    if match["title"] != title:
        raise NotebookError(f"{where}: the cell calls the check {title!r} but printed "
                            f"{match.group(0)!r}")
    return match.group(0)


def make_lab(solution: nbformat.NotebookNode, path: Path) -> nbformat.NotebookNode:
    """The learner's notebook derived from a normalised solution notebook (see the module
    docstring: no outputs; each check cell's expected line in its metadata)."""
    lab = nbformat.v4.new_notebook()
    lab.metadata = copy.deepcopy(solution.metadata)
    for index, cell in enumerate(solution.cells):
        if nbk.is_solution_only(cell):
            continue
        new = copy.deepcopy(cell)
        kind = nbk.role(cell)
        where = f"{path}: {nbk.cell_label(index, cell)}"
        meta: dict[str, Any] = {"role": kind}
        if kind == "exercise":
            new.source = nbk.stub_out(cell.source, where)
        elif kind == "check":
            spec_path, fns = nbk.check_call(cell.source, where)
            spec = resolve_check(spec_path, where)
            meta.update(check=spec_path, functions=list(fns),
                        expected=_pass_line(cell, where, spec.title))
        if cell.cell_type == "code":
            new.outputs = []
            new.execution_count = None
        new.metadata["labsim"] = meta
        lab.cells.append(new)
    return lab


def execute(
    nb: nbformat.NotebookNode, path: Path, timeout_s: int = CELL_TIMEOUT_S
) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel (cwd = its folder); errors name the cell."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    run = copy.deepcopy(nb)
    client = NotebookClient(
        run,
        timeout=timeout_s,
        kernel_name="python3",
        resources={"metadata": {"path": str(Path(path).parent)}},
    )
    try:
        client.execute()
    except CellExecutionError as exc:
        raise NotebookError(
            f"{path}: a cell failed while executing the solution:\n{exc}"
        ) from None
    return run


def _python(source: str) -> str:
    """A cell's source with IPython magics and shell lines (``%pip``, ``!ls``) blanked."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def _plot_names(nb: nbformat.NotebookNode) -> set[str]:
    """Names a notebook imports from ``labsim.plots`` (``from labsim.plots import gantt``)."""
    names: set[str] = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(_python(cell.source))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labsim.plots"):
                names.update(a.asname or a.name for a in node.names)
    return names


def _draws(source: str, plot_names: set[str]) -> bool:
    """Whether ``source`` calls a plotting function outside an ``if`` on ``cuda``."""
    try:
        tree = ast.parse(_python(source))
    except SyntaxError:
        return False

    def visit(node: ast.AST, gpu_only: bool) -> bool:
        if isinstance(node, ast.If) and "cuda" in ast.unparse(node.test):
            return any(visit(child, True) for child in node.body) or any(
                visit(child, gpu_only) for child in node.orelse)
        if isinstance(node, ast.Call) and not gpu_only:
            f = node.func
            if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                    and f.value.id == "plots") or (isinstance(f, ast.Name)
                                                   and f.id in plot_names):
                return True
        return any(visit(child, gpu_only) for child in ast.iter_child_nodes(node))

    return visit(tree, False)


def unshown_figures(executed: nbformat.NotebookNode) -> list[int]:
    """Indices of the executed cells that call a plotting function and show no image."""
    plot_names = _plot_names(executed)
    unshown = []
    for index, cell in enumerate(executed.cells):
        if cell.cell_type != "code" or not _draws(cell.source, plot_names):
            continue
        if not any(out.output_type in ("display_data", "execute_result")
                   and "image/png" in out.get("data", {}) for out in cell.outputs):
            unshown.append(index)
    return unshown


def solution_paths(solutions_dir: Path, names: Iterable[str] = ()) -> list[Path]:
    paths = sorted(Path(solutions_dir).glob("[0-9][0-9]_*.ipynb"))
    wanted = list(names)
    if wanted:
        paths = [p for p in paths if any(p.stem == n or p.stem.startswith(n) for n in wanted)]
        if not paths:
            raise NotebookError(f"no solution notebook in {solutions_dir} matches {wanted}")
    return paths


def release_one(path: Path, labs_dir: Path, run: bool = True,
                package_dir: Path | None = None) -> Outcome:
    """Execute (if ``run``) and release one solution notebook, rewriting both files (and the
    package's copy of the lab in ``package_dir``, which ``labsim check`` grades against)."""
    nb = nbk.read(path)
    validate(nb, path)
    executed = execute(nb, path) if run else None
    if executed is not None and (unshown := unshown_figures(executed)):
        raise NotebookError(
            f"{path}: cell(s) {', '.join(map(str, unshown))} call a labsim.plots function but "
            "show no image: return the figure, or display() it")
    solution = normalize_solution(nb, path.stem, executed)
    lab = make_lab(solution, path)
    sol_text, lab_text = nbk.dumps(solution), nbk.dumps(lab)
    lab_path = Path(labs_dir) / path.name
    changed = (
        not lab_path.exists()
        or lab_path.read_text(encoding="utf-8") != lab_text
        or path.read_text(encoding="utf-8") != sol_text
    )
    nbk.write_atomic(path, sol_text)
    nbk.write_atomic(lab_path, lab_text)
    if package_dir is not None:
        copy_path = Path(package_dir) / path.name
        changed = changed or not copy_path.exists() or copy_path.read_text(
            encoding="utf-8") != lab_text
        nbk.write_atomic(copy_path, lab_text)
    return Outcome(path.stem, lab_path, changed)


def check_one(path: Path, labs_dir: Path, package_dir: Path | None = None) -> Outcome:
    """Compare ``labs/`` (and the package's copy) with the release of the stored solution,
    without executing it."""
    lab_path = Path(labs_dir) / path.name
    nb = nbk.read(path)
    validate(nb, path)
    solution = normalize_solution(nb, path.stem)
    if nbk.dumps(solution) != path.read_text(encoding="utf-8"):
        return Outcome(path.stem, lab_path, True, "the solution notebook is not normalised")
    missing = [
        nbk.cell_label(i, c)
        for i, c in enumerate(solution.cells)
        if nbk.is_check(c) and not c.outputs
    ]
    if missing:
        return Outcome(
            path.stem,
            lab_path,
            True,
            f"check cells without a stored output: {', '.join(missing)}",
        )
    if not lab_path.exists():
        return Outcome(path.stem, lab_path, True, f"{lab_path} does not exist")
    fresh = nbk.dumps(make_lab(solution, path))
    if lab_path.read_text(encoding="utf-8") != fresh:
        return Outcome(path.stem, lab_path, True, f"{lab_path} differs from a fresh release")
    if package_dir is not None:
        copy_path = Path(package_dir) / path.name
        if not copy_path.is_file() or copy_path.read_text(encoding="utf-8") != fresh:
            return Outcome(path.stem, lab_path, True,
                           f"{copy_path} (the copy `labsim check` uses) differs from labs/")
    return Outcome(path.stem, lab_path, False)


def release(
    solutions_dir: Path,
    labs_dir: Path,
    names: Iterable[str] = (),
    *,
    run: bool = True,
    jobs: int = 1,
    package_dir: Path | None = None,
) -> list[Outcome]:
    """Release the selected labs (all by default), ``jobs`` notebooks at a time; with
    ``package_dir`` (the course's own release: ``labsim/data/labs``) the package keeps a copy
    of each lab for ``labsim check``."""
    paths = solution_paths(solutions_dir, names)
    for path in paths:  # fail fast on malformed input, before any execution or write
        validate(nbk.read(path), path)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda p: release_one(p, labs_dir, run, package_dir), paths))


def check(solutions_dir: Path, labs_dir: Path, names: Iterable[str] = (),
          package_dir: Path | None = None) -> list[Outcome]:
    """One ``Outcome`` per lab, plus one for each lab in ``labs_dir`` without a solution."""
    paths = solution_paths(solutions_dir, names)
    outcomes = [check_one(p, labs_dir, package_dir) for p in paths]
    if not list(names):
        sources = {p.name for p in paths}
        for orphan in sorted(Path(labs_dir).glob("*.ipynb")):
            if orphan.name not in sources:
                outcomes.append(
                    Outcome(orphan.stem, orphan, True, "no solution notebook for this lab")
                )
    return outcomes
