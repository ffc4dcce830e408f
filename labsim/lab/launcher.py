"""Run a function on N worker processes with a process group, from a notebook, safely.

``launch(fn, nprocs)`` starts ``nprocs`` fresh Python processes (``python -m
labsim.lab.worker``), each joins a ``torch.distributed`` process group (gloo on CPUs, NCCL
when there is one CUDA GPU per worker), meeting through a file in the launch's own temporary
directory (no TCP port chosen in advance that another launch could take first), meets the
others at a barrier (so no rank runs and exits while a peer is still connecting), and calls
``fn(rank, world_size, *args, **kwargs)``.  It returns every rank's return value, or raises:

* ``WorkerError`` when a worker raised: the message carries that worker's traceback (the
  other workers are stopped, since they would wait for it forever);
* ``LaunchTimeout`` after ``timeout_s``: every worker is killed (its whole process group),
  so a deadlocked exercise never hangs the notebook.

``fn`` may live in an importable module (shipped by reference) or be defined in a notebook
cell: such functions cannot be pickled by reference under spawn, so the function, its
arguments and the notebook globals it uses are shipped by value with cloudpickle.

The same workers run under torchrun on a real node, with no launcher involved::

    torchrun --nproc_per_node=8 -m labsim.lab.worker labsim.checks.collectives.reference:demo

On Linux CPUs the workers are forked from a zygote that imported torch once, at the first
launch (``labsim.lab.zygote``): a launch then costs a fraction of a second plus the work, and
each worker is still a fresh process.  With ``env`` given, with the NCCL backend, elsewhere
than Linux, or with ``LABSIM_LAUNCH_FRESH=1`` in the environment, every worker is a new
interpreter (seconds each: it imports torch).  Batch a lab's real runs into few launches.  In a
notebook::

    def my_allreduce(rank, world, n):          # defined in a cell: shipped by value
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t.sum().item()

    result = launch(my_allreduce, 3, args=(1000,), timeout_s=60)
    result.values      # (3000.0, 3000.0, 3000.0): one value per rank
    result.stdout[1]   # what rank 1 printed

A check can hand a learner's function to an importable driver (``launch(driver, 3,
args=(learner_fn, cases))``) so one launch runs every case.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import cloudpickle

__all__ = ["LaunchResult", "LaunchTimeout", "WorkerError", "free_port", "launch"]

EXIT_GRACE_S = 10.0  # seconds a worker may take to exit after writing its result
ERROR_SETTLE_S = 2.0  # seconds the other ranks get to report after one rank failed


@dataclass(frozen=True)
class WorkerOutcome:
    """What one rank reports to the launcher: its return value, or the error it raised.

    ``finished_at`` is the wall clock (``time.time()``) when the call returned or raised: when
    several ranks fail, the earliest failure is the cause and the others are its echoes (a
    rank whose peer died fails in its next collective).
    """

    ok: bool
    value: Any = None
    exc_type: str = ""
    traceback: str = ""
    finished_at: float = 0.0


class WorkerError(RuntimeError):
    """A worker raised; ``rank`` is the first that did, ``remote_traceback`` its traceback."""

    def __init__(self, rank: int, remote_traceback: str, exc_type: str) -> None:
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exc_type = exc_type
        super().__init__(f"worker rank {rank} raised {exc_type}; its traceback:\n\n"
                         f"{remote_traceback}")


class LaunchTimeout(TimeoutError):
    """Workers were still running after the timeout and have been killed."""


@dataclass(frozen=True)
class LaunchResult:
    """Return values (``values[rank]``) and captured output of one launch."""

    values: tuple[Any, ...]
    stdout: tuple[str, ...]
    backend: str
    wall_s: float

    def __getitem__(self, rank: int) -> Any:
        return self.values[rank]

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.values)

    def __repr__(self) -> str:
        return (f"LaunchResult({len(self.values)} ranks over {self.backend}, "
                f"{self.wall_s:.1f} s wall)")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _default_backend(nprocs: int) -> str:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs:
        return "nccl"
    return "gloo"


def _kill(procs: Sequence[subprocess.Popen | _Forked]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _tail(path: Path, limit: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-limit:]


def launch(fn: Callable[..., Any] | str, nprocs: int = 2, *, args: Sequence[Any] = (),
           kwargs: Mapping[str, Any] | None = None, backend: str | None = None,
           timeout_s: float = 60.0, env: Mapping[str, str] | None = None,
           threads_per_worker: int = 1, progress: str | None = None) -> LaunchResult:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``nprocs`` processes; see module doc.

    ``fn`` may also be ``"package.module:function"``.  ``backend``: "gloo" (default on CPU)
    or "nccl" (default when each worker can have its own CUDA GPU).  ``threads_per_worker``
    sets torch's intra-op threads in each worker (1 keeps N workers from fighting over a
    few cores).  ``progress``: a label to show a progress bar under (ranks finished, seconds
    so far), drawn in place on stdout and erased when the launch ends, or None for none.
    Return values must be picklable (tensors are fine).
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a whole number >= 1, got {nprocs!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    backend = backend or _default_backend(nprocs)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not (callable(fn) or (isinstance(fn, str) and ":" in fn)):
        raise ValueError("fn must be a function or a 'module:function' string")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="labsim-launch-") as tmp:
        tmpdir = Path(tmp)
        payload = tmpdir / "payload.pkl"
        payload.write_bytes(cloudpickle.dumps(
            {"fn": fn, "args": tuple(args), "kwargs": dict(kwargs or {}), "backend": backend,
             # the process group's own timeout outlasts ours, so a hang always ends as
             # LaunchTimeout here, never as a gloo error racing it in a worker
             "timeout_s": timeout_s + 60.0, "threads": threads_per_worker,
             "init_method": (tmpdir / "rendezvous").as_uri()}))
        port = free_port()
        base = dict(os.environ)
        base.update(env or {})
        base["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] +
                                             [base.get("PYTHONPATH", "")])
        base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     "WORLD_SIZE": str(nprocs), "LABSIM_PARENT_PID": str(os.getpid())})
        procs: list[subprocess.Popen | _Forked] = []
        logs = [tmpdir / f"rank{r}.log" for r in range(nprocs)]
        results = [tmpdir / f"rank{r}.result" for r in range(nprocs)]
        zygote = _zygote() if _forkable(env, backend) else None
        try:
            for r in range(nprocs):
                wenv = dict(base, RANK=str(r), LOCAL_RANK=str(r))
                argv = ["--payload", str(payload), "--result", str(results[r])]
                forked = zygote.fork(argv, wenv, logs[r]) if zygote is not None else None
                if forked is not None:
                    procs.append(forked)
                    continue
                with open(logs[r], "wb") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "labsim.lab.worker", *argv],
                        env=wenv, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True))
            with _progress_bar(progress, nprocs) as bar:
                _wait(procs, results, logs, start, timeout_s, bar)
        finally:
            _kill(procs)
        outcomes = [_read(p) for p in results]
        return LaunchResult(tuple(o.value for o in outcomes),
                            tuple(_tail(lg, 100_000) for lg in logs), backend,
                            time.perf_counter() - start)


def _forkable(env: Mapping[str, str] | None, backend: str) -> bool:
    """Whether this launch's workers may be forked from the zygote (module doc)."""
    return (not env and backend == "gloo" and sys.platform == "linux" and hasattr(os, "fork")
            and os.environ.get("LABSIM_LAUNCH_FRESH", "") in ("", "0"))


class _Forked:
    """A worker forked by the zygote, with the part of ``subprocess.Popen`` the launcher uses;
    the zygote writes its exit status to ``exit_path``."""

    def __init__(self, pid: int, exit_path: Path, zygote: _Zygote) -> None:
        self.pid = pid
        self.exit_path = exit_path
        self.zygote = zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self.exit_path.read_text())
            except (OSError, ValueError):
                if self.zygote.proc.poll() is not None and not _alive(self.pid):
                    self.returncode = -signal.SIGKILL  # ended with its zygote
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        deadline = time.perf_counter() + timeout
        while self.poll() is None:
            if time.perf_counter() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Zygote:
    """The launching process's zygote (``labsim.lab.zygote``): one request, one forked worker."""

    READY_S = 120.0  # importing torch on a loaded laptop

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "labsim.lab.zygote"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1,
            start_new_session=True)
        self.lock = threading.Lock()
        self.ready = self._reply(self.READY_S).get("ready", False)

    def _reply(self, timeout_s: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        try:
            return json.loads(line) if line else {}
        except ValueError:
            return {}

    def alive(self) -> bool:
        return self.ready and self.proc.poll() is None

    def fork(self, argv: list[str], env: Mapping[str, str], log: Path) -> _Forked | None:
        """A worker running ``labsim.lab.worker`` with ``argv``, or None if the zygote is gone
        (the caller then starts a fresh interpreter)."""
        exit_path = log.with_suffix(".exit")
        request = {"argv": argv, "env": dict(env), "path": [p for p in sys.path if p],
                   "log": str(log), "exit": str(exit_path)}
        with self.lock:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
            except (OSError, ValueError):
                return None
            pid = self._reply(30.0).get("pid")
        return _Forked(pid, exit_path, self) if isinstance(pid, int) else None


def _zygote() -> _Zygote | None:
    """This process's zygote, started at the first call (and again if it died); None if it
    cannot start."""
    zygote = _zygote_of(os.getpid())
    if not zygote.alive():
        _zygote_of.cache_clear()
        zygote = _zygote_of(os.getpid())
    return zygote if zygote.alive() else None


@functools.cache
def _zygote_of(pid: int) -> _Zygote:
    """One zygote per launching process (keyed by pid: a forked child starts its own)."""
    return _Zygote()


def _read(path: Path) -> WorkerOutcome:
    outcome = pickle.loads(path.read_bytes())
    if not isinstance(outcome, WorkerOutcome):
        raise TypeError(f"{path}: not a worker outcome ({type(outcome).__name__})")
    return outcome


def _first_error(results: Sequence[Path]) -> tuple[int, WorkerOutcome] | None:
    """The rank whose failure came first, and its outcome (None while no rank failed)."""
    failed = [(rank, _read(path)) for rank, path in enumerate(results) if path.exists()]
    failed = [(rank, o) for rank, o in failed if not o.ok]
    return min(failed, key=lambda ro: (ro[1].finished_at, ro[0]), default=None)


def _settle(procs: Sequence[subprocess.Popen | _Forked], seconds: float) -> None:
    """Wait up to ``seconds`` for every process to exit."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.02)


class _Bar(Protocol):
    n: int

    def update(self, n: int) -> object: ...
    def set_postfix_str(self, s: str, refresh: bool = True) -> object: ...


@contextlib.contextmanager
def _progress_bar(label: str | None, nprocs: int) -> Iterator[_Bar | None]:
    if label is None:
        yield None
        return
    from tqdm.std import tqdm

    # a line of text on stdout that erases itself when the launch ends ("\r", blanks, "\r"):
    # JupyterLab, Colab and terminals draw it in place, and what the cell prints next (a
    # check's PASS line) is all that stays -- also for nbval, which collapses the "\r"s
    bar = tqdm(total=nprocs, desc=label, unit="rank", leave=False, file=sys.stdout, ncols=76,
               mininterval=0.0)
    try:
        yield bar
    finally:
        bar.close()
        sys.stdout.flush()


def _show(bar: _Bar | None, results: Sequence[Path], elapsed_s: float) -> None:
    """Bring the bar to the number of ranks that have written their result."""
    if bar is None:
        return
    done = sum(r.exists() for r in results)
    if done > bar.n:
        bar.update(done - bar.n)
    bar.set_postfix_str(f"{elapsed_s:.0f} s")


def _wait(procs: Sequence[subprocess.Popen | _Forked], results: Sequence[Path],
          logs: Sequence[Path], start: float, timeout_s: float, bar: _Bar | None = None) -> None:
    """Block until every worker is done; raise on a worker's error, a crash or the timeout.

    A worker that has written its result but does not exit (stuck tearing down its process
    group) is given ``EXIT_GRACE_S`` and then killed by the caller: its result stands."""
    all_written: float | None = None
    shown = 0.0
    while True:
        codes = [p.poll() for p in procs]
        error = _first_error(results)
        if error is not None:
            # a failure makes its peers fail too (a collective with a dead rank): give them a
            # moment to report, then blame the rank that failed first
            _settle(procs, ERROR_SETTLE_S)
            rank, outcome = _first_error(results) or error
            raise WorkerError(rank, outcome.traceback, outcome.exc_type)
        if bar is not None and time.perf_counter() - shown >= 0.5:  # twice a second
            shown = time.perf_counter()
            _show(bar, results, shown - start)
        if all_written is None and all(r.exists() for r in results):
            all_written = time.perf_counter()
        if all_written is not None and time.perf_counter() - all_written > EXIT_GRACE_S:
            _show(bar, results, time.perf_counter() - start)
            return
        for rank, code in enumerate(codes):
            if code is not None and not results[rank].exists():
                raise WorkerError(rank, f"(no Python traceback: the process exited with code "
                                        f"{code})\n--- its output ---\n{_tail(logs[rank])}",
                                  "process exit")
        if all(c is not None for c in codes):
            _show(bar, results, time.perf_counter() - start)
            return
        if time.perf_counter() - start > timeout_s:
            done = [r for r, c in enumerate(codes) if c is not None]
            raise LaunchTimeout(
                f"workers still running after {timeout_s:g} s were killed (finished ranks: "
                f"{done or 'none'}). A rank waiting for a message nobody sends (a send "
                f"without its recv, a rank skipping a collective) hangs like this.\n"
                f"--- rank 0 output ---\n{_tail(logs[0], 1500)}")
        time.sleep(0.02)
