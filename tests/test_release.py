"""Release: solutions -> labs, exact, deterministic, and safe on malformed input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labsim.course import notebook as nbk
from labsim.course import release as rel
from labsim.course.notebook import NotebookError

from .conftest import make_notebook

pytestmark = pytest.mark.slow


def test_stub_out_keeps_indentation_and_code_around_the_block() -> None:
    src = "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n"
    assert nbk.stub_out(src, "here") == (
        f"def f(x):\n    y = 1\n    {nbk.STUB}"
    )
    top = "### BEGIN SOLUTION\nz = 3\n### END SOLUTION\nprint(z)"
    assert nbk.stub_out(top, "here") == f"{nbk.STUB}\nprint(z)"


@pytest.mark.parametrize(
    "source, message",
    [
        ("### BEGIN SOLUTION\nx = 1\n", "never closed"),
        ("x = 1\n### END SOLUTION\n", "without a"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "inside a solution"),
        ("x = 1  ### BEGIN SOLUTION\n### END SOLUTION\n", "line of its own"),
    ],
)
def test_unbalanced_markers_name_the_line(source: str, message: str) -> None:
    with pytest.raises(NotebookError, match=message):
        nbk.stub_out(source, "f.ipynb: cell 3")


def test_release_writes_stubs_and_keeps_expected_lines_out_of_sight(tiny_course) -> None:
    solutions, labs = tiny_course
    [outcome] = rel.release(solutions, labs)
    assert outcome.changed
    lab = nbformat.read(labs / "00_tiny.ipynb", as_version=4)
    sources = [c.source for c in lab.cells]
    assert not any("only in the solution" in s for s in sources)
    assert not any("return a + b" in s or "return x * k" in s for s in sources)
    assert "        " + nbk.STUB in lab.cells[4].source  # method body, 8 spaces
    roles = [c.metadata["labsim"]["role"] for c in lab.cells]
    assert roles == ["markdown", "code", "exercise", "check", "exercise", "check", "code"]
    checks = [c for c in lab.cells if nbk.is_check(c)]
    # a released lab shows no result it has not produced: the PASS line is metadata
    assert all(c.outputs == [] and c.execution_count is None for c in lab.cells
               if c.cell_type == "code")
    assert [c.metadata["labsim"] for c in checks] == [
        {"role": "check", "check": "labsim.checks._tiny:add", "functions": ["add"],
         "expected": "PASS add: 5/5 cases passed"},
        {"role": "check", "check": "labsim.checks._tiny:scale", "functions": ["scale"],
         "expected": "PASS scale: 6/6 cases passed"}]
    assert checks[0].metadata["points"] == 2
    solution = nbformat.read(solutions / "00_tiny.ipynb", as_version=4)
    assert [c.outputs[0].text for c in solution.cells if nbk.is_check(c)] == [
        "PASS add: 5/5 cases passed\n", "PASS scale: 6/6 cases passed\n"]


def test_release_is_byte_identical_and_ids_are_stable(tiny_course) -> None:
    solutions, labs = tiny_course
    rel.release(solutions, labs)
    first = ((labs / "00_tiny.ipynb").read_bytes(), (solutions / "00_tiny.ipynb").read_bytes())
    [again] = rel.release(solutions, labs)
    assert not again.changed
    second = ((labs / "00_tiny.ipynb").read_bytes(), (solutions / "00_tiny.ipynb").read_bytes())
    assert first == second
    sol_ids = [c.id for c in nbformat.read(solutions / "00_tiny.ipynb", as_version=4).cells]
    lab_ids = [c.id for c in nbformat.read(labs / "00_tiny.ipynb", as_version=4).cells]
    assert len(set(sol_ids)) == len(sol_ids)
    assert lab_ids == [i for k, i in enumerate(sol_ids) if k != 6]  # solution-only dropped


def test_check_names_the_stale_lab(tiny_course) -> None:
    solutions, labs = tiny_course
    rel.release(solutions, labs)
    assert not any(o.changed for o in rel.check(solutions, labs))
    path = labs / "00_tiny.ipynb"
    nb = json.loads(path.read_text())
    nb["cells"][0]["source"] = "# edited by hand"
    path.write_text(json.dumps(nb))
    [stale] = rel.check(solutions, labs)
    assert stale.changed and "differs" in stale.reason
    result = subprocess.run(
        [sys.executable, "-m", "labsim", "release", "--check", "--solutions", str(solutions),
         "--labs", str(labs)], capture_output=True, text=True)
    assert result.returncode == 1
    assert "stale: 00_tiny" in result.stdout


def test_check_flags_a_lab_without_solution_and_an_unreleased_solution(tiny_course) -> None:
    solutions, labs = tiny_course
    [unreleased] = rel.check(solutions, labs)
    assert unreleased.changed  # never released: not normalised, no stored check outputs
    rel.release(solutions, labs)
    (labs / "99_orphan.ipynb").write_text((labs / "00_tiny.ipynb").read_text())
    reasons = {o.name: o.reason for o in rel.check(solutions, labs) if o.changed}
    assert reasons == {"99_orphan": "no solution notebook for this lab"}


@pytest.mark.parametrize(
    "cells, message",
    [
        ([("markdown", "### BEGIN SOLUTION\ntext\n### END SOLUTION")], "only allowed in code"),
        ([("code", "x = 1"), ("code", "def f():\n    ### BEGIN SOLUTION\n    pass")],
         r"cell 1 .*never closed"),
    ],
)
def test_malformed_solution_is_refused_before_anything_is_written(
        tmp_path: Path, cells, message) -> None:
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    solutions.mkdir()
    path = solutions / "03_bad.ipynb"
    nbformat.write(make_notebook(cells), path)
    before = path.read_bytes()
    with pytest.raises(NotebookError, match=message) as info:
        rel.release(solutions, labs)
    assert "03_bad.ipynb" in str(info.value)
    assert path.read_bytes() == before
    assert not labs.exists() or not list(labs.iterdir())


def test_invalid_json_names_the_file_and_cli_exits_2(tmp_path: Path) -> None:
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    (solutions / "05_broken.ipynb").write_text('{"cells": [')
    with pytest.raises(NotebookError, match=r"05_broken.ipynb: not valid notebook JSON"):
        rel.release(solutions, tmp_path / "labs")
    result = subprocess.run(
        [sys.executable, "-m", "labsim", "release", "--solutions", str(solutions),
         "--labs", str(tmp_path / "labs")], capture_output=True, text=True)
    assert result.returncode == 2
    assert "05_broken.ipynb" in result.stderr
    assert not (tmp_path / "labs" / "05_broken.ipynb").exists()


def test_a_failing_solution_is_reported_and_leaves_no_file(tmp_path: Path) -> None:
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    solutions.mkdir()
    nbformat.write(make_notebook([("code", "1 / 0")]), solutions / "04_err.ipynb")
    with pytest.raises(NotebookError, match="ZeroDivisionError"):
        rel.release(solutions, labs)
    assert not (labs / "04_err.ipynb").exists()


def _nbval(path: Path) -> dict[str, str]:
    """Run nbval on ``path``; map each test id to its outcome."""
    report = path.with_suffix(".xml")
    subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider", "-q",
         "--nbval-cell-timeout=60", f"--junitxml={report}", str(path)],
        capture_output=True, text=True, cwd=path.parent)
    import xml.etree.ElementTree as ET

    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        outcomes[case.get("name")] = "failed" if failed else "passed"
    return outcomes


def _labsim_check(path: Path, lab: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labsim", "check", "--lab", str(lab),
                           str(path), "--timeout-cell", "60"],
                          capture_output=True, text=True, cwd=path.parent, timeout=600)


def test_labsim_check_grades_the_notebook_as_the_grader_does(tiny_course) -> None:
    solutions, labs = tiny_course
    rel.release(solutions, labs)
    lab_path = labs / "00_tiny.ipynb"
    stub = _labsim_check(lab_path, lab_path)
    assert stub.returncode == 1, stub.stdout + stub.stderr
    # one line per check in the notebook's words, no traceback through labsim's code
    assert "TODO  add: not started" in stub.stdout
    assert "0 of 2 checks pass; next: add" in stub.stdout
    assert "Traceback" not in stub.stdout and "labsim/checks" not in stub.stdout
    nb = nbformat.read(lab_path, as_version=4)
    for cell in nb.cells:
        if cell.metadata["labsim"]["role"] == "exercise":
            cell.source = cell.source.replace(nbk.STUB, "return a + b" if "add" in cell.source
                                              else "return x * k")
    done = labs / "00_tiny_done.ipynb"
    nbformat.write(nb, done)
    ran = _labsim_check(done, lab_path)
    assert ran.returncode == 0 and "2 of 2 checks pass" in ran.stdout, ran.stdout
    # The trick that hides errors from nbval (and a printed PASS line) do not pass a check.
    nb = nbformat.read(lab_path, as_version=4)
    nb.cells.insert(1, nbformat.v4.new_code_cell(
        "get_ipython().showtraceback = lambda *a, **k: None\n"
        "print('PASS add: 5/5 cases passed')"))
    hidden = labs / "00_tiny_hidden.ipynb"
    nbformat.write(nb, hidden)
    assert _labsim_check(hidden, lab_path).returncode == 1
    outcomes = _nbval_expected(hidden)  # the in-notebook check cells fail too
    code = [c for c in nb.cells if c.cell_type == "code"]
    for index in [i for i, c in enumerate(code) if nbk.is_check(c)]:
        assert outcomes[f"Cell {index}"] == "failed", outcomes
    assert set(_nbval(solutions / "00_tiny.ipynb").values()) == {"passed"}


def _nbval_expected(path: Path) -> dict[str, str]:
    report = path.with_suffix(".xml")
    subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "-p", "labsim.course._nbval_expected",
         "-p", "no:cacheprovider", "-q", "--nbval-cell-timeout=60", f"--junitxml={report}",
         str(path)], capture_output=True, text=True, cwd=path.parent)
    import xml.etree.ElementTree as ET

    return {case.get("name"): "failed" if case.find("failure") is not None
            or case.find("error") is not None else "passed"
            for case in ET.parse(report).getroot().iter("testcase")}


@pytest.mark.parametrize(("source", "message"), [
    ("class A:\n    ### BEGIN SOLUTION\n    x = 1\n    ### END SOLUTION", "outside a function"),
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION", "outside a function"),
])
def test_a_stub_that_would_raise_when_defined_is_refused(tmp_path: Path, source: str,
                                                          message: str) -> None:
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    nbformat.write(make_notebook([("code", source)]), solutions / "07_bad.ipynb")
    with pytest.raises(NotebookError, match=message):
        rel.release(solutions, tmp_path / "labs", run=False)


@pytest.mark.parametrize("source", ["# NBVAL_CHECK_OUTPUT\nrun_check('x', f, [])",
                                    "# NBVAL_CHECK_OUTPUT\ncheck.roofline.nope(f)",
                                    "# NBVAL_CHECK_OUTPUT\ncheck.roofline.mfu(f())",
                                    "# NBVAL_CHECK_OUTPUT\ncheck.roofline.mfu(f, g)"])
def test_a_check_cell_must_be_one_call_of_a_labsim_check(tmp_path: Path, source: str) -> None:
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    nbformat.write(make_notebook([("code", source)]), solutions / "08_bad.ipynb")
    with pytest.raises(NotebookError, match="check"):
        rel.release(solutions, tmp_path / "labs", run=False)


def test_release_and_check_refuse_bad_input_in_one_line(tmp_path: Path, capsys) -> None:
    from labsim.cli import main

    solutions = tmp_path / "solutions"
    solutions.mkdir()
    (solutions / "06_utf16.ipynb").write_bytes('{"cells": []}'.encode("utf-16"))
    fifo = tmp_path / "lab.ipynb"
    os.mkfifo(fifo)
    plain = tmp_path / "plain.ipynb"
    nbformat.write(make_notebook([("code", "x = 1")]), plain)
    for argv in (["release", "--jobs", "0"], ["release", "--solutions", str(solutions),
                                              "--labs", str(tmp_path / "labs")],
                 ["check", str(tmp_path / "nope.ipynb")], ["check", str(fifo)],
                 ["check", str(plain)], ["check", str(plain), "--timeout-cell", "nan"]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error" in err[0], (argv, err)


def test_a_progress_bar_before_the_pass_line_is_not_stored() -> None:
    """A check that draws a progress bar ("\\r"-redrawn, erased at the end) stores only its
    PASS line, as a front end and nbval show it."""
    from labsim.course.release import _clean_outputs

    outs = [nbformat.v4.new_output("stream", name="stdout", text="ring: 0/3 [00:00]\r"),
            nbformat.v4.new_output("stream", name="stdout",
                                   text="ring: 3/3 [00:04]\r" + " " * 20 + "\r"),
            nbformat.v4.new_output("stream", name="stdout", text="PASS ring: 8/8 cases passed\n")]
    [kept] = _clean_outputs(outs)
    assert kept.text == "PASS ring: 8/8 cases passed\n"
    # a bar left alone (the check failed after it) is kept as drawn: nothing is invented
    [alone] = _clean_outputs(outs[:1])
    assert alone.text == "ring: 0/3 [00:00]\r"


def test_a_figure_drawn_in_a_loop_or_assigned_to_a_name_is_shown() -> None:
    """A figure shows once whether the cell returns it, names it or draws it in a loop; the
    release refuses a plotting cell that shows no image, except under an ``if`` on cuda."""
    nb = nbformat.v4.new_notebook()
    xy = "[1, 2], {'a': [1, 2]}, xlabel='x', ylabel='y'"
    nb.cells = [
        nbformat.v4.new_code_cell("from labsim import plots\nfrom labsim.plots import scaling"),
        nbformat.v4.new_code_cell(f"for i in range(2):\n    plots.scaling({xy})"),
        nbformat.v4.new_code_cell(f"fig = scaling({xy})"),
        nbformat.v4.new_code_cell(f"scaling({xy})"),
        nbformat.v4.new_code_cell(f"if 'cuda' == 'no':\n    plots.scaling({xy})"),
    ]
    executed = rel.execute(nb, Path("."))
    images = [sum("image/png" in o.get("data", {}) for o in c.outputs) for c in executed.cells]
    assert images == [0, 2, 1, 1, 0]
    assert rel.unshown_figures(executed) == []
    executed.cells[2].outputs = []  # what a cell that drew but showed nothing leaves
    assert rel.unshown_figures(executed) == [2]
