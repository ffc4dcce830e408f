"""The launcher: results back, a worker's traceback shown, hung workers killed, torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from labsim.lab import launcher
from labsim.lab.launcher import LaunchTimeout, WorkerError, free_port, launch

from .conftest import ROOT

pytestmark = pytest.mark.multiprocess

NOTEBOOK_CELL = '''
import torch
import torch.distributed as dist

SCALE = 10.0  # a notebook global the function uses

def total(rank, world, offset, *, extra=0.0):
    t = torch.tensor([rank * SCALE])
    dist.all_reduce(t)
    return float(t) + offset + extra + world
'''


def notebook_function():
    """A function defined as in a notebook cell: its module cannot be imported by workers."""
    namespace: dict = {"__name__": "__main_notebook__"}
    exec(compile(NOTEBOOK_CELL, "<notebook cell>", "exec"), namespace)
    return namespace["total"]


def test_a_notebook_function_runs_by_value_and_returns_every_rank():
    result = launch(notebook_function(), 2, args=(0.5,), kwargs={"extra": 1.0})
    assert list(result) == [10.0 * 1 + 0.5 + 1.0 + 2] * 2
    assert result.backend == "gloo" and len(result) == 2


def test_a_port_another_process_holds_does_not_break_a_launch(monkeypatch):
    """Two launches at once (two test workers, two kernels) may be handed the same free port;
    the ranks meet through a file in the launch's directory, so a port held by someone else
    changes nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(launcher, "free_port", lambda: taken.getsockname()[1])
        result = launch(notebook_function(), 2, args=(0.5,), timeout_s=60)
    assert list(result) == [10.0 + 0.5 + 2] * 2


class _Proc(NamedTuple):
    ppid: int
    name: str  # /proc/<pid>/comm
    cmdline: bytes
    zombie: bool


def _processes() -> dict[int, _Proc]:
    """Every process on the machine, from /proc."""
    table = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes()
            status = (proc / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        table[int(proc.name)] = _Proc(int(fields.get("PPid", "0").strip() or 0),
                                      fields.get("Name", "").strip(), cmd,
                                      fields.get("State", "").startswith("Z"))
    return table


def _below(table: dict[int, _Proc], pid: int, root: int) -> bool:
    """Whether ``pid`` descends from ``root``."""
    for _ in range(64):
        pid = table[pid].ppid if pid in table else 0
        if pid == root:
            return True
        if pid in (0, 1):
            return False
    return False


def _workers_alive() -> list[int]:
    """PIDs of launcher workers (``labsim.lab.worker --payload``, or a process the zygote forked
    and named ``labsim-worker``) still running that this test process started (its
    descendants) or that nothing waits for (orphans, adopted by init); another job's workers
    on the machine are neither."""
    table, me = _processes(), os.getpid()
    return [pid for pid, p in table.items() if not p.zombie
            and ((b"labsim.lab.worker" in p.cmdline and b"--payload" in p.cmdline)
                 or p.name == "labsim-worker")
            and (p.ppid == 1 or _below(table, pid, me))]


def test_a_worker_that_raises_shows_its_traceback():
    code = NOTEBOOK_CELL + '''
def broken(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()   # rank 0 would wait here forever
'''
    ns: dict = {"__name__": "__main_notebook__"}
    exec(compile(code, "<notebook cell>", "exec"), ns)
    with pytest.raises(WorkerError) as info:  # a WorkerError, not LaunchTimeout: rank 0 is
        launch(ns["broken"], 2, timeout_s=60)  # stopped, not waited for
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert "rank one is broken" in str(info.value) and "Traceback" in str(info.value)
    assert _workers_alive() == []


def test_a_hung_worker_is_killed_after_the_timeout():
    code = NOTEBOOK_CELL + '''
def hangs(rank, world):
    if rank == 0:
        t = torch.zeros(1)
        dist.recv(t, 1)   # rank 1 never sends ...
    while True:           # ... because it is stuck in a loop that never ends
        time.sleep(0.1)
import time
from pathlib import Path
'''
    ns: dict = {"__name__": "__main_notebook__"}
    exec(compile(code, "<notebook cell>", "exec"), ns)
    with pytest.raises(LaunchTimeout, match="killed"):
        launch(ns["hangs"], 2, timeout_s=6)
    assert _workers_alive() == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="nprocs"):
        launch(print, 0)
    with pytest.raises(ValueError, match="backend"):
        launch(print, 1, backend="mpi")
    assert 0 < free_port() < 65536


def test_the_same_worker_runs_under_torchrun():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         f"--master_port={port}", "-m", "labsim.lab.worker",
         "labsim.checks.collectives.reference:demo"],
        capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count(": 0.0") == 2


def test_a_worker_that_will_not_exit_after_its_result_is_killed_and_its_result_kept():
    code = NOTEBOOK_CELL + '''
import threading, time

def lingers(rank, world):
    threading.Thread(target=time.sleep, args=(3600,)).start()  # blocks interpreter exit
    return rank
'''
    ns: dict = {"__name__": "__main_notebook__"}
    exec(compile(code, "<notebook cell>", "exec"), ns)
    # results, not LaunchTimeout: the grace period ended the launch, and the workers are gone
    assert list(launch(ns["lingers"], 2, timeout_s=120)) == [0, 1]
    assert _workers_alive() == []


def test_progress_shows_ranks_finishing_then_erases_itself(capsys) -> None:
    """With a label, the launch draws a bar on stdout that reaches every rank done and is
    erased at the end, so what is printed next is all a notebook (and nbval) keeps."""
    from nbformat.v4 import new_output
    from nbval.plugin import coalesce_streams

    assert list(launch("labsim.checks.collectives.reference:demo", 2, timeout_s=120,
                       progress="ring demo")) == [0.0, 0.0]
    print("PASS ring: 3/3 cases passed")
    out = capsys.readouterr().out
    assert "ring demo" in out and "2/2" in out
    [kept] = coalesce_streams([new_output("stream", name="stdout", text=out)])
    assert kept.text == "PASS ring: 3/3 cases passed\n"


STATE_CELL = '''
import os, sys
import torch

def leave_a_mark(rank, world):
    torch.distributed.all_reduce = lambda *a, **k: None   # a cheat, in this worker only
    torch._left_by_an_earlier_launch = True
    return os.getppid()

def look(rank, world, name):
    import importlib
    return (hasattr(torch, "_left_by_an_earlier_launch"),
            torch.distributed.all_reduce.__module__, os.environ.get(name),
            importlib.import_module("fresh_module").VALUE, os.getppid())
'''


def test_each_launch_gets_fresh_workers_that_see_the_launchers_environment_and_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers forked from the zygote start from the zygote, never from an earlier launch's
    worker, and see what the launcher set after the zygote started (environment, sys.path)."""
    ns: dict = {"__name__": "__main_notebook__"}
    exec(compile(STATE_CELL, "<notebook cell>", "exec"), ns)
    parents = launch(ns["leave_a_mark"], 2, timeout_s=120)
    assert all(p != os.getpid() for p in parents)  # forked by the zygote, not by this process
    (tmp_path / "fresh_module.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LABSIM_TEST_SET_LATER", "seen")
    marked, module, seen, value, _ = launch(ns["look"], 2, args=("LABSIM_TEST_SET_LATER",),
                                            timeout_s=120)[1]
    assert (marked, module, seen, value) == (
        False, "torch.distributed.distributed_c10d", "seen", 42)
    assert _workers_alive() == []


def test_fresh_interpreters_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LABSIM_LAUNCH_FRESH", "1")
    ns: dict = {"__name__": "__main_notebook__"}
    exec(compile(STATE_CELL, "<notebook cell>", "exec"), ns)
    assert list(launch(ns["leave_a_mark"], 2, timeout_s=120)) == [os.getpid()] * 2


def test_workers_and_zygote_end_when_the_launching_process_is_killed() -> None:
    """A kernel killed mid-launch (a restart) leaves no worker and no zygote behind."""
    script = NOTEBOOK_CELL + '''
import time
from labsim.lab.launcher import launch

def sleeps(rank, world):
    time.sleep(3600)

print("launching", flush=True)
launch(sleeps, 2, timeout_s=3600)
'''
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "launching"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_descendants(proc.pid, "labsim-worker")) < 2:
            time.sleep(0.2)
        assert len(_descendants(proc.pid, "labsim-worker")) == 2
        everything = _descendants(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_running(pid) for pid in everything):
        time.sleep(0.2)
    assert [pid for pid in everything if _running(pid)] == []


def _descendants(root: int, name: str | None = None) -> list[int]:
    """Processes below ``root`` (with ``name`` as their /proc comm, if given)."""
    table = _processes()
    return [pid for pid, p in table.items()
            if (name is None or p.name == name) and _below(table, pid, root)]


def _running(pid: int) -> bool:
    p = _processes().get(pid)
    return p is not None and not p.zombie


def test_a_dead_zygote_is_replaced_at_the_next_launch() -> None:
    from labsim.lab import launcher

    ns: dict = {"__name__": "__main_notebook__"}
    exec(compile(STATE_CELL, "<notebook cell>", "exec"), ns)
    first = launch(ns["leave_a_mark"], 2, timeout_s=120)
    zygote = launcher._zygote()
    assert zygote is not None and set(first) == {zygote.proc.pid}
    zygote.proc.kill()
    zygote.proc.wait()
    second = launch(ns["leave_a_mark"], 2, timeout_s=120)
    again = launcher._zygote()
    assert again is not None and set(second) == {again.proc.pid} != set(first)
