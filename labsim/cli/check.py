"""Check a lab notebook: run it top to bottom in a fresh kernel and compare every check cell
with the line the release expects (``PASS <name>: k/k cases passed``), with
``pytest --nbval-lax``.  Exit code 0 when every check passes, 1 when one fails, 2 for bad
input.  Run All stops at the first unfinished exercise in Jupyter; this command runs every
cell and reports each check."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

from labsim.course import notebook as nbk


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("notebooks", nargs="+", type=Path, help="lab notebooks, labs/NN.ipynb")
    parser.add_argument("--timeout-cell", type=float, default=300.0,
                        help="seconds one cell may run (default 300)")


def run(args: argparse.Namespace) -> int:
    missing = [m for m in ("pytest", "nbval") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"checking needs {' and '.join(missing)}: pip install 'labsim[grade]'")
    if not 0 < args.timeout_cell < float("inf"):
        raise ValueError(f"--timeout-cell {args.timeout_cell}: give seconds > 0")
    for path in args.notebooks:
        nb = nbk.read(path) if path.is_file() else None
        if nb is None:
            raise ValueError(f"{path}: no such notebook")
        if not any(c.get("metadata", {}).get("labsim", {}).get("role") == "check"
                   for c in nb.cells):
            raise ValueError(f"{path}: no check cells; is it a lab from labs/?")
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "-p", "labsim.course._nbval_expected",
           "-p", "no:cacheprovider", "-q", "--no-header", "-rN",
           f"--nbval-cell-timeout={args.timeout_cell:g}", *map(str, args.notebooks)]
    return 0 if subprocess.run(cmd).returncode == 0 else 1
