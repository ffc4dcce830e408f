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

from labsim.course.links import REPOSITORY, SETUP_CELL, binder_url, colab_url

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
    assert words[2:] == [f"labsim @ git+https://github.com/{REPOSITORY}"]
    assert "torch" not in line  # Colab keeps its own CUDA torch


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
    colab = re.findall(rf"colab\.research\.google\.com/github/{REPOSITORY}/blob/main/(\S+?\.ipynb)",
                       readme)
    binder = re.findall(r"labpath=(\S+?\.ipynb)", readme)
    for target in colab + [t.replace("%2F", "/") for t in binder]:
        assert (ROOT / target).exists(), f"a README badge points at {target}, which is missing"


def test_binder_config_asks_for_a_cpu_torch_and_the_course() -> None:
    requirements = (ROOT / "binder" / "requirements.txt").read_text().splitlines()
    assert any(re.fullmatch(r"torch==[\d.]+\+cpu", r.strip()) for r in requirements)
    assert "-e .[lab]" in [r.strip() for r in requirements]
    assert (ROOT / "binder" / "runtime.txt").read_text().strip() == "python-3.11"
