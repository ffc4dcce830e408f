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
        module = importlib.import_module(f"labsim.cli.{module_name}")
        p = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


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
