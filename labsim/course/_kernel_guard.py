"""Loaded at the start of every kernel ``labsim grade`` runs (an IPython startup file).

It caps what one cell may print: past ``limit_chars`` characters per stream and cell, output
is dropped and one line says so.  A notebook that prints 100 MB then costs the kernel a string
slice instead of shipping 100 MB to the grader.  Check cells print one short line, so they are
never affected.  The guard lives in the learner's kernel, which can undo it; that only slows
its own run, which the time limits bound.
"""

from __future__ import annotations

import sys
from typing import Any

NOTE = "\n[output cut by the grader: more than {limit} characters in one cell]\n"


def _cap(stream: Any, limit_chars: int, counts: dict) -> None:
    original = stream.write
    key = id(stream)

    def write(text: str) -> int:
        used = counts.get(key, 0)
        if used >= limit_chars:
            return len(text)
        counts[key] = used + len(text)
        if used + len(text) <= limit_chars:
            return original(text)
        original(text[: limit_chars - used] + NOTE.format(limit=limit_chars))
        return len(text)

    stream.write = write


def install(limit_chars: int = 1_000_000) -> None:
    """Cap stdout and stderr per cell (counts reset before each cell runs)."""
    counts: dict = {}
    for stream in (sys.stdout, sys.stderr):
        _cap(stream, limit_chars, counts)
    try:
        ip = get_ipython()  # type: ignore[name-defined]  # noqa: F821
    except NameError:
        return
    ip.events.register("pre_run_cell", lambda *_: counts.clear())
