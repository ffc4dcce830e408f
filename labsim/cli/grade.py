"""Grade a class: run every submitted notebook of one lab in a sandbox, write one CSV row per
submission (a column per check, total, max, status, reason) and a feedback file per learner.

Each submission is rebuilt from the released lab (only exercise cells are taken from it) and
run under nbval in its own process and kernel, with time and memory limits and, where Linux
allows it, no network and a read-only file system.  See docs/instructors.md."""

from __future__ import annotations

import argparse
import importlib.util
import re
import signal
import sys
from pathlib import Path

from labsim.course import grade as gr
from labsim.course import notebook as nbk
from labsim.course import rebuild as rb
from labsim.course import sandbox as sb
from labsim.course.feedback import lms_text, summary_text

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'4GiB', '2.5GB', '800MB' or a plain number of bytes -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m[2].lower() not in _UNITS:
        raise ValueError(f"--memory {text!r}: give bytes or a size such as 4GiB, 3GB, 800MB")
    value = int(float(m[1]) * _UNITS[m[2].lower()])
    if value > 2**50:
        raise ValueError(f"--memory {text!r}: over 1 PiB; give e.g. 4GiB")
    return value


def write_summary(report: gr.Report, folder: Path) -> None:
    """summary.txt and scores.png of the class in ``folder``."""
    from labsim.plots.grade import scores

    folder.mkdir(parents=True, exist_ok=True)
    nbk.write_atomic(folder / "summary.txt", summary_text(report))
    if not report.results:
        return
    rates = {c.name: sum(r.scores[i].passed for r in report.results) / len(report.results)
             for i, c in enumerate(report.checks)}
    fig = scores([r.total for r in report.results], report.results[0].maximum, rates,
                 title=f"{report.lab}: {len(report.results)} submission(s)")
    tmp = folder / ".scores.png.tmp"
    fig.savefig(tmp, format="png", dpi=110)
    tmp.replace(folder / "scores.png")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = sb.Limits()
    parser.add_argument("submissions", nargs="*", type=Path, help="submitted .ipynb files")
    parser.add_argument("--lab", type=Path, required=True, help="the released lab, labs/NN.ipynb")
    parser.add_argument("--out", type=Path, required=True, help="CSV file to write")
    parser.add_argument("--feedback", type=Path, help="folder for one feedback file per learner")
    parser.add_argument("--jobs", type=int, default=1, help="submissions graded at once")
    parser.add_argument("--timeout-cell", type=float, default=d.cell_s,
                        help=f"seconds one cell may run (default {d.cell_s:g})")
    parser.add_argument("--timeout-notebook", type=float, default=d.notebook_s,
                        help=f"seconds for a whole notebook (default {d.notebook_s:g})")
    parser.add_argument("--memory", default=str(d.memory_bytes),
                        help="address-space limit of each kernel (default 4GiB)")
    parser.add_argument("--keep-runs", type=Path,
                        help="keep each run's working folder (graded notebook, nbval log) here")
    parser.add_argument("--extra-checks", type=Path,
                        help="a private .py file defining CHECKS = [labsim.checks.Hidden(...)]")
    parser.add_argument("--summary", type=Path,
                        help="folder for the class summary: summary.txt (per-check pass rates, "
                             "score distribution) and scores.png")
    parser.add_argument("--lms", action="append", default=[], metavar="FORMAT",
                        choices=("canvas", "moodle", "gradescope"),
                        help="also write the totals as a gradebook import beside --out "
                             "(OUT-canvas.csv, ...): canvas, moodle or gradescope; repeatable")
    parser.add_argument("--dask", metavar="ADDRESS",
                        help="grade on a Dask cluster: its scheduler (tcp://host:8786) or "
                             "local:N for N worker processes here; each submission still runs "
                             "in a sandbox of its own")


def run(args: argparse.Namespace) -> int:
    missing = [m for m in ("pytest", "nbval") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"grading needs {' and '.join(missing)}: pip install 'labsim[grade]'")
    if not args.submissions:
        raise ValueError("no submissions given; pass the notebooks to grade")
    if not args.lab.is_file():
        raise ValueError(f"--lab {args.lab}: no such file")
    if not 1 <= args.jobs <= 256:
        raise ValueError(f"--jobs {args.jobs}: give a whole number from 1 to 256")
    limits = sb.Limits(args.timeout_cell, args.timeout_notebook, parse_bytes(args.memory))
    try:
        lab = rb.read_lab(args.lab)
    except nbk.NotebookError as exc:
        raise ValueError(str(exc)) from None
    extra = rb.read_extra_checks(args.extra_checks, lab) if args.extra_checks else None
    options = gr.Options(limits=limits, jobs=args.jobs, extra=extra, feedback_dir=args.feedback,
                         keep_dir=args.keep_runs)
    engine = None
    if args.dask:
        if importlib.util.find_spec("distributed") is None:
            raise ValueError("--dask needs Dask: pip install 'dask[distributed]'")
        from labsim.course.distributed import DaskEngine

        engine = DaskEngine(args.dask)
    box = sb.probe()
    for warning in box.warnings:
        print(f"labsim grade: warning: {warning}", file=sys.stderr)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # stop the runs as Ctrl-C does
    try:
        report = gr.grade(args.lab, args.submissions, options, box, engine=engine)
    except KeyboardInterrupt:
        print("labsim grade: interrupted; the running notebooks were stopped and no CSV was "
              "written", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        gr.write_csv(report, args.out)
        for kind in dict.fromkeys(args.lms):
            target = args.out.with_name(f"{args.out.stem}-{kind}.csv")
            nbk.write_atomic(target, lms_text(report, kind))
        if args.summary is not None:
            write_summary(report, args.summary)
    except OSError as exc:
        raise ValueError(f"cannot write the results: {exc.strerror or exc}") from None
    counts = {s: sum(r.status == s for r in report.results) for s in gr.STATUSES}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    print(f"graded {len(report.results)} submissions of {report.lab} in {report.wall_s:.1f} s "
          f"({summary}); wrote {args.out}")
    return 0
