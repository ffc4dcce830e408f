"""The released labs: equal to a fresh release, and every check cell fails on the stubs.

``pytest --nbval-lax solutions/`` (run by the README's test command) shows each check passes
on the solution; here each released lab is run as a learner first opens it -- with the trick
that hides tracebacks from nbval injected, so a check that "passes" by raising quietly is
caught too -- and every check cell must fail.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from labsim.course import notebook as nbk
from labsim.course import release as rel

from .conftest import ROOT

pytestmark = pytest.mark.slow

LABS = sorted((ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))
HIDE_TRACEBACKS = "get_ipython().showtraceback = lambda *a, **k: None"


def test_labs_equal_a_fresh_release_of_solutions() -> None:
    stale = [f"{o.name}: {o.reason}" for o in rel.check(ROOT / "solutions", ROOT / "labs")
             if o.changed]
    assert not stale, "run `labsim release`: " + "; ".join(stale)


def test_every_lab_has_a_solution_with_checks() -> None:
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        nb = nbk.read(path)
        assert any(nbk.is_check(c) for c in nb.cells), f"{path.name} has no check cell"
        assert any(nbk.role(c) == "exercise" for c in nb.cells), f"{path.name}: no exercise"


def nbval_outcomes(path: Path, timeout_s: int = 300) -> dict[str, str]:
    """Run nbval on a notebook; map nbval's test names ('Cell 3', counting code cells only)
    to 'passed' or 'failed'."""
    report = path.with_suffix(".junit.xml")
    subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider", "-q",
         f"--nbval-cell-timeout={timeout_s}", f"--junitxml={report}", path.name],
        capture_output=True, text=True, cwd=path.parent, timeout=1800)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = case.find("failure") is not None or case.find("error") is not None
        outcomes[case.get("name")] = "failed" if bad else "passed"
    return outcomes


@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_every_check_cell_fails_on_the_released_stubs(lab: Path, tmp_path: Path) -> None:
    nb = nbformat.read(lab, as_version=4)
    nb.cells.insert(1, nbformat.v4.new_code_cell(HIDE_TRACEBACKS))
    copy = tmp_path / lab.name  # run beside the lab's own files, as a learner would
    nbformat.write(nb, copy)
    for extra in lab.parent.iterdir():
        if extra.suffix != ".ipynb" and not extra.name.startswith("."):
            (tmp_path / extra.name).symlink_to(extra)
    code = [c for c in nb.cells if c.cell_type == "code"]
    checks = [f"Cell {i}" for i, c in enumerate(code) if nbk.is_check(c)]
    assert checks, f"{lab.name} has no check cells"
    outcomes = nbval_outcomes(copy)
    passing = [name for name in checks if outcomes.get(name) != "failed"]
    assert not passing, f"{lab.name}: these check cells pass without the exercise: {passing}"
