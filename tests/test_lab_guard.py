"""The guard of graded runs (``labsim.lab.guard``): what notebook code may not do, whatever
thread it is on, and what library code still may.  Each case runs in a fresh interpreter
with the guard installed, as a graded run's ``sitecustomize`` does; "notebook code" is a file
outside the installation and labsim (a temporary file, like a cell's ``<notebook cell N>``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import ROOT

PRELUDE = """\
import sys, threading
from labsim.lab import guard
g = guard.install()
def attempt(name, act):
    try:
        act()
    except guard.GuardError:
        print(f"{name}=refused")
    except Exception as exc:
        print(f"{name}=failed {type(exc).__name__}")
    else:
        print(f"{name}=allowed")
"""


def _run(tmp_path: Path, body: str) -> dict[str, str]:
    script = tmp_path / "cell.py"  # outside every trusted folder: notebook code
    script.write_text(PRELUDE + textwrap.dedent(body))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, env={"PYTHONPATH": str(ROOT),
                                                          "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


def test_the_tools_that_reach_code_and_objects_are_refused(tmp_path: Path) -> None:
    got = _run(tmp_path, """
        def f(x):
            return x + 1
        import gc, types, ctypes, marshal
        attempt("code", lambda: f.__code__)
        attempt("function", lambda: types.FunctionType(compile("1", "x", "eval"), {}))
        attempt("exec", lambda: exec("y = 1"))
        attempt("eval", lambda: eval("1 + 1"))
        attempt("gc", lambda: gc.get_objects())
        attempt("referrers", lambda: gc.get_referrers(f))
        attempt("ctypes", lambda: ctypes.CDLL(None).getpid())
        attempt("marshal", lambda: marshal.loads(b"N"))
        attempt("settrace", lambda: sys.settrace(None))
        attempt("setprofile", lambda: sys.setprofile(None))
        attempt("frames", lambda: sys._current_frames())
        def _raise():
            try:
                raise ValueError
            except ValueError as e:
                return e
        attempt("traceback frame", lambda: _raise().__traceback__.tb_frame)
    """)
    for name in ("code", "function", "exec", "eval", "gc", "referrers", "ctypes", "marshal",
                 "settrace", "setprofile", "frames", "traceback frame"):
        assert got[name] == "refused", (name, got)



def test_in_another_thread_too(tmp_path: Path) -> None:
    got = _run(tmp_path, """
        import gc
        t = threading.Thread(target=lambda: attempt("thread gc", gc.get_objects))
        t.start(); t.join()
    """)
    assert got["thread gc"] == "refused"


def test_library_code_keeps_working(tmp_path: Path) -> None:
    got = _run(tmp_path, """
        import inspect, dataclasses, json, pickle, numpy, torch
        def f(x):
            return x + 1
        attempt("inspect.signature", lambda: inspect.signature(f))
        attempt("dataclass", lambda: dataclasses.make_dataclass("D", ["a"])(1))
        attempt("torch", lambda: torch.randn(3).sum())
        attempt("pickle", lambda: pickle.loads(pickle.dumps({"a": 1})))
        attempt("import", lambda: __import__("labsim.checks.quantization.reference"))
        attempt("subprocess", lambda: __import__("subprocess").run(["true"], check=True))
    """)
    assert set(got.values()) == {"allowed"}, got


def test_labsim_source_files_cannot_be_read_by_notebook_code(tmp_path: Path) -> None:
    got = _run(tmp_path, """
        import inspect, labsim.roofline as r
        attempt("open", lambda: open(r.__file__).read())
        attempt("getsource", lambda: inspect.getsource(r.Roofline))
        attempt("write elsewhere", lambda: open("mine.py", "w").write("x = 1"))
        attempt("read own file", lambda: open("mine.py").read())
    """)
    assert got["open"] == "refused"
    assert got["getsource"] == "failed OSError"  # linecache finds no lines
    assert got["write elsewhere"] == got["read own file"] == "allowed"


def test_starting_a_process_is_refused_only_while_a_check_watches(tmp_path: Path) -> None:
    got = _run(tmp_path, """
        import subprocess, os
        attempt("before", lambda: subprocess.run(["true"], check=True))
        with guard.watching():
            attempt("watched", lambda: subprocess.run(["true"], check=True))
            attempt("fork", lambda: os.waitpid(os.fork() or 0, 0))
        with guard.watching(processes=True):
            attempt("allowed", lambda: subprocess.run(["true"], check=True))
        attempt("after", lambda: subprocess.run(["true"], check=True))
    """)
    assert (got["before"], got["watched"], got["fork"], got["allowed"], got["after"]) == (
        "allowed", "refused", "refused", "allowed", "allowed")


def test_a_refusal_is_remembered_even_when_the_error_is_caught(tmp_path: Path) -> None:
    got = _run(tmp_path, """
        import gc
        try:
            gc.get_objects()
        except Exception:
            pass
        print("refused=" + (",".join(g.refused) or "nothing"))
    """)
    assert got["refused"] == "gc.get_objects"


def test_the_guard_cannot_be_installed_twice_or_taken_out(tmp_path: Path) -> None:
    got = _run(tmp_path, """
        print(f"same={guard.install() is g}")
        # CPython drops a new hook when an existing one refuses it, without a word
        sys.addaudithook(lambda event, args: print("hooked=yes") if event == "mine" else None)
        sys.audit("mine")
        print(f"refused={g.refused}")
    """)
    assert got["same"] == "True" and "hooked" not in got
    assert "sys.addaudithook" in got["refused"]


@pytest.mark.parametrize("name", ["start_new_thread", "fork"])
def test_watch_notes_threads_started_below_threading(tmp_path: Path, name: str) -> None:
    got = _run(tmp_path, f"""
        import _thread, time, torch
        from labsim.checks._observe import watch
        with watch([]) as w:
            if {name!r} == "fork":
                torch.jit.fork(lambda: 1).wait()
            else:
                done = []
                _thread.start_new_thread(lambda: done.append(1), ())
                while not done:
                    time.sleep(0.001)
        print(f"started={{w.summary().get('threads_started')}}")
    """)
    assert got["started"] != "None", got
