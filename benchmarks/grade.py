"""Measure ``labsim grade``: wall time to grade N submissions of one lab with --jobs J.

    PYTHONPATH=$PWD python benchmarks/grade.py                      # the tests' tiny lab
    PYTHONPATH=$PWD python benchmarks/grade.py --lab labs/02_x.ipynb --solution solutions/02_x.ipynb

Submissions alternate between the solution (every check passes: the whole notebook runs) and
the released stub (every check fails), so both paths are timed.  Prints the wall time, the
mean time per run, statuses and the largest resident memory of any child process.
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", type=Path, help="released lab (default: the tests' tiny lab)")
    parser.add_argument("--solution", type=Path, help="its solution notebook")
    parser.add_argument("-n", type=int, default=50, help="submissions (default 50)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout-cell", type=float, default=120)
    parser.add_argument("--timeout-notebook", type=float, default=600)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-grade-"))
    try:
        if args.lab is None:
            import gradelab

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
            shutil.copyfile(solution if i % 2 == 0 else lab, path)
            subs.append(path)
        box = sb.probe()
        limits = sb.Limits(args.timeout_cell, args.timeout_notebook)
        start = time.monotonic()
        report = gr.grade(lab, subs, gr.Options(limits=limits, jobs=args.jobs), box)
        wall = time.monotonic() - start
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    runs = [r.wall_s for r in report.results]
    statuses = {s: sum(r.status == s for r in report.results) for s in gr.STATUSES}
    full = sum(r.total == r.maximum for r in report.results)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    extra = (f" cgroup={getattr(box, 'cgroup', '') or 'none'} uid="
             f"{getattr(box, 'drop_uid', None)}" if hasattr(box, "cgroup") else "")
    print(f"lab {report.lab}: {args.n} submissions, --jobs {args.jobs}, sandbox "
          f"namespaces={box.namespaces} prlimit={box.prlimit}{extra}")
    print(f"wall time      {wall:8.1f} s")
    print(f"per run (mean) {sum(runs) / len(runs):8.2f} s   (min {min(runs):.2f}, "
          f"max {max(runs):.2f})")
    print(f"statuses       {', '.join(f'{n} {s}' for s, n in statuses.items() if n)}; "
          f"{full} with full marks")
    print(f"peak child RSS {peak:8.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
