"""The ``labsim`` command line.  Each sub-command lives in its own module of this package
with ``add_arguments(parser)`` and ``run(args) -> int``; exit code 2 means bad input.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module in this package, named by its topic; one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "check": ("check", "run a lab notebook and compare each check with the line it must "
                       "print (pytest --nbval-lax)"),
    "collective": ("collectives", "simulate one collective: time, algbw, busbw, trace"),
    "grade": ("grade", "grade submitted notebooks of one lab: CSV of scores + feedback per "
                       "learner"),
    "hardware": ("hardware", "list the hardware catalog"),
    "plan": ("plan", "rank the parallel plans of a training run (layout, memory, time, cost); "
                     "table + CSV"),
    "release": ("release", "regenerate labs/ from solutions/ (--check: fail if stale)"),
    "simulate": ("step", "simulate one training step from a TOML/JSON config; print a summary"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="labsim",
        description="The GPU training-acceleration lab: simulator and course tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f"labsim.cli.{module_name}")
        except ModuleNotFoundError as exc:  # a course tool whose extra is not installed
            p = sub.add_parser(name, help=help_text, add_help=False, prefix_chars="\0")
            p.add_argument("rest", nargs=argparse.REMAINDER)
            p.set_defaults(_run=_needs_extra(name, exc.name or "a dependency"))
            continue
        p = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _needs_extra(command: str, missing: str):  # noqa: ANN202 - a sub-command's run()
    def run(args: argparse.Namespace) -> int:
        raise ValueError(f"`labsim {command}` needs {missing}, which is not installed: "
                         f"pip install 'labsim[grade]'")
    return run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except ValueError as exc:  # bad input: a clear message and exit code 2
        print(f"labsim {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
