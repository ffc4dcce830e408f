"""The graded copy of labsim (``labsim.course.withhold``): the references a lab forbids keep
their names, signatures and docstrings but lose their code and its text; nothing else
changes, line numbers included, and every module still imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from labsim.course import withhold
from labsim.course.grade import Expectations
from labsim.course.rebuild import read_lab

from .conftest import ROOT

SOURCE = '''"""A module."""

from dataclasses import dataclass


def answer(m, n, k):
    """2 m n k."""
    return 2 * m * n * k


def one_line(x): return x + 1


def _helper():
    return 3


@dataclass(frozen=True)
class Chip:
    """A chip."""

    peak: float

    def __post_init__(self):
        if self.peak <= 0:
            raise ValueError("peak")

    @property
    def half(self):
        return self.peak / 2

    def time(self, flops):
        def inner():
            return flops / self.peak
        return inner()


PRESET = Chip(2.0)
'''


def test_a_function_keeps_its_signature_and_docstring_not_its_body() -> None:
    text, done = withhold.stub_source(SOURCE, "pkg.mod", ["answer", "one_line"])
    assert done == ["pkg.mod.answer", "pkg.mod.one_line"]
    assert len(text.splitlines()) == len(SOURCE.splitlines())  # line numbers kept
    tree = ast.parse(text)
    answer = next(n for n in tree.body if getattr(n, "name", "") == "answer")
    assert ast.get_docstring(answer) == "2 m n k."
    assert "2 * m * n * k" not in text and "return x + 1" not in text
    assert "raise _w('pkg.mod.answer')" in text and "_helper" in text  # the rest unchanged


def test_a_class_loses_its_methods_but_still_holds_data() -> None:
    text, done = withhold.stub_source(SOURCE, "pkg.mod", ["Chip"])
    assert done == ["pkg.mod.Chip.half", "pkg.mod.Chip.time"]  # validation is kept
    assert "self.peak / 2" not in text and "flops / self.peak" not in text
    assert 'raise ValueError("peak")' in text and "PRESET = Chip(2.0)" in text


def test_star_withholds_every_public_function_and_class() -> None:
    text, done = withhold.stub_source(SOURCE, "pkg.mod", ["*"])
    assert set(done) == {"pkg.mod.answer", "pkg.mod.one_line", "pkg.mod.Chip.half",
                         "pkg.mod.Chip.time"}
    assert "return 3" in text  # _helper is private


def test_a_target_that_does_not_exist_is_an_error() -> None:
    with pytest.raises(ValueError, match="no definition of nope"):
        withhold.stub_source(SOURCE, "pkg.mod", ["nope"])


@pytest.mark.slow
def test_the_graded_copy_of_a_lab_imports_and_withholds_its_references(tmp_path: Path) -> None:
    lab = read_lab(ROOT / "labs" / "00_why_gpus.ipynb")
    exp = Expectations.build(lab.checks)
    copy = withhold.build(exp.withheld(), tmp_path)
    assert "labsim.roofline.matmul_flops" in copy.withheld
    assert (tmp_path / "sitecustomize.py").is_file()
    code = ("import labsim.roofline as r, labsim\n"
            "from labsim.withheld import ReferenceWithheld\n"
            f"assert labsim.__file__.startswith({str(tmp_path)!r})\n"
            "try:\n    r.matmul_flops(1, 2, 3)\nexcept ReferenceWithheld as e:\n"
            "    print('withheld', e.reference)\n"
            "import labsim.lab.device as d\nprint(d.pick_device())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "withheld labsim.roofline.matmul_flops" in proc.stdout
    # what is not forbidden is byte for byte the installed package
    assert (tmp_path / "labsim" / "units.py").read_bytes() == (
        ROOT / "labsim" / "units.py").read_bytes()


def test_a_tool_a_check_hands_the_learner_is_not_withheld() -> None:
    lab = read_lab(ROOT / "labs" / "08_data_parallel.ipynb")
    withheld = Expectations.build(lab.checks).withheld()
    assert "labsim.parallel.data_parallel:DataParallelNaive" in withheld
    assert "labsim.parallel.data_parallel:DataParallelBucket" not in withheld  # accumulation's
