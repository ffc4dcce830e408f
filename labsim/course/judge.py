"""Judging a run's results outside the grader's own process, under a memory and time budget.

What a graded notebook's collectors leave (``out/check-<i>.json``/``.bin``) is the learner's
data: decoding it is where a hostile submission can make the grader allocate gigabytes or
spin for minutes (32 MiB of ``[],[],...`` is 1.6 GB of Python lists).  So the grader never
decodes it: ``Judge`` runs ``python -m labsim.course.judge_main`` -- a process of its own that
builds the lab's expectations once (the same ``Expectations`` as the grader, from the same
lab and extra-checks file) and then, per request, reads one check's results (regular files
only, size-capped, never following a link), decodes them (``_plain.decode`` with its element
budget) and judges them with the check's ``Spec``; it answers with the verdict as plain JSON.

The process has an address-space limit (``MEMORY_BYTES`` above what it uses once set up) and
each request a time limit (``REQUEST_S``); a request that breaks either gets a reason instead
of a verdict, and the next request starts a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

MEMORY_BYTES = 2 * 2**30
REQUEST_S = 60.0


def verdict_of(spec: Any, cases: list[Any], out_dir: Path, stem: str) -> dict[str, Any]:
    """Read and judge one check's results; plain data (see ``Judge.verdict``)."""
    from labsim.course.records import read_outcomes

    got = read_outcomes(out_dir, stem, len(cases))
    if isinstance(got, str):
        return {"unreadable": got}
    verdict = spec.judge(cases, got)
    return {"passed": verdict.passed, "total": verdict.total,
            "first": list(verdict.first) if verdict.first else None,
            "not_done": verdict.not_done, "broken": list(verdict.broken),
            "message": verdict.message()}


def _address_space() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 4 * 2**30


class Judge:
    """The grader's side: one judging process, started on first use (and again after one
    died or ran over its time), asked one check at a time (thread-safe)."""

    def __init__(self, lab: Path, extra: Path | None = None,
                 request_s: float = REQUEST_S) -> None:
        self.lab, self.extra, self.request_s = Path(lab), extra, request_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.restarts = 0

    def _start(self) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "labsim.course.judge_main", str(self.lab),
               str(self.extra or "")]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, bufsize=1,
                                env={**os.environ, "MPLBACKEND": "Agg"})
        line = self._readline(proc, 600.0)
        if line is None or "ready" not in line:
            proc.kill()
            proc.wait()
            raise RuntimeError("the judging process did not start")
        return proc

    @staticmethod
    def _readline(proc: subprocess.Popen, timeout_s: float) -> dict | None:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not box or not box[0]:
            return None
        try:
            value = json.loads(box[0])
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def verdict(self, index: int, out_dir: Path, stem: str) -> dict[str, Any]:
        """``{"passed", "total", "first", "not_done", "broken", "message"}`` of check
        ``index``'s results in ``out_dir``, or ``{"unreadable": reason}``."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            try:
                proc.stdin.write(json.dumps({"index": index, "out": str(out_dir),
                                             "stem": stem}) + "\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                answer = None
            else:
                answer = self._readline(proc, self.request_s)
            if answer is None:
                self._stop()
                self.restarts += 1
                return {"unreadable": "its results could not be judged within the grader's "
                                      f"time and memory ({self.request_s:g} s, "
                                      f"{MEMORY_BYTES / 2**30:g} GiB)"}
            return answer

    def _stop(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                try:
                    self._proc.stdin.close()
                    self._proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._stop()
