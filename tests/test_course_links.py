"""Launching the labs: the Colab setup cell (both ways), README badges, Binder's config."""

from __future__ import annotations

import re
import shlex
import sys
import types
from pathlib import Path

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

from labsim.course.links import (
    RELEASE,
    REPOSITORY,
    SETUP_CELL,
    binder_url,
    colab_url,
    restart_note,
)

from .conftest import ROOT

NOTEBOOKS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")) + sorted(
    (ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[f"{p.parent.name}/{p.stem}" for p in NOTEBOOKS])
def test_the_first_code_cell_is_the_setup_cell(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert first.source == SETUP_CELL


class FakeShell:
    """Stands in for get_ipython(): records the magics a cell runs."""

    def __init__(self) -> None:
        self.magics: list[tuple[str, str]] = []

    def run_line_magic(self, name: str, line: str, *args) -> None:
        self.magics.append((name, line))


def run_setup_cell(on_colab: bool, monkeypatch) -> list[tuple[str, str]]:
    code = TransformerManager().transform_cell(SETUP_CELL)
    if on_colab:
        google = types.ModuleType("google")
        colab = types.ModuleType("google.colab")
        google.colab = colab
        monkeypatch.setitem(sys.modules, "google", google)
        monkeypatch.setitem(sys.modules, "google.colab", colab)
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    shell = FakeShell()
    exec(compile(code, "setup-cell", "exec"), {"get_ipython": lambda: shell})
    return shell.magics


def test_setup_cell_installs_the_package_on_colab_only(monkeypatch) -> None:
    assert run_setup_cell(False, monkeypatch) == []
    [(magic, line)] = run_setup_cell(True, monkeypatch)
    assert magic == "pip"
    words = shlex.split(line)  # as the shell will see it
    assert words[:2] == ["install", "-q"]
    assert words[2:] == [f"labsim[check] @ git+https://github.com/{REPOSITORY}@{RELEASE}"]
    assert "torch" not in line  # Colab keeps its own CUDA torch


def test_the_ref_the_labs_install_from_exists() -> None:
    """The setup cell installs, and the badges open, a ref of this repository: the branch
    until a release, then its tag (``python3 tasks.py release``), which must exist here (a
    release pushed without its tag would install nothing on Colab)."""
    import subprocess

    import labsim

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                      capture_output=True, text=True).stdout.strip() == "true":
        pytest.skip("a shallow clone does not hold every ref")
    if RELEASE.startswith("v"):
        assert RELEASE == f"v{labsim.__version__}"
        ref = f"refs/tags/{RELEASE}"
    else:
        ref = RELEASE
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet",
                            f"{ref}^{{commit}}"], capture_output=True, text=True)
    if found.returncode and not RELEASE.startswith("v"):  # a clone's branch may be remote
        found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet",
                                f"origin/{ref}^{{commit}}"], capture_output=True, text=True)
    assert found.returncode == 0, f"{RELEASE} is not a ref of this repository"


def test_restart_note_says_when_a_loaded_package_changed() -> None:
    import numpy

    assert "no restart" in restart_note({"numpy": numpy.__version__})
    note = restart_note({"numpy": "0.0.1"})
    assert "restart the runtime" in note and f"0.0.1 -> {numpy.__version__}" in note


def test_core_install_leaves_preinstalled_packages_alone() -> None:
    """The core dependencies are what a learner's kernel needs: no notebook-running or
    grading tool (those are the `grade` extra), and ranges Colab's own torch, ipywidgets and
    ipykernel satisfy (nothing pins them above what Colab ships)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=;\[ ]", d, maxsplit=1)[0] for d in project["dependencies"]}
    assert not names & {"nbformat", "nbclient", "nbval", "pytest", "ipykernel", "jupyterlab"}
    spec = {re.split(r"[<>=;\[ ]", d, maxsplit=1)[0]: d for d in project["dependencies"]}
    # floors only: torch's is the oldest release whose APIs the labs import (pyproject.toml)
    assert spec["torch"] == "torch>=2.6" and spec["ipywidgets"] == "ipywidgets>=7.6"
    check = {re.split(r"[<>=;\[ ]", d, maxsplit=1)[0]: d
             for d in project["optional-dependencies"]["check"]}
    assert {"nbformat", "nbclient", "nbval", "pytest"} <= set(check)
    assert not {"ipykernel", "jupyter_client", "jupyterlab"} & set(check)  # Colab's own stay
    assert "labsim[check]" in project["optional-dependencies"]["grade"]
    assert "labsim[check]" in project["optional-dependencies"]["lab"]


def test_the_library_imports_without_the_course_tools(tmp_path: Path) -> None:
    """What a lab imports works where nbformat, nbclient and nbval are not installed, and the
    command line says which extra a course tool needs instead of a traceback."""
    import subprocess

    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('nbformat', 'nbclient', 'nbval'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n")
    env = dict(__import__("os").environ, PYTHONPATH=f"{tmp_path}:{ROOT}")
    code = ("import labsim, labsim.plots, labsim.widgets, labsim.lab, labsim.experiments, "
            "labsim.parallel, labsim.checks, labsim.course.links\n"
            "from labsim.cli import main\n"
            "assert main(['hardware']) == 0\n"
            "assert main(['release', '--check']) == 2\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "labsim[grade]" in run.stderr and "Traceback" not in run.stderr


def test_the_setup_cell_quotes_every_version_specifier() -> None:
    for line in SETUP_CELL.splitlines():
        if "pip" in line and any(op in line for op in ("<", ">", "=")):
            unquoted = re.sub(r'"[^"]*"', "", line)
            assert not re.search(r"[<>]", unquoted), line


def test_readme_has_a_colab_and_a_binder_badge_for_every_lab() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    labs = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "labs").glob("*.ipynb"))
    for lab in labs:
        assert colab_url(lab) in readme, f"README lacks the Colab badge of {lab}"
        assert binder_url(lab) in readme, f"README lacks the Binder badge of {lab}"
    colab = re.findall(rf"colab\.research\.google\.com/github/{REPOSITORY}/blob/{RELEASE}/"
                       r"(\S+?\.ipynb)", readme)
    binder = re.findall(r"labpath=(\S+?\.ipynb)", readme)
    for target in colab + [t.replace("%2F", "/") for t in binder]:
        assert (ROOT / target).exists(), f"a README badge points at {target}, which is missing"


def test_binder_config_asks_for_a_cpu_torch_and_the_course() -> None:
    requirements = (ROOT / "binder" / "requirements.txt").read_text().splitlines()
    assert any(re.fullmatch(r"torch==[\d.]+\+cpu", r.strip()) for r in requirements)
    assert "-e .[lab,grade]" in [r.strip() for r in requirements]
    assert (ROOT / "binder" / "runtime.txt").read_text().strip() == "python-3.11"
