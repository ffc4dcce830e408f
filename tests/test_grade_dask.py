"""``labsim grade --dask``: a class graded on a Dask cluster (here two local worker
processes) gets the same CSV and feedback as on one machine, each submission still run in a
sandbox of its own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import gradelab  # noqa: E402

from labsim.cli import main  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
S = gradelab.SOLUTIONS


def test_a_dask_cluster_grades_as_one_machine_does(tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    lab = gradelab.release_lab(tmp_path)
    subs = tmp_path / "subs"
    files = [
        gradelab.submission(lab, subs / "alice" / "90_tiny.ipynb", **S),
        gradelab.submission(lab, subs / "bob" / "90_tiny.ipynb"),
        gradelab.submission(lab, subs / "carol" / "90_tiny.ipynb", add=S["add"],
                            scale="def scale(x, k):\n    return x * abs(k)"),
        gradelab.submission(lab, subs / "dan" / "90_tiny.ipynb", scale=S["scale"],
                            mean=S["mean"], add="import threading\ndef add(a, b):\n"
                            "    out = []\n    t = threading.Thread(target=lambda: "
                            "out.append(a + b))\n    t.start(); t.join()\n    return out[0]\n"),
    ]
    (subs / "erin").mkdir()
    (subs / "erin" / "90_tiny.ipynb").write_text('{"cells": [')
    files.append(subs / "erin" / "90_tiny.ipynb")
    args = ["grade", "--lab", str(lab), *map(str, files), "--timeout-cell", "60"]
    here, there = tmp_path / "here.csv", tmp_path / "there.csv"
    assert main([*args, "--out", str(here), "--jobs", "2",
                 "--feedback", str(tmp_path / "fb-here")]) == 0
    assert main([*args, "--out", str(there), "--dask", "local:2",
                 "--feedback", str(tmp_path / "fb-there")]) == 0
    assert there.read_text() == here.read_text()
    rows = here.read_text().splitlines()
    assert [r.split(",")[1:3] for r in rows[1:]] == [
        ["alice", "ok"], ["bob", "ok"], ["carol", "ok"], ["dan", "ok"], ["erin", "invalid"]]
    for name in ("alice__90_tiny.txt", "dan__90_tiny.txt", "erin__90_tiny.txt"):
        assert (tmp_path / "fb-there" / name).read_text() == (
            tmp_path / "fb-here" / name).read_text()
