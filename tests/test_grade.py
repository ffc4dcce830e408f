"""``labsim grade`` on a tiny lab released by the real pipeline, with broken, slow, hostile and
tampered submissions graded together in one parallel run (so each case also shows that the
others in the same run are graded normally).

Oracles: a correct submission earns every point, the released stub none; partial credit is
points * passed / cases of the FAIL line; ``--jobs 2`` writes the same CSV as ``--jobs 1``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import gradelab  # noqa: E402

from labsim.cli import main  # noqa: E402
from labsim.course import grade as gr  # noqa: E402
from labsim.course import rebuild as rb  # noqa: E402
from labsim.course import sandbox as sb  # noqa: E402

pytestmark = pytest.mark.slow

S = gradelab.SOLUTIONS
LIMITS = sb.Limits(cell_s=5, notebook_s=60, memory_bytes=2**30)
WRONG_SCALE = "def scale(x, k):\n    return x * abs(k)"  # fails the k < 0 case only
EXTRA = '''# %%
from labsim.checks import Case, equal, run_check

def check_add_big(fn):
    run_check("add_big", fn, [Case(f"big{i}", (10**12 * i, 7), expected=10**12 * i + 7)
                              for i in range(1, 6)], compare=equal)

# %% extra-check add_big points=3
check_add_big(add)
'''
CAPPED_ADD = "def add(a, b):\n    return a + b if abs(a) < 10**9 else 0"


def _edit_cell(role: str, index: int, change):  # noqa: ANN001, ANN202
    def edit(nb: dict) -> None:
        cells = [c for c in nb["cells"] if c["metadata"].get("labsim", {}).get("role") == role]
        change(nb, cells[index])

    return edit


def _delete(nb: dict, cell: dict) -> None:
    nb["cells"].remove(cell)


def _recreate(nb: dict, cell: dict) -> None:
    nb["cells"].remove(cell)
    nb["cells"].append({"cell_type": "code", "id": "my-own-cell", "metadata": {},
                        "execution_count": None, "outputs": [], "source": S["add"]})


def _print_expected(nb: dict, cell: dict) -> None:
    cell["source"] = 'print("PASS add: 5/5 cases passed")'


def _edit_output(nb: dict, cell: dict) -> None:
    cell["outputs"][0]["text"] = "FAIL scale: 5/6 cases passed\n"


def _edit_markdown(nb: dict, cell: dict) -> None:
    cell["source"] = "# My own title"


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("grade")
    lab = gradelab.release_lab(root)
    box = sb.probe()
    subs = root / "subs"
    subs.mkdir()
    victim = root / "solutions" / "90_tiny.ipynb"
    other = subs / "zz_other.ipynb"
    files = {
        "good": gradelab.submission(lab, subs / "good.ipynb", **S),
        "stub": gradelab.submission(lab, subs / "stub.ipynb"),
        "partial": gradelab.submission(lab, subs / "partial.ipynb", add=S["add"],
                                       scale=WRONG_SCALE),
        "capped": gradelab.submission(lab, subs / "capped.ipynb", add=CAPPED_ADD,
                                      scale=S["scale"], mean=S["mean"]),
        "deleted": gradelab.submission(lab, subs / "deleted.ipynb", **S,
                                       edit=_edit_cell("exercise", 1, _delete)),
        "recreated": gradelab.submission(lab, subs / "recreated.ipynb", **S,
                                         edit=_edit_cell("exercise", 0, _recreate)),
        "check_edited": gradelab.submission(lab, subs / "check_edited.ipynb",
                                            edit=_edit_cell("check", 0, _print_expected)),
        "output_edited": gradelab.submission(lab, subs / "output_edited.ipynb",
                                             add=S["add"], scale=WRONG_SCALE, mean=S["mean"],
                                             edit=_edit_cell("check", 1, _edit_output)),
        "narrative": gradelab.submission(lab, subs / "narrative.ipynb", **S,
                                         edit=_edit_cell("markdown", 0, _edit_markdown)),
        "hidden_tb": gradelab.submission(
            lab, subs / "hidden_tb.ipynb", scale=S["scale"], mean=S["mean"],
            add="get_ipython().showtraceback = lambda *a, **k: None\n"
                "def add(a, b):\n    return a - b"),
        "loop": gradelab.submission(lab, subs / "loop.ipynb", add=S["add"], mean=S["mean"],
                                    scale="while True:\n    pass\n" + S["scale"]),
        "deaf_loop": gradelab.submission(
            lab, subs / "deaf_loop.ipynb", add=S["add"], mean=S["mean"],
            scale="import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                  "while True:\n    pass"),
        "os_exit": gradelab.submission(lab, subs / "os_exit.ipynb", add=S["add"],
                                       scale="import os\nos._exit(0)", mean=S["mean"]),
        "sys_exit": gradelab.submission(lab, subs / "sys_exit.ipynb", scale=S["scale"],
                                        mean=S["mean"], add="import sys\nsys.exit()\n" + S["add"]),
        "flood": gradelab.submission(lab, subs / "flood.ipynb", scale=S["scale"], mean=S["mean"],
                                     add='print("x" * 100_000_000)\n' + S["add"]),
        "network": gradelab.submission(
            lab, subs / "network.ipynb", scale=S["scale"], mean=S["mean"],
            add='import socket\nsocket.create_connection(("192.0.2.1", 80), timeout=3)\n'
                + S["add"]),
        "files": gradelab.submission(
            lab, subs / "files.ipynb", scale=S["scale"], mean=S["mean"],
            add=f"import os, pathlib\nblocked = []\n"
                f"os.system('mount -o remount,bind,rw / 2>/dev/null')\n"
                f"for act in (lambda: pathlib.Path({str(victim)!r}).write_text('gone'),\n"
                f"            lambda: os.remove({str(other)!r})):\n"
                f"    try:\n        act()\n    except OSError as exc:\n"
                f"        blocked.append(exc.errno)\n" + S["add"]),
        "segfault": gradelab.submission(lab, subs / "segfault.ipynb", add=S["add"],
                                        scale=S["scale"],
                                        mean="import ctypes\nctypes.string_at(0)"),
        "other": gradelab.submission(lab, other, **S),
    }
    if box.prlimit:  # without a memory limit this case would really take the machine's memory
        files["memory"] = gradelab.submission(
            lab, subs / "memory.ipynb", add=S["add"], scale=S["scale"],
            mean="blocks = [bytearray(10**9) for _ in range(50)]\n" + S["mean"])
    (subs / "bad_json.ipynb").write_text('{"cells": [')
    (subs / "not_nb.ipynb").write_text("[1, 2, 3]")
    (subs / "bad_schema.ipynb").write_text(json.dumps({
        "cells": [{"cell_type": "code"}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    wrong_lab = subs / "wrong_lab.ipynb"
    wrong_lab.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4,
                                     "nbformat_minor": 5}))
    files.update(bad_json=subs / "bad_json.ipynb", not_nb=subs / "not_nb.ipynb",
                 bad_schema=subs / "bad_schema.ipynb", wrong_lab=wrong_lab)
    extra_file = root / "private" / "extra.py"
    extra_file.parent.mkdir()
    extra_file.write_text(EXTRA)
    digests = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in subs.iterdir()}
    victim_digest = hashlib.sha256(victim.read_bytes()).hexdigest()
    out = root / "grades.csv"
    feedback = root / "feedback"
    rc = main([
        "grade", "--lab", str(lab), *map(str, files.values()), "--out", str(out),
        "--feedback", str(feedback), "--jobs", "2", "--timeout-cell", str(LIMITS.cell_s),
        "--timeout-notebook", str(LIMITS.notebook_s), "--memory", str(LIMITS.memory_bytes),
        "--extra-checks", str(extra_file),
    ])
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    by_name = {Path(r["submission"]).stem: r for r in rows}
    key = {Path(p).stem: k for k, p in files.items()}
    return {
        "rc": rc, "root": root, "lab": lab, "box": box, "files": files, "out": out,
        "rows": {key[n]: r for n, r in by_name.items()}, "order": [r["submission"] for r in rows],
        "feedback": feedback, "digests": digests, "victim": victim,
        "victim_digest": victim_digest, "extra": extra_file,
    }


def row(graded: dict, name: str) -> dict:
    return graded["rows"][name]


def scores(graded: dict, name: str) -> tuple[str, ...]:
    r = row(graded, name)
    return (r["add"], r["scale"], r["mean"], r["add_big"])


def feedback(graded: dict, name: str) -> str:
    return (graded["feedback"] / f"{Path(graded['files'][name]).stem}.txt").read_text()


# -- the whole run ---------------------------------------------------------------------------


def test_one_row_per_submission_in_input_order(graded: dict) -> None:
    assert graded["rc"] == 0
    assert graded["order"] == [str(p) for p in graded["files"].values()]
    header = graded["out"].read_text().splitlines()[0]
    assert header == "submission,status,add,scale,mean,add_big,total,max,reason,review"


def test_no_submission_is_modified(graded: dict) -> None:
    for path, digest in graded["digests"].items():
        if path == graded["files"]["other"] and not graded["box"].readonly_fs:
            continue  # without a read-only file system, "files" really deletes it
        assert path.exists(), path
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, path


def test_feedback_file_per_submission(graded: dict) -> None:
    names = sorted(p.name for p in graded["feedback"].iterdir())
    assert names == sorted(f"{Path(p).stem}.txt" for p in graded["files"].values())


# -- scoring ---------------------------------------------------------------------------------


def test_correct_solution_earns_every_point(graded: dict) -> None:
    r = row(graded, "good")
    assert (r["status"], scores(graded, "good"), r["total"], r["max"]) == (
        "ok", ("1", "2", "1", "3"), "7", "7")


def test_released_stub_earns_nothing(graded: dict) -> None:
    assert scores(graded, "stub") == ("0", "0", "0", "0")
    assert row(graded, "stub")["status"] == "ok"
    assert "not implemented yet" in feedback(graded, "stub")


def test_partial_credit_from_the_fail_line(graded: dict) -> None:
    # scale fails the one negative-k case of 6: 2 points * 5/6
    assert scores(graded, "partial")[:2] == ("1", "1.67")
    text = feedback(graded, "partial")
    assert "5/6 cases passed" in text and "first failing case: 2*-3" in text


def test_hidden_check_scores_but_never_shows_its_cases(graded: dict) -> None:
    assert scores(graded, "capped") == ("1", "2", "1", "0")
    text = feedback(graded, "capped")
    assert "hidden check add_big (0/3 points)" in text and "0/5 cases passed" in text
    assert "1000000000007" not in text and "big1" not in text


# -- the twelve hostile and broken cases -----------------------------------------------------


@pytest.mark.parametrize("name", ["bad_json", "not_nb", "bad_schema", "wrong_lab"])
def test_1_unreadable_submission_is_invalid(graded: dict, name: str) -> None:
    r = row(graded, name)
    assert (r["status"], r["total"], r["max"]) == ("invalid", "0", "7")
    assert r["reason"]
    assert "could not be graded" in feedback(graded, name)


def test_2_deleted_exercise_cell(graded: dict) -> None:
    assert row(graded, "deleted")["status"] == "ok"
    assert scores(graded, "deleted") == ("1", "0", "1", "3")
    assert "exercise `scale`: not found" in feedback(graded, "deleted")


def test_2_recreated_exercise_cell_is_found_by_its_function(graded: dict) -> None:
    assert scores(graded, "recreated") == ("1", "2", "1", "3")


def test_3_check_edited_to_print_the_expected_line(graded: dict) -> None:
    r = row(graded, "check_edited")
    assert r["status"] == "tampered" and r["add"] == "0"
    assert "check `add` edited" in r["reason"]


def test_4_stored_expected_output_edited(graded: dict) -> None:
    r = row(graded, "output_edited")
    assert r["status"] == "tampered" and r["scale"] == "1.67"
    assert "stored output of check `scale` edited" in r["reason"]


def test_4_narrative_edited_is_recorded(graded: dict) -> None:
    r = row(graded, "narrative")
    assert r["status"] == "tampered" and r["total"] == "7"
    assert "narrative" in r["reason"]


def test_5_hidden_tracebacks_do_not_turn_a_failure_into_a_pass(graded: dict) -> None:
    r = row(graded, "hidden_tb")
    assert r["status"] == "ok" and scores(graded, "hidden_tb") == ("0", "2", "1", "0")
    assert "showtraceback" in r["review"]


def test_6_infinite_loop_times_out_and_the_rest_is_graded(graded: dict) -> None:
    r = row(graded, "loop")
    assert r["status"] == "timeout"
    assert scores(graded, "loop")[:3] == ("1", "0", "1")
    assert "exercise `scale` ran over the 5 s cell limit" in r["reason"]


def test_7_allocating_50_gb_hits_the_memory_limit(graded: dict) -> None:
    if not graded["box"].prlimit:
        pytest.skip("prlimit is not available here: no memory limit to test")
    r = row(graded, "memory")
    assert r["status"] == "ok" and scores(graded, "memory")[:3] == ("1", "2", "0")
    assert "exercise `mean` raised MemoryError" in r["reason"]


def test_6_a_loop_that_ignores_interrupts_is_stopped(graded: dict) -> None:
    r = row(graded, "deaf_loop")
    assert r["status"] == "timeout"
    assert scores(graded, "deaf_loop") == ("1", "0", "0", "0")
    assert "it ignored the interrupt, so the kernel was stopped" in r["reason"]
    assert "not run: the kernel was stopped" in feedback(graded, "deaf_loop")


def test_8_os_exit_is_a_crash_and_keeps_earlier_points(graded: dict) -> None:
    r = row(graded, "os_exit")
    assert r["status"] == "crashed"
    assert scores(graded, "os_exit") == ("1", "0", "0", "0")
    assert "the kernel died in exercise `scale`" in r["reason"]
    assert "not run: the kernel died" in feedback(graded, "os_exit")


def test_8_sys_exit_is_an_error_in_its_cell(graded: dict) -> None:
    r = row(graded, "sys_exit")
    assert r["status"] == "ok" and scores(graded, "sys_exit")[:3] == ("0", "2", "1")
    assert "exercise `add` raised SystemExit" in r["reason"]


def test_9_printing_100_mb_does_not_break_grading(graded: dict) -> None:
    r = row(graded, "flood")
    assert (r["status"], r["total"]) == ("ok", "7")


def test_10_no_network(graded: dict) -> None:
    r = row(graded, "network")
    assert r["add"] == "0" and r["scale"] == "2"
    if graded["box"].network_isolated:
        assert "Network is unreachable" in r["reason"]
    else:
        assert "exercise `add` raised" in r["reason"]


def test_11_files_outside_the_working_copy_are_untouched(graded: dict) -> None:
    assert row(graded, "files")["total"] == "7"
    assert row(graded, "other")["total"] == "7"  # the submission it tried to delete
    if not graded["box"].readonly_fs:
        pytest.skip("no mount namespace here: the file system is not read-only")
    assert hashlib.sha256(graded["victim"].read_bytes()).hexdigest() == graded["victim_digest"]
    assert graded["files"]["other"].exists()


def test_12_segfault_is_a_crash(graded: dict) -> None:
    r = row(graded, "segfault")
    assert r["status"] == "crashed"
    assert scores(graded, "segfault") == ("1", "2", "0", "0")
    assert "the kernel died in exercise `mean`" in r["reason"]


# -- parallel = serial; whole-notebook limit; bad input --------------------------------------


def test_jobs_1_writes_the_same_rows_as_jobs_2(graded: dict) -> None:
    # the module's run used --jobs 2; grade a mix again one at a time
    picked = [graded["files"][k] for k in ("bad_json", "partial", "check_edited", "os_exit")]
    extra = rb.read_extra_checks(graded["extra"])
    report = gr.grade(graded["lab"], picked, gr.Options(limits=LIMITS, jobs=1, extra=extra),
                      graded["box"])
    serial = gr.csv_text(report).splitlines()
    parallel = graded["out"].read_text().splitlines()
    assert serial[0] == parallel[0]
    assert serial[1:] == [next(ln for ln in parallel if ln.startswith(f"{p},")) for p in picked]


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "process-tree"])
def test_notebook_time_limit_kills_the_run_and_its_kernel(
    graded: dict, tmp_path: Path, namespaces: bool
) -> None:
    box = graded["box"]
    if namespaces and not box.namespaces:
        pytest.skip("no namespaces here")
    box = sb.Sandbox(namespaces, box.prlimit)
    slow = "import time\ntime.sleep(1.5)\n"
    sub = gradelab.submission(graded["lab"], tmp_path / "slow.ipynb",
                              **{k: slow + v for k, v in S.items()})
    work = tmp_path / "work"
    report = gr.grade(graded["lab"], [sub],
                      gr.Options(limits=sb.Limits(cell_s=2, notebook_s=3.5), work_dir=work),
                      box)
    (result,) = report.results
    assert result.status == "timeout"
    assert "the notebook ran over its 3.5 s limit" in result.reasons[0]
    assert result.total < result.maximum
    assert _processes_mentioning(str(work)) == []


def _gone(live: Callable[[], list[str]], patience_s: float = 10.0) -> list[str]:
    """Poll ``live()`` until it is empty or ``patience_s`` passed; return what is left (a
    killed process may need a moment to be reaped)."""
    import time

    deadline = time.monotonic() + patience_s
    left = live()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = live()
    return left


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if text.encode() in (proc / "cmdline").read_bytes():
                found.append(proc.name)
        except OSError:
            continue
    return found


def test_cancel_stops_a_run_and_everything_it_started(graded: dict, tmp_path: Path) -> None:
    import threading

    import nbformat

    loop = gradelab.submission(graded["lab"], tmp_path / "loop.ipynb",
                               add="while True:\n    pass")
    lab = rb.read_lab(graded["lab"])
    rebuilt = rb.rebuild(lab, nbformat.read(loop, as_version=4))
    work = tmp_path / "run"
    work.mkdir()
    cancel = threading.Event()
    threading.Timer(4.0, cancel.set).start()
    record = sb.run_notebook(nbformat.writes(rebuilt.notebook), work, sb.Limits(60, 120),
                             graded["box"], sb.PortPool().take(), cancel=cancel)
    assert record.cancelled and not record.notebook_timed_out  # the cancel stopped it
    assert _gone(lambda: _processes_mentioning(str(work))) == []


def test_bad_arguments_exit_2(graded: dict, tmp_path: Path) -> None:
    out = str(tmp_path / "g.csv")
    lab = str(graded["lab"])
    assert main(["grade", "--lab", lab, "--out", out]) == 2  # no submissions
    assert main(["grade", "--lab", str(tmp_path / "nope.ipynb"), lab, "--out", out]) == 2
    bad = tmp_path / "extra.py"
    bad.write_text("# %% check me\nprint(1)\n")
    assert main(["grade", "--lab", lab, lab, "--out", out, "--extra-checks", str(bad)]) == 2
    assert main(["grade", "--lab", lab, lab, "--out", out, "--memory", "lots"]) == 2
    assert main(["grade", "--lab", lab, lab, "--out", out, "--timeout-cell", "0"]) == 2
    assert not os.path.exists(out)


def test_help_describes_every_option(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["grade", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--lab", "--out", "--feedback", "--jobs", "--timeout-cell",
                   "--timeout-notebook", "--memory", "--extra-checks", "# %% extra-check"):
        assert option in text


def test_a_notebook_that_is_not_a_released_lab_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.ipynb"
    plain.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4,
                                 "nbformat_minor": 5}))
    with pytest.raises(ValueError, match="no check cells"):
        rb.read_lab(plain)


# -- scoring rules on recorded cells (no kernel) ---------------------------------------------

CHECK = rb.Check("scale", 2.0, "PASS scale: 6/6 cases passed", 6)


def _failed(evalue: str, ename: str = "CheckFailed") -> sb.CellRecord:
    return sb.CellRecord.from_json(
        {"cell": 0, "phase": "call", "outcome": "failed", "error_kind": "NbCellError",
         "message": "Cell execution caused an exception", "kernel_alive": True,
         "outputs": [{"type": "error", "ename": ename, "evalue": evalue}]})


@pytest.mark.parametrize(
    ("evalue", "ename", "score"),
    [
        ("FAIL scale: 3/6 cases passed\nfirst failing case: x", "CheckFailed", 1.0),
        ("FAIL scale: 6/6 cases passed", "CheckFailed", 2.0 * 6 / 6),
        ("FAIL scale: 3/4 cases passed", "CheckFailed", 0.0),  # not the release's case count
        ("FAIL other: 3/6 cases passed", "CheckFailed", 0.0),  # not this check's name
        ("FAIL scale: 7/6 cases passed", "CheckFailed", 0.0),
        ("FAIL scale: 3/6 cases passed", "ValueError", 0.0),  # not raised by a check
    ],
)
def test_partial_credit_only_from_this_checks_fail_line(evalue: str, ename: str,
                                                         score: float) -> None:
    assert gr.score_check(CHECK, _failed(evalue, ename), "").score == pytest.approx(score)


def test_hidden_check_passes_only_on_a_complete_pass_line() -> None:
    hidden = rb.Check("h", 1.0, hidden=True)

    def ran(text: str) -> sb.CellRecord:
        return sb.CellRecord.from_json(
            {"cell": 0, "outcome": "passed", "message": "", "kernel_alive": True,
             "outputs": [{"type": "stream", "name": "stdout", "text": text}]})

    assert gr.score_check(hidden, ran("PASS h: 5/5 cases passed\n"), "").passed
    assert not gr.score_check(hidden, ran(""), "").passed
    assert not gr.score_check(hidden, ran("PASS h: 4/5 cases passed\n"), "").passed
    detail = gr.score_check(hidden, _failed("FAIL h: 2/5 cases passed\ncase big: 7 instead "
                                            "of 8"), "").detail
    assert detail.startswith("2/5 cases passed") and "instead" not in detail


def test_a_kernel_that_cannot_start_is_a_crash_with_the_reason() -> None:
    cells = (rb.Cell("code", "code cell 0"), rb.Cell("check", "check `scale`", 0))
    rebuilt = rb.Rebuilt(None, cells, (CHECK,), (), (), ())
    records = tuple(
        sb.CellRecord(i, phase="setup", outcome="failed", error_kind="RuntimeError",
                      message="Kernel died before replying to kernel_info", kernel_alive=False)
        for i in range(2))
    run = sb.RunRecord(records, 1, False, 1.0, "")
    status, scores, reasons = gr.score_run(rebuilt, run, LIMITS)
    assert status == "crashed" and scores[0].score == 0
    assert reasons == ["the kernel could not start: Kernel died before replying to kernel_info"]


def test_kernel_guard_cuts_what_one_cell_prints() -> None:
    from labsim.course import _kernel_guard

    class Stream:
        def __init__(self) -> None:
            self.text = ""

        def write(self, text: str) -> int:
            self.text += text
            return len(text)

    stream, counts = Stream(), {}
    _kernel_guard._cap(stream, 20, counts)
    stream.write("PASS ok\n")
    assert stream.text == "PASS ok\n"
    stream.write("x" * 100)
    stream.write("later")
    assert stream.text.startswith("PASS ok\nxx") and stream.text.count("x") == 12
    assert "output cut by the grader" in stream.text and "later" not in stream.text
    counts.clear()  # the next cell
    stream.write("PASS again\n")
    assert stream.text.endswith("PASS again\n")


def test_port_pool_never_hands_out_a_port_twice() -> None:
    pool = sb.PortPool()
    ports = [p for _ in range(40) for p in pool.take()]
    assert len(ports) == 200 and len(set(ports)) == 200


def test_extra_checks_file_format(tmp_path: Path) -> None:
    path = tmp_path / "extra.py"
    path.write_text("# %%\nimport math\n\n# %% extra-check a points=2.5\ncheck(f)\n"
                    "# %% extra-check b\ncheck(g)\n")
    extra = rb.read_extra_checks(path)
    assert [(c.name, c.points, c.hidden) for c in extra.checks] == [
        ("a", 2.5, True), ("b", 1.0, True)]
    assert [src for src, _ in extra.cells] == ["import math", "check(f)", "check(g)"]
    path.write_text("# %% extra-check a\nx\n# %% extra-check a\ny\n")
    with pytest.raises(ValueError, match="unique"):
        rb.read_extra_checks(path)
