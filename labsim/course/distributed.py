"""Grading a large class on a Dask cluster: ``labsim grade --dask ADDRESS``.

A class of 300 learners and 16 labs is some 4,200 notebook runs of about a minute each: more
than one machine should do.  ``DaskEngine`` hands the submissions to the workers of a Dask
``distributed`` cluster (a scheduler's address, or ``local:N`` for N worker processes on this
machine).  Every worker sets the lab up once (``LabGrader``, a worker plugin: the released
lab, the expectations, the judging process, the graded copy of labsim) and then grades the
submissions it is given one at a time, each in a sandbox of its own exactly as ``labsim
grade`` does on one machine; the notebooks travel as bytes, so the workers need no shared
file system, only the same labsim installed.  What comes back is plain data; the client
writes the CSV and the feedback files.  The CSV is the same whatever the cluster.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

PLUGIN_PREFIX = "labsim-grade-"

try:  # Dask is what this module drives; without it, ``DaskEngine`` says what to install
    from distributed import WorkerPlugin
except ImportError:  # pragma: no cover - dask[distributed] not installed
    WorkerPlugin = object  # type: ignore[assignment, misc]


class LabGrader(WorkerPlugin):
    """A Dask worker plugin: one ``grade.Grader`` for one lab on each worker."""

    name = "labsim-grade"

    def __init__(self, lab_name: str, lab_bytes: bytes, extra_bytes: bytes, limits: Any,
                 key: str) -> None:
        super().__init__()
        self.lab_name, self.lab_bytes, self.extra_bytes = lab_name, lab_bytes, extra_bytes
        self.limits = limits
        self.name = PLUGIN_PREFIX + key
        self.grader: Any = None
        self.folder: Path | None = None

    def setup(self, worker: Any = None) -> None:
        from labsim.course import grade as gr
        from labsim.course import rebuild as rb

        self.folder = Path(tempfile.mkdtemp(prefix="labsim-dask-"))
        lab = self.folder / self.lab_name
        lab.write_bytes(self.lab_bytes)
        extra = None
        if self.extra_bytes:
            path = self.folder / "extra_checks.py"
            path.write_bytes(self.extra_bytes)
            extra = rb.read_extra_checks(path, rb.read_lab(lab))
        options = gr.Options(limits=self.limits, jobs=1, extra=extra,
                             work_dir=self.folder / "work")
        self.grader = gr.Grader(lab, options, jobs=1)

    def teardown(self, worker: Any = None) -> None:
        import shutil

        if self.grader is not None:
            self.grader.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def grade_remote(plugin: str, data: bytes, name: str, learner: str) -> dict[str, Any]:
    """On a worker: grade one submission (its bytes) with the worker's ``LabGrader``; the
    result as plain data (``result_to_plain``)."""
    from distributed import get_worker

    grader = get_worker().plugins[plugin].grader
    folder = Path(tempfile.mkdtemp(prefix="sub-", dir=grader.workroot))
    path = folder / Path(name).name
    path.write_bytes(data)
    try:
        result = grader.one(path, name, learner)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return {"result": result_to_plain(result), "warnings": list(grader.box.warnings)}


def result_to_plain(result: Any) -> dict[str, Any]:
    """A ``grade.Result`` without its checks' definitions (an instructor's hidden checks do
    not travel): each score by the index of its check."""
    return {"submission": result.submission, "status": result.status,
            "scores": [(s.score, s.passed, s.detail, list(s.flags), s.state,
                        list(s.first) if s.first else None) for s in result.scores],
            "reasons": list(result.reasons), "notes": list(result.notes),
            "flags": list(result.flags), "wall_s": result.wall_s, "sandbox": result.sandbox,
            "learner": result.learner}


def result_from_plain(raw: dict[str, Any], checks: Sequence[Any]) -> Any:
    from labsim.course.grade import CheckScore, Result

    scores = tuple(CheckScore(c, float(sc), bool(ok), str(detail), tuple(flags), str(state),
                              tuple(first) if first else None)
                   for c, (sc, ok, detail, flags, state, first) in zip(
                       checks, raw["scores"], strict=True))
    return Result(raw["submission"], raw["status"], scores, tuple(raw["reasons"]),
                  tuple(raw["notes"]), tuple(raw["flags"]), float(raw["wall_s"]),
                  raw["sandbox"], raw["learner"])


class DaskEngine:
    """Grade on the Dask cluster at ``address`` (``tcp://host:8786``), or on ``local:N``
    worker processes started here (one thread each: a worker grades one notebook at a
    time)."""

    def __init__(self, address: str) -> None:
        self.address = address

    def _client(self) -> tuple[Any, Any]:
        from distributed import Client, LocalCluster

        if self.address.startswith("local"):
            _, _, n = self.address.partition(":")
            workers = int(n) if n.strip() else max(1, (os.cpu_count() or 1) // 2)
            if workers < 1:
                raise ValueError(f"--dask {self.address}: give at least one worker")
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                   dashboard_address=None)
            return Client(cluster), cluster
        return Client(self.address), None

    def grade(self, lab_path: Path, submissions: Sequence[Path], names: Sequence[str],
              learners: Sequence[str], options: Any) -> tuple[tuple, tuple, tuple]:
        from labsim.course import rebuild as rb
        from labsim.course.grade import _invalid

        lab = rb.read_lab(lab_path)
        checks = lab.checks + (options.extra.checks if options.extra else ())
        lab_bytes = Path(lab_path).read_bytes()
        extra_bytes = (Path(options.extra.path).read_bytes()
                       if options.extra and options.extra.path else b"")
        key = hashlib.sha256(lab_bytes + b"\0" + extra_bytes).hexdigest()[:16]
        plugin = LabGrader(Path(lab_path).name, lab_bytes, extra_bytes, options.limits, key)
        client, cluster = self._client()
        try:
            client.register_plugin(plugin, name=plugin.name)
            futures: list[Any] = []
            for path, name, learner in zip(submissions, names, learners, strict=True):
                data, problem = _read(Path(path))
                futures.append(problem or client.submit(grade_remote, plugin.name, data, name,
                                                        learner, pure=False))
            sent = [f for f in futures if not isinstance(f, str)]
            answers = iter(client.gather(sent))
        finally:
            client.close()
            if cluster is not None:
                cluster.close()
        results, warnings = [], []
        for i, future in enumerate(futures):
            if isinstance(future, str):  # refused here, as a worker would have refused it
                results.append(replace(_invalid(names[i], checks, future), learner=learners[i]))
                continue
            answer = next(answers)
            results.append(result_from_plain(answer["result"], checks))
            warnings += answer["warnings"]
        return tuple(checks), tuple(results), tuple(dict.fromkeys(warnings))


def _read(path: Path) -> tuple[bytes, str]:
    """(a submission's bytes, "") for a worker, or (b"", why it cannot be graded): the same
    defensive read the grader makes (no link, FIFO or oversized file is sent)."""
    from labsim.course.records import read_regular
    from labsim.course.submission import MAX_SUBMISSION_BYTES, read_submission

    nb, problem = read_submission(path)
    if nb is None:
        return b"", problem
    data = read_regular(path, MAX_SUBMISSION_BYTES)
    return (data, "") if data is not None else (b"", "the file changed while it was read")


__all__ = ["DaskEngine", "LabGrader", "grade_remote", "result_from_plain", "result_to_plain"]
