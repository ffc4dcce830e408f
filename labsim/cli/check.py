"""Check a lab notebook the way the grader will: run it in a fresh kernel against the graded
copy of labsim (the lab's references withheld), judge every check with the grader's own
comparisons, and print one line per check (PASS, FAIL with the first failing case, TODO for an
exercise not started) and what to do next.  Saved outputs in the notebook are never read.
Exit code 0 when every check passes, 1 when one does not, 2 for bad input.

The notebook is a path, or a file name or lab number found in the current folder or a
``labs/`` folder above it: ``labsim check 00`` in JupyterLab's terminal (which opens in
``labs/``) or at the repository's root."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("notebooks", nargs="+",
                        help="lab notebooks: labs/00_why_gpus.ipynb, 00_why_gpus.ipynb or 00")
    parser.add_argument("--timeout-cell", type=float, default=300.0,
                        help="seconds one cell may run (default 300)")
    parser.add_argument("--lab", type=Path,
                        help="the released lab to grade against (default: the copy of the "
                             "course's lab the package keeps)")
    parser.add_argument("--verbose", action="store_true",
                        help="also print where the run's log is kept (nbval's output, cell by "
                             "cell)")


def run(args: argparse.Namespace) -> int:
    missing = [m for m in ("pytest", "nbval") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"checking needs {' and '.join(missing)}: pip install 'labsim[grade]'")
    if not 0 < args.timeout_cell < float("inf"):
        raise ValueError(f"--timeout-cell {args.timeout_cell}: give seconds > 0")
    from labsim.course import notebook as nbk
    from labsim.course import selfcheck

    paths = [selfcheck.find_notebook(n) for n in args.notebooks]
    if args.lab is not None and not args.lab.is_file():
        raise ValueError(f"--lab {args.lab}: no such file")
    for path in paths:
        try:
            nb = nbk.read(path)
        except nbk.NotebookError as exc:
            raise ValueError(str(exc)) from None
        if args.lab is None:
            selfcheck.find_release(path, nb)
    ok = True
    for path in paths:
        keep = None
        if args.verbose:
            import tempfile

            keep = Path(tempfile.mkdtemp(prefix="labsim-check-"))
        print(f"checking {path} as the grader will (a fresh kernel runs it top to bottom)...",
              flush=True)
        result = selfcheck.run(path, timeout_cell=args.timeout_cell, keep=keep,
                               release=args.lab)
        for line in result.lines():
            print(f"  {line}" if not line[:1].isdigit() else line)
        print(f"({result.wall_s:.0f} s)")
        if keep is not None:
            print(f"the run's files (graded notebook, nbval's log): {keep}")
        ok = ok and result.ok
        sys.stdout.flush()
    return 0 if ok else 1
