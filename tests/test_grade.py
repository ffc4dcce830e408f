"""``labsim grade`` on a tiny lab released by the real pipeline, with correct, broken, slow,
hostile and tampered submissions graded together in one parallel run (so each case also shows
that the others in the same run -- the correct one included -- are graded normally).

Oracles: a correct submission earns every point, the released stub none; partial credit is
points * passed / cases of the grader's own comparisons; ``--jobs 2`` writes the same CSV as
``--jobs 1``.  Every attempt to forge a verdict, read what the grader keeps, harm another run
or stall the class scores nothing it did not earn and is reported (status, reason or review).
Probes of the sandbox run *inside* a submission: its ``add`` is right only if every probe was
blocked, and names the first that was not.
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
from labsim.course.records import CellRecord, read_outcomes, sanitize  # noqa: E402

pytestmark = pytest.mark.slow

S = gradelab.SOLUTIONS
LIMITS = sb.Limits(cell_s=8, notebook_s=60, memory_bytes=2 * 2**30)
WRONG_SCALE = "def scale(x, k):\n    return x * abs(k)"  # fails the k < 0 case only
WRONG_ADD = "def add(a, b):\n    return a + b + 7\n"  # fails every case
SECRET = "hunter2-grader-secret"
EXTRA = '''from labsim.checks import Case, Hidden, equal

CHECKS = [Hidden("add_big", "add", [Case(f"big{i}", (10**12 * i, 7), expected=10**12 * i + 7)
                                    for i in range(1, 6)], points=3, compare=equal)]
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


def _show_pass(nb: dict, cell: dict) -> None:
    cell["outputs"] = [{"output_type": "stream", "name": "stdout",
                        "text": "PASS add: 5/5 cases passed\n"}]


def _edit_markdown(nb: dict, cell: dict) -> None:
    cell["source"] = "# My own title"


def _probes(victims: dict[str, str]) -> str:
    """An ``add`` that is right only when every escape is blocked (else it names the probe)."""
    return f'''import ctypes, os, socket, subprocess
VICTIMS = {victims!r}

def _blocked(name, act):
    try:
        act()
    except Exception:
        return None
    return name

def _write(path, data=b"x"):
    with open(path, "wb") as fh:
        fh.write(data)

def _big():
    try:
        with open("/run/labsim/work/big", "wb") as fh:
            for _ in range(300):
                fh.write(b"\\0" * 2**20)
    finally:
        if os.path.exists("/run/labsim/work/big"):
            os.remove("/run/labsim/work/big")

def _must(cond):
    if not cond:
        raise RuntimeError
    return None

PROBES = [
    ("read the solution", lambda: open(VICTIMS["solution"]).read()),
    ("read another submission", lambda: open(VICTIMS["other"]).read()),
    ("read the private extra checks", lambda: open(VICTIMS["extra"]).read()),
    ("write the release", lambda: _write(VICTIMS["lab"])),
    ("write /usr", lambda: _write("/usr/labsim-probe")),
    ("list /sys", lambda: os.listdir("/sys")),
    ("open a loop device", lambda: open("/dev/loop0", "rb")),
    ("reach the network", lambda: socket.create_connection(("192.0.2.1", 80), timeout=2)),
    ("ptrace nbval", lambda: open(f"/proc/{{os.getppid()}}/mem", "rb").read(1)),
    ("open nbval's descriptors", lambda: os.listdir(f"/proc/{{os.getppid()}}/fd")),
    ("see processes outside the run", lambda: _must(len([p for p in os.listdir("/proc")
                                                          if p.isdigit()]) > 20)),
    ("a file over the size limit", _big),
    ("a new user namespace", lambda: _must(ctypes.CDLL(None).unshare(0x10000000) == 0)),
    ("mount a file system", lambda: subprocess.run(["mount", "-t", "tmpfs", "t", "/tmp"],
                                                   check=True, capture_output=True)),
    ("run as root", lambda: _must(os.getuid() == 0)),
    ("see the grader's environment", lambda: _must(any({SECRET!r} in v
                                                       for v in os.environ.values()))),
]
FAILED = [n for n in (_blocked(name, act) for name, act in PROBES) if n]

def add(a, b):
    if FAILED:
        raise ValueError("not blocked: " + ", ".join(FAILED))
    return a + b
'''


def _leak(victims: dict[str, str]) -> str:
    """An ``add`` that raises with everything of the grader it can read in its message."""
    return f'''import os, glob
def add(a, b):
    stolen = repr(dict(os.environ))
    paths = [*{sorted(victims.values())!r}, "/proc/1/environ", "/etc/shadow",
             *glob.glob("/run/labsim/**", recursive=True)]
    for path in paths:
        try:
            stolen += open(path, errors="replace").read()
        except OSError:
            pass
    raise ValueError("LEAK " + stolen)
'''


FORGE = {
    # a process forked from an exercise cell writes "passed" records wherever it can
    "forge_fork": WRONG_ADD + '''import os, glob, json
rec = json.dumps({"cell": 2, "phase": "call", "outcome": "passed", "kernel_alive": True,
                  "outputs": [{"type": "stream", "name": "stdout",
                               "text": "PASS add: 5/5 cases passed"}]}) + "\\n"
if os.fork() == 0:
    for path in glob.glob("/run/labsim/**", recursive=True) + glob.glob("/proc/*/fd/*"):
        try:
            with open(path, "a") as fh:
                fh.write(rec)
        except OSError:
            pass
    os._exit(0)
os.wait()
''',
    # the expected value read from the check's frames
    "forge_frame": '''import sys
def add(a, b):
    f = sys._getframe(1)
    while f is not None:
        for v in f.f_locals.values():
            if hasattr(v, "expected") and getattr(v, "args", None) == (a, b):
                return v.expected
        f = f.f_back
    return None
''',
    # an exception merely named like the check's carrying a full FAIL line
    "forge_exception": '''class CheckFailed(AssertionError):
    pass

def add(a, b):
    raise CheckFailed("FAIL add: 5/5 cases passed")
''',
    # the check machinery replaced with names built from strings
    "forge_code": WRONG_ADD + '''import importlib
core = importlib.import_module("labsim." + "checks." + "_core")
core.judge = lambda spec, cases, outcomes: core.Verdict(spec.title, len(cases), len(cases))
core.Spec.__call__ = lambda self, *fns: print(f"PASS {self.title}: 5/5 cases passed")
''',
    # IPython prints a PASS line for any error; the PASS lines printed outright
    "forge_custom_exc": WRONG_ADD + '''get_ipython().set_custom_exc(
    (BaseException,), lambda *a, **k: print("PASS add: 5/5 cases passed"))
print("PASS add: 5/5 cases passed")
''',
}


# Work done where the check does not look: another thread, a child process, a copy of the
# code, text run as code, the results file written by hand.  Each must score 0 on ``add``.
AROUND = {
    # a pool started when the cell is defined, doing the work for the function
    "pool": """from concurrent.futures import ThreadPoolExecutor
_pool = ThreadPoolExecutor(1)
def add(a, b):
    return _pool.submit(lambda: a + b).result()
""",
    # a thread started and joined inside the function
    "thread": """import threading
def add(a, b):
    out = []
    t = threading.Thread(target=lambda: out.append(a + b))
    t.start()
    t.join()
    return out[0]
""",
    # a thread started below threading
    "raw_thread": """import _thread, time
def add(a, b):
    out = []
    _thread.start_new_thread(lambda: out.append(a + b), ())
    while not out:
        time.sleep(0.001)
    return out[0]
""",
    # a child process computes it
    "child": """import multiprocessing as mp
def add(a, b):
    with mp.get_context("fork").Pool(1) as pool:
        return pool.apply(int.__add__, (a, b)) if isinstance(a, int) else a + b
""",
    # a copy of a function's code under another name
    "code_copy": """def _honest(a, b):
    return a + b
add = type(_honest)(_honest.__code__.replace(co_name="add"), globals())
""",
    # the answer run from text
    "text": """exec("def add(a, b):\\n    return a + b")
""",
    # results written by hand, then the collector stopped before writing its own
    "prewrite": """import json, os
def add(a, b):
    out = {"value": a + b, "error": "", "error_types": [], "message": "", "observed": {}}
    os.makedirs("/run/labsim/out", exist_ok=True)
    with open("/run/labsim/out/check-0.json", "w") as fh:
        json.dump({"$map": [["index", 0], ["outcomes", [{"$map": [[k, v] for k, v in
                   out.items()]}] * 5]]}, fh)
    raise SystemExit
""",
    # every input the run holds, read at definition time and shown in an error
    "early_inputs": """import glob
_seen = []
for _p in glob.glob("/run/labsim/**", recursive=True) + glob.glob("/run/labsim/*/*"):
    try:
        _seen.append(_p + ":" + open(_p, errors="replace").read())
    except OSError:
        pass
raise ValueError("INPUTS " + " ".join(_seen))
""",
}
# What an honest learner does besides typing into the exercise cell: each earns full marks.
HONEST = {
    # the stub left as it is, the answer in a new cell right below it
    "answer_below": lambda nb: _insert_after(nb, "exercise", 0, S["add"]),
    # a helper of one's own in a cell of its own, before the exercise that uses it
    "helper_cell": lambda nb: (_insert_after(nb, "exercise", 0,
                                             "def _plus(a, b):\n    return a + b"),
                               _set_exercise(nb, 0, "def add(a, b):\n    return _plus(a, b)")),
    # a notebook whose check cells still show a FAIL from an earlier run
    "stale_fail": lambda nb: [c.update(outputs=[{"output_type": "stream", "name": "stdout",
                                                 "text": "FAIL add: 0/5 cases passed\n"}])
                              for c in nb["cells"]
                              if c["metadata"].get("labsim", {}).get("role") == "check"],
}


def _insert_after(nb: dict, role: str, index: int, source: str) -> None:
    cells = [c for c in nb["cells"] if c["metadata"].get("labsim", {}).get("role") == role]
    at = nb["cells"].index(cells[index]) + 1
    nb["cells"].insert(at, {"cell_type": "code", "id": f"mine-{at}-{len(nb['cells'])}",
                            "metadata": {}, "execution_count": None, "outputs": [],
                            "source": source})


def _set_exercise(nb: dict, index: int, source: str) -> None:
    cells = [c for c in nb["cells"] if c["metadata"].get("labsim", {}).get("role") == "exercise"]
    cells[index]["source"] = source


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("grade")
    lab = gradelab.release_lab(root)
    box = sb.probe()
    subs = root / "subs"
    subs.mkdir()
    victim = root / "solutions" / "90_tiny.ipynb"
    other = subs / "zz_other.ipynb"
    extra_file = root / "private" / "extra.py"
    extra_file.parent.mkdir()
    extra_file.write_text(EXTRA)
    victims = {"solution": str(victim), "other": str(other), "extra": str(extra_file),
               "lab": str(lab)}
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
        "shown_pass": gradelab.submission(lab, subs / "shown_pass.ipynb",
                                          edit=_edit_cell("check", 0, _show_pass)),
        "narrative": gradelab.submission(lab, subs / "narrative.ipynb", **S,
                                         edit=_edit_cell("markdown", 0, _edit_markdown)),
        "hidden_tb": gradelab.submission(
            lab, subs / "hidden_tb.ipynb", scale=S["scale"], mean=S["mean"],
            add="get_ipython().showtraceback = lambda *a, **k: None\n" + WRONG_ADD),
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
        "segfault": gradelab.submission(lab, subs / "segfault.ipynb", add=S["add"],
                                        scale=S["scale"],
                                        mean="import os, signal\n"
                                             "os.kill(os.getpid(), signal.SIGSEGV)"),
        "probes": gradelab.submission(lab, subs / "probes.ipynb", add=_probes(victims),
                                      scale=S["scale"], mean=S["mean"]),
        "leak": gradelab.submission(lab, subs / "leak.ipynb", add=_leak(victims),
                                    scale=S["scale"], mean=S["mean"]),
        "neighbour": gradelab.submission(
            lab, subs / "neighbour.ipynb", add=S["add"], scale=S["scale"],
            mean="import os, signal, glob\n"
                 "for d in ('/tmp', '/dev/shm', '/run/labsim/home'):\n"
                 "    open(os.path.join(d, 'junk'), 'w').write('x' * 1000)\n"
                 "for pid in [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
                 "    if pid not in (os.getpid(), os.getppid()):\n"
                 "        try:\n            os.kill(pid, signal.SIGKILL)\n"
                 "        except OSError:\n            pass\n" + S["mean"]),
        "fork_bomb": gradelab.submission(
            lab, subs / "fork_bomb.ipynb", add=S["add"], scale=S["scale"],
            mean="import os, time\nkids = 0\n"
                 "for _ in range(5000):\n    if os.fork() == 0:\n"
                 "        time.sleep(120)\n        os._exit(0)\n    kids += 1\n" + S["mean"]),
        "kill_nbval": gradelab.submission(lab, subs / "kill_nbval.ipynb", add=S["add"],
                                          scale=S["scale"],
                                          mean="import os\nos.kill(os.getppid(), 9)"),
        "bad_results": gradelab.submission(
            lab, subs / "bad_results.ipynb", add=S["add"], scale=S["scale"],
            mean="import os\nout = '/run/labsim/out'\n"
                 "open(f'{out}/check-0.json', 'w').write('[' * 100000 + ']' * 100000)\n"
                 "os.remove(f'{out}/check-1.json')\n"
                 "os.symlink('/etc/passwd', f'{out}/check-1.json')\n" + S["mean"]),
        "other": gradelab.submission(lab, other, **S),
        **{name: gradelab.submission(lab, subs / f"{name}.ipynb", add=src, scale=S["scale"],
                                     mean=S["mean"]) for name, src in AROUND.items()},
        **{name: gradelab.submission(lab, subs / f"{name}.ipynb", scale=S["scale"],
                                     mean=S["mean"], edit=edit,
                                     **({} if name == "answer_below" else {"add": S["add"]}))
           for name, edit in HONEST.items()},
        **{name: gradelab.submission(lab, subs / f"{name}.ipynb", add=src, scale=S["scale"],
                                     mean=S["mean"]) for name, src in FORGE.items()},
    }
    if box.prlimit:  # without a memory limit this case would really take the machine's memory
        files["memory"] = gradelab.submission(
            lab, subs / "memory.ipynb", add=S["add"], scale=S["scale"],
            mean="blocks = [bytearray(10**9) for _ in range(50)]\n" + S["mean"])
    bad = {"bad_json": b'{"cells": [', "not_nb": b"[1, 2, 3]",
           "bad_schema": json.dumps({"cells": [{"cell_type": "code"}], "metadata": {},
                                     "nbformat": 4, "nbformat_minor": 5}).encode(),
           "wrong_lab": json.dumps({"cells": [], "metadata": {}, "nbformat": 4,
                                    "nbformat_minor": 5}).encode(),
           "utf16": (victim.read_text()).encode("utf-16"),
           "zip": b"PK\x03\x04" + b"\0" * 100,
           "deep": b'{"cells": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
           "latin1": b'{"cells": [], "x": "caf\xe9"}'}
    for name, data in bad.items():
        (subs / f"{name}.ipynb").write_bytes(data)
        files[name] = subs / f"{name}.ipynb"
    os.mkfifo(subs / "fifo.ipynb")
    (subs / "to_solution.ipynb").symlink_to(victim)
    (subs / "to_zero.ipynb").symlink_to("/dev/zero")
    (subs / "folder.ipynb").mkdir()
    big = json.loads(files["good"].read_text())
    big["cells"][0]["outputs"] = [{"output_type": "stream", "name": "stdout",
                                   "text": "x" * 70_000_000}]
    (subs / "huge.ipynb").write_text(json.dumps(big))
    files.update(fifo=subs / "fifo.ipynb", to_solution=subs / "to_solution.ipynb",
                 to_zero=subs / "to_zero.ipynb", folder=subs / "folder.ipynb",
                 huge=subs / "huge.ipynb")
    digests = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in subs.iterdir()
               if p.is_file() and not p.is_symlink() and p.name != "fifo.ipynb"}
    victim_digest = hashlib.sha256(victim.read_bytes()).hexdigest()
    out = root / "grades.csv"
    feedback = root / "feedback"
    keep = root / "keep"
    os.environ["LABSIM_TEST_GRADER_SECRET"] = SECRET
    try:
        rc = main([
            "grade", "--lab", str(lab), *map(str, files.values()), "--out", str(out),
            "--feedback", str(feedback), "--jobs", "2", "--timeout-cell", str(LIMITS.cell_s),
            "--timeout-notebook", str(LIMITS.notebook_s), "--memory", str(LIMITS.memory_bytes),
            "--extra-checks", str(extra_file), "--keep-runs", str(keep),
        ])
    finally:
        del os.environ["LABSIM_TEST_GRADER_SECRET"]
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    by_name = {Path(r["submission"]).stem: r for r in rows}
    key = {Path(p).stem: k for k, p in files.items()}
    return {
        "rc": rc, "root": root, "lab": lab, "box": box, "files": files, "out": out,
        "rows": {key[n]: r for n, r in by_name.items()}, "order": [r["submission"] for r in rows],
        "feedback": feedback, "digests": digests, "victim": victim, "keep": keep,
        "victim_digest": victim_digest, "extra": extra_file,
    }


def row(graded: dict, name: str) -> dict:
    return graded["rows"][name]


def scores(graded: dict, name: str) -> tuple[str, ...]:
    r = row(graded, name)
    return (r["add"], r["scale"], r["mean"], r["add_big"])


def feedback(graded: dict, name: str) -> str:
    return (graded["feedback"] / f"{Path(graded['files'][name]).stem}.txt").read_text()


def isolated(graded: dict) -> bool:
    return graded["box"].namespaces


# -- the whole run ---------------------------------------------------------------------------


def test_one_row_per_submission_in_input_order(graded: dict) -> None:
    assert graded["rc"] == 0
    assert graded["order"] == [str(p) for p in graded["files"].values()]
    header = graded["out"].read_text().splitlines()[0]
    assert header == ("submission,learner,status,add,scale,mean,add_big,total,max,"
                      "not_attempted,reason,review,sandbox")


def test_no_submission_is_modified(graded: dict) -> None:
    for path, digest in graded["digests"].items():
        if path == graded["files"]["other"] and not isolated(graded):
            continue  # without isolation, probes and attackers really reach it
        assert path.exists(), path
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, path
    if isolated(graded):
        assert (hashlib.sha256(graded["victim"].read_bytes()).hexdigest()
                == graded["victim_digest"])


def test_feedback_file_per_submission(graded: dict) -> None:
    names = sorted(p.name for p in graded["feedback"].iterdir())
    assert names == sorted(f"{Path(p).stem}.txt" for p in graded["files"].values())


def test_the_sandbox_column_names_what_is_missing(graded: dict) -> None:
    box = graded["box"]
    expected = "; ".join(box.missing)
    assert {r["sandbox"] for r in graded["rows"].values()
            if r["status"] != "invalid"} == {expected}


# -- scoring ---------------------------------------------------------------------------------

FULL = ("1", "2", "1", "3")


def test_correct_solution_earns_every_point(graded: dict) -> None:
    r = row(graded, "good")
    assert (r["status"], scores(graded, "good"), r["total"], r["max"], r["review"]) == (
        "ok", FULL, "7", "7", "")


def test_released_stub_earns_nothing(graded: dict) -> None:
    assert scores(graded, "stub") == ("0", "0", "0", "0")
    assert row(graded, "stub")["status"] == "ok"
    assert "not attempted" in feedback(graded, "stub")
    assert row(graded, "stub")["not_attempted"] == "add scale mean add_big"


def test_partial_credit_from_the_graders_comparisons(graded: dict) -> None:
    # scale fails the one negative-k case of 6: 2 points * 5/6
    assert scores(graded, "partial")[:2] == ("1", "1.67")
    text = feedback(graded, "partial")
    assert "5/6 cases passed" in text and "first failing case: 2*-3" in text


def test_hidden_check_scores_but_never_shows_its_cases(graded: dict) -> None:
    assert scores(graded, "capped") == ("1", "2", "1", "0")
    text = feedback(graded, "capped")
    assert "hidden check add_big (0/3 points)" in text and "0/5 cases passed" in text
    assert "1000000000007" not in text and "big1" not in text


@pytest.mark.parametrize("name", ["bad_json", "not_nb", "bad_schema", "wrong_lab", "utf16",
                                  "zip", "deep", "latin1", "fifo", "to_solution", "to_zero",
                                  "folder", "huge"])
def test_a_bad_file_is_an_invalid_row_naming_the_reason(graded: dict, name: str) -> None:
    r = row(graded, name)
    assert (r["status"], r["total"], r["max"]) == ("invalid", "0", "7")
    words = {"utf16": "UTF-16", "zip": "zip", "deep": "nested", "latin1": "UTF-8",
             "fifo": "FIFO", "to_solution": "symbolic link", "to_zero": "symbolic link",
             "folder": "directory", "huge": "MB"}
    assert words.get(name, "") in r["reason"]
    assert "could not be graded" in feedback(graded, name)


def test_deleted_exercise_cell(graded: dict) -> None:
    assert row(graded, "deleted")["status"] == "ok"
    assert scores(graded, "deleted") == ("1", "0", "1", "3")
    assert "exercise `scale`: not found" in feedback(graded, "deleted")


def test_recreated_exercise_cell_is_found_by_its_function(graded: dict) -> None:
    assert scores(graded, "recreated") == FULL


def test_check_edited_to_print_the_expected_line(graded: dict) -> None:
    r = row(graded, "check_edited")
    assert r["status"] == "tampered" and r["add"] == "0"
    assert "check `add` edited" in r["reason"]


def test_a_pass_shown_in_a_submitted_check_cell_earns_nothing(graded: dict) -> None:
    r = row(graded, "shown_pass")
    assert (r["status"], r["add"]) == ("ok", "0")


def test_narrative_edited_is_recorded(graded: dict) -> None:
    r = row(graded, "narrative")
    assert r["status"] == "tampered" and r["total"] == "7"
    assert "narrative" in r["reason"]


# -- forging a verdict from an exercise cell -------------------------------------------------


@pytest.mark.parametrize("name", ["hidden_tb", *FORGE])
def test_a_forged_verdict_earns_nothing_and_the_rest_is_graded(graded: dict, name: str
                                                               ) -> None:
    r = row(graded, name)
    assert scores(graded, name) == ("0", "2", "1", "0"), r
    assert r["review"], "the tools used are named for review"


@pytest.mark.parametrize("name", ["pool", "thread", "raw_thread", "child", "code_copy",
                                  "text", "prewrite"])
def test_work_done_where_the_check_does_not_look_scores_zero(graded: dict, name: str) -> None:
    r = row(graded, name)
    assert r["add"] == "0" and r["add_big"] == "0", r
    if name not in ("prewrite", "code_copy", "text"):  # these never define a working add
        assert "add:" in r["review"] and "add_big:" in r["review"], r


def test_a_pool_left_running_stops_the_checks_after_it(graded: dict) -> None:
    assert "did not run: the notebook still has threads running" in feedback(graded, "pool")


def test_a_collector_that_did_not_finish_leaves_nothing_that_counts(graded: dict) -> None:
    assert "could not run: SystemExit" in feedback(graded, "prewrite")


def test_the_checks_inputs_are_not_there_before_their_check_runs(graded: dict) -> None:
    """The checks' inputs (the hidden check's 10**12 ...) never reach a cell that runs
    before their check, so no text of the learner's carries them out."""
    text = feedback(graded, "early_inputs") + str(row(graded, "early_inputs"))
    assert "INPUTS" in text  # the exercise's error is reported ...
    assert "1000000000000" not in text and "big1" not in text  # ... without any input


@pytest.mark.parametrize("name", sorted(HONEST))
def test_a_correct_notebook_earns_full_marks_however_it_is_laid_out(graded: dict,
                                                                      name: str) -> None:
    r = row(graded, name)
    assert (r["status"], scores(graded, name), r["review"]) == ("ok", FULL, ""), r


def test_exercise_code_that_patches_the_checks_is_flagged(graded: dict) -> None:
    assert "importlib" in row(graded, "forge_code")["review"]
    assert "set_custom_exc" in row(graded, "forge_custom_exc")["review"]
    assert "_getframe" in row(graded, "forge_frame")["review"]


# -- the sandbox -----------------------------------------------------------------------------


def test_every_probe_of_the_sandbox_is_blocked(graded: dict) -> None:
    if not isolated(graded):
        pytest.skip("no namespaces here: the probes really escape")
    r = row(graded, "probes")
    assert scores(graded, "probes") == FULL, r["reason"]


def test_a_learners_exception_carries_nothing_of_the_grader_into_feedback(graded: dict
                                                                         ) -> None:
    r = row(graded, "leak")
    text = feedback(graded, "leak") + graded["out"].read_text()
    assert r["add"] == "0"
    assert SECRET not in text and "add_big" not in r["reason"]
    if isolated(graded):
        assert "Case(f\"big" not in text and "extra-check" not in text
    assert all(len(line) < 400 for line in feedback(graded, "leak").splitlines())


def test_a_neighbour_cannot_harm_the_runs_beside_it(graded: dict) -> None:
    assert scores(graded, "neighbour") == FULL or not isolated(graded)
    for name in ("good", "other", "recreated"):
        assert scores(graded, name) == FULL


def test_a_fork_bomb_is_stopped_by_the_process_limit(graded: dict) -> None:
    if not graded["box"].prlimit:
        pytest.skip("no process limit here")
    r = row(graded, "fork_bomb")
    assert scores(graded, "fork_bomb")[:2] == ("1", "2")
    assert r["mean"] == "0" and ("BlockingIOError" in r["reason"] or "OSError" in r["reason"]
                                 or r["status"] in ("timeout", "crashed")), r["reason"]


def test_killing_nbval_ends_the_run_and_keeps_earlier_points(graded: dict) -> None:
    r = row(graded, "kill_nbval")
    assert r["status"] == "crashed" and scores(graded, "kill_nbval")[:3] == ("1", "2", "0")


def test_results_the_learner_rewrote_are_refused_with_a_reason(graded: dict) -> None:
    r = row(graded, "bad_results")
    assert scores(graded, "bad_results")[:3] == ("0", "0", "1")
    # written by a later cell over what the checks left: refused, named for review
    assert "results rewritten: add" in r["review"] and "results rewritten: scale" in r["review"]
    assert "were not the check's own" in feedback(graded, "bad_results")


def test_keep_runs_copies_no_link_and_no_learner_root(graded: dict) -> None:
    kept = graded["keep"] / "bad_results"
    assert (kept / "run" / "in" / "graded.ipynb").is_file()
    assert not any(p.is_symlink() for p in graded["keep"].rglob("*"))
    assert not (kept / "run" / "root").exists()


def test_infinite_loop_times_out_and_the_rest_is_graded(graded: dict) -> None:
    r = row(graded, "loop")
    assert r["status"] == "timeout"
    assert scores(graded, "loop")[:3] == ("1", "0", "1")
    assert "exercise `scale` ran over the 8 s cell limit" in r["reason"]


def test_allocating_50_gb_hits_the_memory_limit(graded: dict) -> None:
    if not graded["box"].prlimit:
        pytest.skip("prlimit is not available here: no memory limit to test")
    r = row(graded, "memory")
    assert r["status"] == "ok" and scores(graded, "memory")[:3] == ("1", "2", "0")
    assert "exercise `mean` raised MemoryError" in r["reason"]


def test_a_loop_that_ignores_interrupts_is_stopped(graded: dict) -> None:
    r = row(graded, "deaf_loop")
    assert r["status"] == "timeout"
    assert scores(graded, "deaf_loop") == ("1", "0", "0", "0")
    assert "it ignored the interrupt, so the kernel was stopped" in r["reason"]
    assert "not run: the kernel was stopped" in feedback(graded, "deaf_loop")


def test_os_exit_is_a_crash_and_keeps_earlier_points(graded: dict) -> None:
    r = row(graded, "os_exit")
    assert r["status"] == "crashed"
    assert scores(graded, "os_exit") == ("1", "0", "0", "0")
    assert "the kernel died in exercise `scale`" in r["reason"]


def test_sys_exit_is_an_error_in_its_cell(graded: dict) -> None:
    r = row(graded, "sys_exit")
    assert r["status"] == "ok" and scores(graded, "sys_exit")[:3] == ("0", "2", "1")
    assert "exercise `add` raised SystemExit" in r["reason"]


def test_printing_100_mb_does_not_break_grading(graded: dict) -> None:
    r = row(graded, "flood")
    assert (r["status"], r["total"]) == ("ok", "7")


def test_segfault_is_a_crash(graded: dict) -> None:
    r = row(graded, "segfault")
    assert r["status"] == "crashed"
    assert scores(graded, "segfault") == ("1", "2", "0", "0")
    assert "the kernel died in exercise `mean`" in r["reason"]


# -- parallel = serial; whole-notebook limit; bad input --------------------------------------


def test_jobs_1_writes_the_same_rows_as_jobs_2(graded: dict) -> None:
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
    box = sb.Sandbox(namespaces, box.prlimit, drop_uid=box.drop_uid if namespaces else None)
    slow = "import time\ntime.sleep(2.5)\n"
    sub = gradelab.submission(graded["lab"], tmp_path / "slow.ipynb",
                              **{k: slow + v for k, v in S.items()})
    work = tmp_path / "work"
    report = gr.grade(graded["lab"], [sub],
                      gr.Options(limits=sb.Limits(cell_s=4, notebook_s=7), work_dir=work), box)
    (result,) = report.results
    assert result.status == "timeout"
    assert "the notebook ran over its 7 s limit" in result.reasons[0]
    assert result.total < result.maximum
    assert _gone(lambda: _processes_mentioning(str(work))) == []


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
    cancel = threading.Event()
    threading.Timer(4.0, cancel.set).start()
    record = sb.run_notebook(nbformat.writes(rebuilt.notebook), work, sb.Limits(60, 120),
                             graded["box"], sb.PortPool().take(), cancel=cancel)
    assert record.cancelled and not record.notebook_timed_out  # the cancel stopped it
    assert _gone(lambda: _processes_mentioning(str(work))) == []


def test_bad_arguments_exit_2_with_one_line(graded: dict, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    out = str(tmp_path / "g.csv")
    lab = str(graded["lab"])
    bad = tmp_path / "extra.py"
    bad.write_text("CHECKS = 'nothing'\n")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('oops')\n")
    fifo = tmp_path / "lab.ipynb"
    os.mkfifo(fifo)
    for argv in (["--lab", lab, "--out", out],  # no submissions
                 ["--lab", str(tmp_path / "nope.ipynb"), lab, "--out", out],
                 ["--lab", str(fifo), lab, "--out", out],
                 ["--lab", lab, lab, "--out", out, "--extra-checks", str(bad)],
                 ["--lab", lab, lab, "--out", out, "--extra-checks", str(broken)],
                 ["--lab", lab, lab, "--out", out, "--memory", "lots"],
                 ["--lab", lab, lab, "--out", out, "--memory", "nan"],
                 ["--lab", lab, lab, "--out", out, "--timeout-cell", "0"],
                 ["--lab", lab, lab, "--out", out, "--timeout-cell", "nan"],
                 ["--lab", lab, lab, "--out", out, "--timeout-notebook", "inf"],
                 ["--lab", lab, lab, "--out", out, "--jobs", "0"]):
        capsys.readouterr()
        assert main(["grade", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("labsim grade: error:"), (argv, err)
    assert not os.path.exists(out)


def test_help_describes_every_option(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["grade", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--lab", "--out", "--feedback", "--jobs", "--timeout-cell",
                   "--timeout-notebook", "--memory", "--extra-checks", "Hidden"):
        assert option in text


def test_a_notebook_that_is_not_a_released_lab_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.ipynb"
    plain.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4,
                                 "nbformat_minor": 5}))
    with pytest.raises(ValueError, match="no check cells"):
        rb.read_lab(plain)


# -- reading what a run left (no kernel) -----------------------------------------------------


def test_outcomes_are_read_defensively(tmp_path: Path) -> None:
    from labsim.checks._collect import write_plain
    from labsim.checks._core import Outcome

    write_plain(tmp_path / "check-0.json", {"index": 0, "outcomes": [Outcome(3).to_plain()]})
    assert [o.value for o in read_outcomes(tmp_path, "check-0", 1)] == [3]
    assert "1 results for 2 cases" in read_outcomes(tmp_path, "check-0", 2)
    (tmp_path / "check-1.json").write_text('{"$tensor": {"kind": "torch"}}')
    assert "not valid plain data" in read_outcomes(tmp_path, "check-1", 1)
    (tmp_path / "check-2.json").symlink_to(tmp_path / "check-0.json")
    assert read_outcomes(tmp_path, "check-2", 1) == "missing"
    os.mkfifo(tmp_path / "check-3.json")
    assert read_outcomes(tmp_path, "check-3", 1) == "missing"


def test_sanitize_keeps_a_short_printable_excerpt() -> None:
    assert sanitize("a\x1b[31mred\x00\u202e") == "a?[31mred??"
    assert sanitize("x" * 1000, 20) == "x" * 17 + "..."
    assert sanitize("one\ntwo\nthree", lines=2) == "one\ntwo [...]"


def test_a_kernel_that_cannot_start_is_a_crash_with_the_reason(tmp_path: Path) -> None:
    check = rb.Check("scale", 2.0, "labsim.checks._tiny:scale", ("scale",),
                     "PASS scale: 6/6 cases passed", 6)
    cells = (rb.Cell("code", "code cell 0"), rb.Cell("check", "check `scale`", 0))
    rebuilt = rb.Rebuilt(None, cells, (check,), (), (), ())
    records = "".join(json.dumps(
        {"cell": i, "phase": "setup", "outcome": "failed", "error_kind": "RuntimeError",
         "message": "Kernel died before replying to kernel_info", "kernel_alive": False}) + "\n"
        for i in range(2)).encode()
    run = sb.RunRecord(records, {}, tmp_path, 1, False, 1.0, "")
    status, scores_, reasons, _ = gr.score_run(rebuilt, run, LIMITS,
                                               gr.Expectations.build([check]))
    assert status == "crashed" and scores_[0].score == 0
    assert reasons == ["the kernel could not start: Kernel died before replying to kernel_info"]


def test_cell_records_ignore_malformed_lines() -> None:
    assert CellRecord.from_json({"cell": "1"}) is None
    assert CellRecord.from_json({"cell": True}) is None
    rec = CellRecord.from_json({"cell": 1, "outputs": [{"type": "nope"}, 3]})
    assert rec is not None and rec.outputs == ()


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
    path.write_text("from labsim.checks import Case, Hidden\n"
                    "CASES = [Case(str(i), (i, 1), expected=i + 1) for i in range(5)]\n"
                    "CHECKS = [Hidden('a', 'add', CASES, points=2.5), Hidden('b', 'add', CASES)]\n")
    extra = rb.read_extra_checks(path)
    assert [(c.name, c.points, c.hidden, c.functions, c.cases) for c in extra.checks] == [
        ("a", 2.5, True, ("add",), 5), ("b", 1.0, True, ("add",), 5)]
    path.write_text(path.read_text().replace("'b'", "'a'"))
    with pytest.raises(ValueError, match="unique"):
        rb.read_extra_checks(path)
    path.write_text("from labsim.checks import Case, Hidden\n"
                    "CHECKS = [Hidden('a', 'add', [Case('x', (1, 1), expected=2)])]\n")
    with pytest.raises(ValueError, match=">= 5"):
        rb.read_extra_checks(path)


@pytest.mark.slow
def test_a_package_under_the_hosts_tmp_is_visible_in_the_sandbox(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """A checkout (and its venv) under /tmp -- where a CI job may clone it -- is bound into
    the learner's root, not hidden by the sandbox's own /tmp."""
    if not str(tmp_path).startswith("/tmp/"):
        pytest.skip("the temporary folder is not under /tmp here")
    box = sb.probe()
    if not box.namespaces:
        pytest.skip("no namespaces: the run sees the host's file system anyway")
    shipped = tmp_path / "venv-like"
    shipped.mkdir()
    (shipped / "marker.txt").write_text("bound")
    real = sb.package_dirs
    monkeypatch.setattr(sb, "package_dirs",
                        lambda graded=None: [*real(graded), (str(shipped), str(shipped))])
    lab = gradelab.release_lab(tmp_path / "course")
    add = (f"def add(a, b):\n    return a + b if open({str(shipped / 'marker.txt')!r}).read()"
           " == 'bound' else None\n")
    sub = gradelab.submission(lab, tmp_path / "sub.ipynb", add=add, scale=S["scale"],
                              mean=S["mean"])
    out = tmp_path / "grades.csv"
    assert main(["grade", "--lab", str(lab), str(sub), "--out", str(out), "--feedback",
                 str(tmp_path / "fb"), "--timeout-cell", "60"]) == 0
    [r] = list(csv.DictReader(io.StringIO(out.read_text())))
    assert (r["status"], r["add"]) == ("ok", "1"), r
