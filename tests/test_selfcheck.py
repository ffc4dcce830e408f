"""``labsim check`` and the notebook's Check button grade a learner's own notebook as the
grader will: the same verdict on every check, one line per check in the notebook's words,
saved outputs ignored, and the notebook found however the learner names it."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import gradelab  # noqa: E402

from labsim.cli import main  # noqa: E402
from labsim.course import selfcheck  # noqa: E402

from .conftest import ROOT  # noqa: E402

S = gradelab.SOLUTIONS
THREADED_ADD = ("import threading\ndef add(a, b):\n    out = []\n"
                "    t = threading.Thread(target=lambda: out.append(a + b))\n"
                "    t.start()\n    t.join()\n    return out[0]\n")


def _below(nb: dict) -> None:
    """The add stub left alone; the answer in a new cell right below it."""
    cells = nb["cells"]
    at = next(i for i, c in enumerate(cells)
              if c["metadata"].get("labsim", {}).get("role") == "exercise") + 1
    cells.insert(at, {"cell_type": "code", "id": "mine", "metadata": {}, "outputs": [],
                      "execution_count": None, "source": S["add"]})


def _stale(nb: dict) -> None:
    for c in nb["cells"]:
        if c["metadata"].get("labsim", {}).get("role") == "check":
            c["outputs"] = [{"output_type": "stream", "name": "stdout",
                             "text": "FAIL add: 0/5 cases passed\n"}]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("selfcheck")
    lab = gradelab.release_lab(root)
    subs = {
        "good": gradelab.submission(lab, root / "s" / "good.ipynb", **S),
        "stub": gradelab.submission(lab, root / "s" / "stub.ipynb"),
        "partial": gradelab.submission(lab, root / "s" / "partial.ipynb", add=S["add"],
                                       scale="def scale(x, k):\n    return x * abs(k)"),
        "threaded": gradelab.submission(lab, root / "s" / "threaded.ipynb", add=THREADED_ADD,
                                        scale=S["scale"], mean=S["mean"]),
        "below": gradelab.submission(lab, root / "s" / "below.ipynb", scale=S["scale"],
                                     mean=S["mean"], edit=_below),
        "stale": gradelab.submission(lab, root / "s" / "stale.ipynb", **S, edit=_stale),
    }
    out = root / "grades.csv"
    assert main(["grade", "--lab", str(lab), *map(str, subs.values()), "--out", str(out),
                 "--jobs", "2", "--timeout-cell", "60"]) == 0
    graded = {Path(r["submission"]).stem: r for r in csv.DictReader(io.StringIO(
        out.read_text()))}
    checked = {}
    for name, path in subs.items():
        result = selfcheck.run(path, release=lab, timeout_cell=60)
        checked[name] = result
    return {"lab": lab, "subs": subs, "graded": graded, "checked": checked}


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["good", "stub", "partial", "threaded", "below", "stale"])
def test_the_self_check_agrees_with_the_grader_on_every_check(corpus: dict, name: str) -> None:
    row = corpus["graded"][name]
    result = corpus["checked"][name]
    for score in result.result.scores:
        points = float(row[score.check.name])
        assert score.passed == (points == score.check.points), (name, score.check.name, row)
    assert result.ok == (row["total"] == row["max"])


def test_one_line_per_check_and_what_to_do_next(corpus: dict) -> None:
    good = corpus["checked"]["good"].lines()
    assert good[:3] == ["PASS  add", "PASS  scale", "PASS  mean"]
    assert good[3] == "3 of 3 checks pass: the notebook is complete"
    stub = corpus["checked"]["stub"].lines()
    assert stub[:3] == ["TODO  add: not started", "TODO  scale: not started",
                        "TODO  mean: not started"]
    assert stub[3] == "0 of 3 checks pass; next: add"
    partial = corpus["checked"]["partial"].lines()
    assert partial[1].startswith("FAIL  scale: case \"2*-3\": ") and "-6" in partial[1]
    assert "1 of 3 checks pass; next: scale" in partial  # mean is not started
    threaded = corpus["checked"]["threaded"].lines()
    assert threaded[0].startswith("FAIL  add: ") and "started threads" in threaded[0]


def test_saved_outputs_never_count(corpus: dict) -> None:
    assert corpus["checked"]["stale"].ok  # FAIL lines saved in every check cell


def test_the_command_exits_0_only_when_every_check_passes(corpus: dict, capsys) -> None:
    lab, subs = corpus["lab"], corpus["subs"]
    assert main(["check", "--lab", str(lab), str(subs["good"]), "--timeout-cell", "60"]) == 0
    assert "3 of 3 checks pass" in capsys.readouterr().out
    assert main(["check", "--lab", str(lab), str(subs["partial"]), "--timeout-cell", "60"]) == 1


def test_a_notebook_is_found_by_path_name_or_number(tmp_path: Path, monkeypatch) -> None:
    labs = tmp_path / "course" / "labs"
    labs.mkdir(parents=True)
    (labs / "00_why_gpus.ipynb").write_text("{}")
    deep = tmp_path / "course" / "notes"
    deep.mkdir()
    for cwd, name in [(labs, "00_why_gpus.ipynb"), (labs, "00"), (tmp_path / "course", "00"),
                      (tmp_path / "course", "labs/00_why_gpus.ipynb"), (deep, "00_why_gpus")]:
        monkeypatch.chdir(cwd)
        assert selfcheck.find_notebook(name).resolve() == labs / "00_why_gpus.ipynb"
    with pytest.raises(ValueError, match="no such notebook"):
        selfcheck.find_notebook("99")


def test_a_renamed_copy_is_matched_to_its_lab_by_its_exercises(tmp_path: Path) -> None:
    released = selfcheck.package_labs() / "00_why_gpus.ipynb"
    copy = tmp_path / "Copy of my work.ipynb"
    copy.write_text(released.read_text())
    assert selfcheck.find_release(copy) == released
    other = tmp_path / "other.ipynb"
    other.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4,
                                 "nbformat_minor": 5}))
    with pytest.raises(ValueError, match="not a copy of one of the course's labs"):
        selfcheck.find_release(other)


def test_the_package_keeps_every_released_lab() -> None:
    """``labsim check`` grades against the package's copy, the same bytes as labs/."""
    for lab in sorted((ROOT / "labs").glob("*.ipynb")):
        assert (selfcheck.package_labs() / lab.name).read_bytes() == lab.read_bytes()
