"""What every simulator command shares: one-line errors, never a traceback, atomic output.

``guarded(run)`` wraps a command's ``run(args)``: a ``ValueError`` (bad input) or an
``OSError`` (a file that cannot be read or written) prints ``labsim COMMAND: error: ...`` on
one line and returns 2; ``MemoryError`` and any other exception print one line and return 1;
Ctrl-C returns 130.  ``write_atomic(path, text)`` writes a file whole or not at all (a
temporary file beside it, then ``os.replace``), after checking the folder exists.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from functools import wraps
from pathlib import Path


def guarded(command: str) -> Callable[[Callable[[argparse.Namespace], int]],
                                      Callable[[argparse.Namespace], int]]:
    """Decorate a ``run(args)`` so that no exception escapes as a traceback."""
    def wrap(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @wraps(run)
        def inner(args: argparse.Namespace) -> int:
            try:
                return int(run(args) or 0)
            except (ValueError, OSError) as exc:
                _say(command, f"error: {_one_line(exc)}")
                return 2
            except MemoryError:
                _say(command, "error: out of memory; use a smaller cluster, model or message")
                return 1
            except KeyboardInterrupt:
                _say(command, "interrupted")
                return 130
            except Exception as exc:  # noqa: BLE001 - a user never sees a traceback
                _say(command, f"internal error ({type(exc).__name__}): {_one_line(exc)}; "
                     "please report it")
                return 1
        return inner
    return wrap


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    # the library names Python arguments; on the command line they are options
    text = text.replace("pass protocol='alpha-beta'", "pass --protocol alpha-beta")
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text = f"{exc.filename}: {text}"
    return text[:500]


def _say(command: str, text: str) -> None:
    print(f"labsim {command}: {text}", file=sys.stderr)


def output_path(path: str | os.PathLike) -> Path:
    """``path`` as a ``Path`` whose folder exists (ValueError naming it otherwise)."""
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"cannot write {p}: folder {folder} does not exist; create it first")
    if p.is_dir():
        raise ValueError(f"cannot write {p}: it is a folder; give a file name")
    return p


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all."""
    p = output_path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
