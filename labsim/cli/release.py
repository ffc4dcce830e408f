"""Regenerate labs/ from solutions/: execute each solution, keep its check outputs, stub out
the solution blocks.  With --check, change nothing and exit 1 naming every stale lab."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from labsim.course import release as rel
from labsim.course.notebook import NotebookError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "names", nargs="*", help="labs to release, e.g. 00 or 00_roofline (default: all)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if labs/ differs from a fresh release",
    )
    parser.add_argument("--solutions", type=Path, default=Path("solutions"))
    parser.add_argument("--labs", type=Path, default=Path("labs"))
    parser.add_argument(
        "--no-execute",
        action="store_true",
        help="reuse the check outputs stored in solutions/ instead of running",
    )
    parser.add_argument("--jobs", type=int, default=1, help="notebooks executed at once")


def _package_copy(labs: Path) -> Path | None:
    """The package's copy of the labs (``labsim/data/labs``), when ``labs`` is the course's
    own ``labs/`` beside the package (an editable install of this repository)."""
    from labsim.course.selfcheck import package_labs

    copy = package_labs()
    if labs.resolve() == copy.parent.parent.parent / "labs":
        return copy
    return None


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.jobs <= 64:
        raise ValueError(f"--jobs {args.jobs}: give a whole number from 1 to 64")
    package = _package_copy(args.labs)
    try:
        if args.check:
            outcomes = rel.check(args.solutions, args.labs, args.names, package)
        else:
            outcomes = rel.release(
                args.solutions, args.labs, args.names, run=not args.no_execute, jobs=args.jobs,
                package_dir=package)
    except NotebookError as exc:
        print(f"labsim release: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        stale = [o for o in outcomes if o.changed]
        for o in stale:
            print(f"stale: {o.name}: {o.reason}; run `labsim release {o.name}`")
        if not stale:
            print(f"labs/ is up to date ({len(outcomes)} labs)")
        return 1 if stale else 0
    for o in outcomes:
        print(f"{'wrote' if o.changed else 'unchanged'} {o.lab_path}")
    return 0
