"""Measure ``labsim grade``: how fast a class is graded, how much memory the grader itself
holds, and whether correct work keeps its marks on a busy machine.

    PYTHONPATH=$PWD python benchmarks/grade.py                      # the tests' tiny lab
    PYTHONPATH=$PWD python benchmarks/grade.py --lab labs/00_why_gpus.ipynb \\
        --solution solutions/00_why_gpus.ipynb -n 50 --load 8      # lab 00, load >= 8
    PYTHONPATH=$PWD python benchmarks/grade.py --hostile 4          # results built to hurt
    PYTHONPATH=$PWD python benchmarks/grade.py --dask local:2       # on a local Dask cluster

``-n`` copies of the solution are graded (``--mix``: every other one the released stub), with
``--load N`` processes spinning on the CPU meanwhile (the load average is printed), and
``--hostile K`` more submissions whose functions return results built to exhaust a decoder
(millions of nested lists).  Prints the wall time, submissions per minute per core, how many
copies of the solution kept full marks, the grader's own peak memory (this process: it never
decodes a learner's results) and the judging and sandbox processes' peak.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

from labsim.course import grade as gr  # noqa: E402
from labsim.course import sandbox as sb  # noqa: E402

# The collector's own writer replaced (a module attribute: nothing stops that) by one that
# leaves 32 MiB of "[],[],..." as the check's results -- the file the grader then decodes.
HOSTILE_ADD = '''import labsim.checks._collect as _c
def _flood(path, value):
    path.with_suffix(".json").write_text("[" + "[]," * (11 * 2**20) + "[]]")
    path.with_suffix(".bin").write_bytes(b"")
_c.write_plain = _flood
def add(a, b):
    return a + b
'''


def _spin(stop: mp.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", type=Path, help="released lab (default: the tests' tiny lab)")
    parser.add_argument("--solution", type=Path, help="its solution notebook")
    parser.add_argument("-n", type=int, default=20, help="copies of the solution (default 20)")
    parser.add_argument("--mix", action="store_true", help="every other copy the stub")
    parser.add_argument("--hostile", type=int, default=0,
                        help="submissions returning results built to exhaust a decoder "
                             "(the tiny lab only)")
    parser.add_argument("--load", type=int, default=0, help="CPU-bound processes meanwhile")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--dask", help="grade on this Dask cluster (local:N, or an address)")
    parser.add_argument("--timeout-cell", type=float, default=300)
    parser.add_argument("--timeout-notebook", type=float, default=1200)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-grade-"))
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.load)]
    try:
        import gradelab

        if args.lab is None:
            lab = gradelab.release_lab(tmp)
            solution = gradelab.submission(lab, tmp / "solution.ipynb", **gradelab.SOLUTIONS)
        else:
            if args.solution is None:
                parser.error("--solution is needed with --lab")
            lab, solution = args.lab, args.solution
        subs = []
        for i in range(args.n):
            path = tmp / "subs" / f"learner{i:03d}.ipynb"
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(lab if args.mix and i % 2 else solution, path)
            subs.append(path)
        for i in range(args.hostile):
            subs.append(gradelab.submission(lab, tmp / "subs" / f"hostile{i:03d}.ipynb",
                                            add=HOSTILE_ADD))
        for p in spinners:
            p.start()
        box = sb.probe()
        limits = sb.Limits(args.timeout_cell, args.timeout_notebook)
        engine = None
        if args.dask:
            from labsim.course.distributed import DaskEngine

            engine = DaskEngine(args.dask)
        start = time.monotonic()
        report = gr.grade(lab, subs, gr.Options(limits=limits, jobs=args.jobs), box,
                          engine=engine)
        wall = time.monotonic() - start
        load = os.getloadavg()
    finally:
        stop.set()
        for p in spinners:
            p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)
    results = report.results
    copies = [r for r in results if Path(r.submission).stem.startswith("learner")]
    solutions = [r for i, r in enumerate(copies) if not (args.mix and i % 2)]
    full = sum(r.total == r.maximum for r in solutions)
    hostile = [r for r in results if Path(r.submission).stem.startswith("hostile")]
    statuses = {s: sum(r.status == s for r in results) for s in gr.STATUSES}
    cores = os.cpu_count() or 1
    mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"lab {report.lab}: {len(results)} submissions, --jobs {args.jobs}"
          f"{', --dask ' + args.dask if args.dask else ''}, {cores} cores, sandbox "
          f"namespaces={box.namespaces} prlimit={box.prlimit} cgroup={box.cgroup or 'none'}")
    print(f"load average   {load[0]:.1f} (1 min) with {args.load} spinning processes")
    print(f"wall time      {wall:8.1f} s; {len(results) / (wall / 60) / cores:.2f} "
          f"submissions per minute per core")
    print(f"solutions      {full} of {len(solutions)} with full marks")
    if hostile:
        refused = sum("could not be read" in s.detail for r in hostile for s in r.scores[:1])
        print(f"hostile        {len(hostile)}: add refused with a reason in {refused}")
    print(f"statuses       {', '.join(f'{n} {s}' for s, n in statuses.items() if n)}")
    print(f"grader RSS     {mine:8.0f} MiB peak (this process)")
    print(f"children RSS   {children:8.0f} MiB peak (largest judging or sandbox process)")
    return 0 if full == len(solutions) else 1


if __name__ == "__main__":
    sys.exit(main())
