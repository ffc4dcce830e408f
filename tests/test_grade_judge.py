"""What comes back from a graded run is decoded and judged outside the grader's own process,
under an element, memory and time budget (``labsim.course.judge``); the class's grades go
out as a summary, a chart and gradebook imports (``labsim.course.feedback``)."""

from __future__ import annotations

import csv
import io
import json
import resource
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import gradelab  # noqa: E402

from labsim.checks import _plain  # noqa: E402
from labsim.checks._core import Outcome  # noqa: E402
from labsim.course import feedback as fb  # noqa: E402
from labsim.course import grade as gr  # noqa: E402
from labsim.course.judge import Judge  # noqa: E402
from labsim.course.rebuild import Check  # noqa: E402


def test_plain_data_refuses_millions_of_containers_before_building_them() -> None:
    text = b"[" + b"[]," * 2_000_000 + b"[]]"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(_plain.PlainDataError, match="lists and mappings"):
        _plain.decode(text)
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grew_mib < 100  # the 2 M lists were never built (~200 MB)
    assert _plain.decode(*_plain.encode([[1, 2], {"a": (3,)}])) == [[1, 2], {"a": (3,)}]


def _write(out: Path, stem: str, outcomes: list[Outcome]) -> None:
    text, blob = _plain.encode({"index": 0, "outcomes": [o.to_plain() for o in outcomes]})
    (out / f"{stem}.json").write_text(text)
    (out / f"{stem}.bin").write_bytes(blob)


@pytest.mark.slow
def test_the_judge_answers_verdicts_and_survives_hostile_results(tmp_path: Path) -> None:
    lab = gradelab.release_lab(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    judge = Judge(lab, request_s=30)
    try:
        _write(out, "check-0", [Outcome(v) for v in (0, 3, 0, 3.0, 10**6 + 1)])
        assert judge.verdict(0, out, "check-0") == {
            "passed": 5, "total": 5, "first": None, "not_done": False, "broken": [],
            "message": "PASS add: 5/5 cases passed"}
        _write(out, "check-1", [Outcome(1)] * 6)
        answer = judge.verdict(1, out, "check-1")
        assert answer["passed"] == 1 and answer["first"][0] == "0*5"
        # 2 M lists: refused by the decoder's count, the judge answers with a reason
        (out / "check-2.json").write_text("[" + "[]," * 2_000_000 + "[]]")
        (out / "check-2.bin").write_bytes(b"")
        assert "lists and mappings" in judge.verdict(2, out, "check-2")["unreadable"]
        # a link is never followed
        (out / "check-0.json").unlink()
        (out / "check-0.json").symlink_to("/etc/passwd")
        assert judge.verdict(0, out, "check-0") == {"unreadable": "missing"}
        assert judge.restarts == 0
    finally:
        judge.close()


def _report() -> gr.Report:
    checks = (Check("add", 1.0), Check("scale", 2.0))

    def result(name: str, learner: str, scores: tuple, status: str = "ok") -> gr.Result:
        return gr.Result(name, status, tuple(
            gr.CheckScore(c, s, s == c.points, "passed" if s == c.points else "1/5 cases",
                          state=st) for c, (s, st) in zip(checks, scores)), (),
            learner=learner)

    return gr.Report("02_mixed_precision", checks, (
        result("subs/alice/02_mixed_precision.ipynb", "alice", ((1.0, "pass"), (2.0, "pass"))),
        result("subs/bob/02_mixed_precision.ipynb", "bob", ((1.0, "pass"),
                                                              (0.0, "not attempted"))),
        result("subs/=cmd/02.ipynb", "=cmd", ((0.0, "fail"), (0.0, "not attempted")),
               "timeout"),
    ), (), 1.0)


def test_learner_ids_from_metadata_file_name_or_folder() -> None:
    paths = ["subs/alice/02_mixed_precision.ipynb", "subs/bob_02_mixed_precision.ipynb",
             "subs/02_mixed_precision-carol.ipynb", "subs/dave.ipynb", "subs/erin/x.ipynb"]
    assert fb.learner_ids(paths, "02_mixed_precision", ["", "", "", "", "E. Smith"]) == [
        "alice", "bob", "carol", "dave", "E. Smith"]


def test_gradebook_imports_for_canvas_moodle_and_gradescope() -> None:
    report = _report()
    canvas = list(csv.reader(io.StringIO(fb.lms_text(report, "canvas"))))
    assert canvas[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section",
                         "02_mixed_precision"]
    assert canvas[1] == ["Points Possible", "", "", "", "", "3"]
    assert canvas[2] == ["alice", "", "", "alice", "", "3"] and canvas[3][-1] == "1"
    assert canvas[4][0] == "'=cmd"  # no spreadsheet formula
    moodle = list(csv.reader(io.StringIO(fb.lms_text(report, "moodle"))))
    assert moodle[0] == ["username", "02_mixed_precision", "feedback"]
    assert moodle[2] == ["bob", "1", "ok; 1/2 checks pass"]
    gradescope = list(csv.reader(io.StringIO(fb.lms_text(report, "gradescope"))))
    assert gradescope[0] == ["Name", "SID", "Email", "Total Score"]
    assert gradescope[1] == ["alice", "alice", "", "3"]
    with pytest.raises(ValueError, match="use one of canvas, moodle, gradescope"):
        fb.lms_text(report, "blackboard")


def test_the_class_summary_says_which_checks_held_learners_back() -> None:
    text = fb.summary_text(_report())
    assert "3 submission(s)" in text and "status: ok 2, timeout 1" in text
    assert "full marks 1 of 3" in text
    lines = text.splitlines()
    scale = next(line for line in lines if line.startswith("scale"))
    assert scale.split()[1:3] == ["1", "33%"] and scale.split()[-1] == "2"  # 2 not attempted
    assert lines.index(scale) < lines.index(next(x for x in lines if x.startswith("add ")))


def test_full_marks_are_congratulated_and_the_rest_told_what_is_next() -> None:
    report = _report()
    alice, bob = report.results[:2]
    assert "Full marks: every check passed. Well done." in fb.feedback_text("lab", alice)
    text = fb.feedback_text("lab", bob)
    assert "TODO  check scale (0/2 points): not attempted" in text
    assert "Next: scale." in text and "Well done" not in text


def test_the_summary_chart_is_a_png(tmp_path: Path) -> None:
    from labsim.cli.grade import write_summary

    write_summary(_report(), tmp_path)
    assert (tmp_path / "scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "full marks" in (tmp_path / "summary.txt").read_text()


def test_the_csv_has_the_learner_and_the_checks_not_attempted() -> None:
    rows = list(csv.DictReader(io.StringIO(fb.csv_text(_report()))))
    assert [r["learner"] for r in rows] == ["alice", "bob", "'=cmd"]
    assert rows[1]["not_attempted"] == "scale"
    assert json.loads(json.dumps(rows))  # plain text throughout
