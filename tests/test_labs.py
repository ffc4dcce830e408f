"""The released labs can be done: equal to a fresh release, showing no result they did not
produce, and, run top to bottom as a learner first opens them, every exercise cell defines its
stub without error and every check cell fails *only* because a stub raised
``NotImplementedError`` (``ExerciseNotDone``, every case "not implemented yet") -- not with a
``NameError`` because a stub broke its class, not by printing something else.

``pytest --nbval-lax solutions/`` (run by the README's test command) shows each check passes
on the solution.  The tiny lab the grader's tests use is held to the same rule.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

from labsim.course import notebook as nbk
from labsim.course import release as rel

from .conftest import ROOT

pytestmark = pytest.mark.slow

LABS = sorted((ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))


def test_labs_equal_a_fresh_release_of_solutions() -> None:
    stale = [f"{o.name}: {o.reason}" for o in rel.check(ROOT / "solutions", ROOT / "labs")
             if o.changed]
    assert not stale, "run `labsim release`: " + "; ".join(stale)


def test_every_lab_has_a_solution_with_checks() -> None:
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        nb = nbk.read(path)
        assert any(nbk.is_check(c) for c in nb.cells), f"{path.name} has no check cell"
        assert any(nbk.role(c) == "exercise" for c in nb.cells), f"{path.name}: no exercise"


@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_a_released_lab_shows_no_result_it_has_not_produced(lab: Path) -> None:
    nb = nbformat.read(lab, as_version=4)
    shown = [c.id for c in nb.cells if c.cell_type == "code"
             and (c.outputs or c.execution_count is not None)]
    assert shown == []
    checks = [c for c in nb.cells if nbk.is_check(c)]
    assert checks and all(c.metadata["labsim"]["expected"].startswith("PASS ") for c in checks)
    assert "Run All stops at the first unfinished exercise" in next(
        c.source for c in nb.cells if c.cell_type == "markdown")


def run_as_opened(path: Path, workdir: Path, timeout_s: int = 300) -> nbformat.NotebookNode:
    """Execute a lab top to bottom in a fresh kernel, going on after errors (as Run All
    would if it did not stop), in ``workdir``; return the executed notebook."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout_s, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(workdir)}}).execute()
    return nb


def doable_problems(nb: nbformat.NotebookNode) -> list[str]:
    """What keeps a released lab from being done: an exercise cell that raises when run, or
    a check cell that does not fail with every case not implemented yet."""
    problems = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        role = cell.metadata.get("labsim", {}).get("role")
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if role == "exercise" and errors:
            problems.append(f"cell {index} (exercise) raised {errors[0].ename}: "
                            f"{errors[0].evalue[:120]}")
        elif role == "check":
            if not errors or errors[0].ename != "ExerciseNotDone":
                what = f"{errors[0].ename}: {errors[0].evalue[:160]}" if errors else "passed"
                problems.append(f"cell {index} (check) {what}")
            elif "not implemented yet" not in errors[0].evalue:
                problems.append(f"cell {index} (check): {errors[0].evalue[:160]}")
    return problems


@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_every_released_lab_can_be_done(lab: Path, tmp_path: Path) -> None:
    for extra in lab.parent.iterdir():  # run beside the lab's own files, as a learner would
        if extra.suffix != ".ipynb" and not extra.name.startswith("."):
            (tmp_path / extra.name).symlink_to(extra)
    problems = doable_problems(run_as_opened(lab, tmp_path))
    assert not problems, f"{lab.name}: " + "; ".join(problems)


def test_the_tiny_grading_lab_can_be_done(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
    import gradelab

    lab = gradelab.release_lab(tmp_path)
    assert doable_problems(run_as_opened(lab, tmp_path)) == []


def test_a_class_level_stub_is_caught(tmp_path: Path) -> None:
    """What lab 08 shipped once: the release's own guard refuses it, and were it released,
    the check would fail with a NameError, which this test reports."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("from labsim import checks as check\nimport labsim.checks._tiny",
                                  metadata={"labsim": {"role": "code"}}),
        nbformat.v4.new_code_cell("class Adder:\n    " + nbk.STUB + "\n\nadd = Adder",
                                  metadata={"labsim": {"role": "exercise"}}),
        nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\ncheck._tiny.add(add)",
                                  metadata={"labsim": {"role": "check"}}),
    ]
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    problems = doable_problems(run_as_opened(path, tmp_path))
    assert any("exercise) raised NotImplementedError" in p for p in problems)
    assert any("NameError" in p for p in problems)
    with pytest.raises(nbk.NotebookError, match="outside a function body"):
        nbk.stub_defines(nb.cells[1].source, "broken")
