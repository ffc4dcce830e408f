"""A preloaded process that forks the launcher's workers, so a launch does not pay torch's import.

A fresh worker spends 2-4 s importing torch (and ``torch._dynamo``, which the first optimizer
step, DDP or dispatch mode pulls in) before it runs a line of the exercise; a lab or a grader
launches tens of times.  ``launch()`` therefore starts one zygote per launching process, at its
first launch: ``python -m labsim.lab.zygote`` imports torch once and then, per request, forks a
worker that is as fresh as a spawned one (its own session, environment, ``sys.path`` and log;
nothing of an earlier worker survives in it, since each is forked from the untouched zygote).
The zygote never runs a tensor op: forking after OpenMP has started its threads can hang the
child, forking before is what PyTorch's own DataLoader workers do.

Protocol, one JSON line each way on the zygote's stdin / stdout: the launcher sends
``{"argv", "env", "path", "log", "exit"}``, the zygote forks, answers ``{"pid"}``, and when the
worker ends writes its exit status (a number, negative for a signal) to the ``exit`` file.
The zygote exits when its stdin closes, i.e. with the process that started it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import sys
from pathlib import Path

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "cloudpickle",
           "labsim.lab.worker")
WORKER_NAME = b"labsim-worker"  # the worker's /proc/<pid>/comm
POLL_S = 0.02


def _write_exit(path: str, code: int) -> None:
    tmp = f"{path}.tmp"
    with contextlib.suppress(OSError):  # the launch's folder may be gone already
        Path(tmp).write_text(str(code))
        os.replace(tmp, path)


def _reap(children: dict[int, str]) -> None:
    """Record the exit status of every worker that has ended."""
    while children:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            _write_exit(path, os.waitstatus_to_exitcode(code))


def _become_worker(request: dict) -> None:
    """In the forked child: a session, output and environment of its own, then the worker."""
    os.setsid()
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, WORKER_NAME, 0, 0, 0)  # PR_SET_NAME
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    from labsim.lab import worker

    code = 1
    try:
        code = worker.main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> int:
    """Preload, say ready, then fork one worker per request until stdin closes."""
    for name in PRELOAD:
        __import__(name)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    inp = os.fdopen(os.dup(0), "r", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # a worker's stray output never lands on the protocol pipe
    os.close(null)
    out.write('{"ready": true}\n')
    children: dict[int, str] = {}
    while True:
        ready, _, _ = select.select([inp], [], [], POLL_S)
        _reap(children)
        if not ready:
            continue
        line = inp.readline()
        if not line:
            return 0
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            inp.close()
            out.close()
            _become_worker(request)
        children[pid] = request["exit"]
        out.write(json.dumps({"pid": pid}) + "\n")


if __name__ == "__main__":
    sys.exit(serve())
