"""The process guard of graded runs: an audit hook (PEP 578) that notebook code cannot remove.

``labsim grade`` and ``labsim check`` start every Python process of a run (the kernel, the
workers of multi-process checks, nbval) with ``install()`` already done (a ``sitecustomize``
module of the graded copy).  An audit hook sees every audited operation of its process, on
every thread, and cannot be taken out again; this one refuses, when notebook code calls
them itself (the innermost Python frame is a notebook cell or text it ``exec``'d, not
library code):

- the tools that reach objects and code the checks rely on: ``ctypes`` (foreign calls and
  raw memory), ``gc.get_objects``/``get_referrers``/``get_referents``, building code or
  function objects (``code.replace``, ``types.FunctionType``), reading or assigning a
  function's ``__code__``, frames reached through tracebacks and generators;
- running text as code: ``compile``, ``exec`` and ``eval`` of a string;
- ``sys.settrace``, ``sys.setprofile``, ``sys.addaudithook``, ``sys._current_frames``;
- reading labsim's own source files (``.py``) for notebook code -- directly or through
  ``inspect`` or ``linecache`` -- where the import system does not (the exercise references
  a graded copy still holds, tools one exercise hands the learner, keep their source text to
  themselves; importing them is unchanged);

and, while a check is watching a learner's function (``watching()``), starting a process
from anywhere under that function (``os.fork``, ``subprocess``, ``os.posix_spawn``,
``os.system``, ``exec*``) unless the check allows it.  Refused operations raise
``GuardError`` in the notebook's code, naming what was refused.

What it does not do: it does not see operations that raise no audit event (assigning a
module attribute, reading a closure, walking ``frame.f_back``); code that deliberately
rewrites labsim's own objects in memory is named in the grader's review column, not stopped.

Trusted code is code whose file lies under the Python installation, the environment's
packages or labsim, and the lab's released cells (the graded kernel names their code
``<released SHA-256>``); notebook cells and ``exec``'d text are not.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_THIS_FILE = __file__
_CTYPES_DIR = os.path.join(os.path.dirname(os.__file__), "ctypes", "")
ENV = "LABSIM_GUARD"  # set in a graded run's environment: install() at interpreter start
RELEASED_PREFIX = "<released "

ALWAYS = frozenset({
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "code.__new__",
    "function.__new__", "sys.settrace", "sys.setprofile", "sys.addaudithook",
    "sys._current_frames", "compile", "exec", "marshal.loads", "marshal.load",
})
CTYPES = "ctypes."
ATTRIBUTES = frozenset({"__code__", "tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_code"})
PROCESS = frozenset({
    "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
    "subprocess.Popen", "pty.spawn", "os.startfile",
})
WATCHED = ALWAYS | PROCESS | {"object.__getattr__", "object.__setattr__", "open"}
PREFIXES = (CTYPES, "os.exec", "os.spawn")


class GuardError(PermissionError):
    """An operation the graded run does not allow to notebook code."""


def trusted_prefixes() -> tuple[str, ...]:
    """Folders whose code is library code: the Python installation, the environment's
    packages and labsim (as installed and as the real path; found from this file, so the
    guard installs before labsim is imported)."""
    roots = {os.path.dirname(os.path.dirname(os.path.abspath(_THIS_FILE))),
             sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             *(sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib",
                                                           "purelib", "platlib"))}
    roots.discard("")
    out = {os.path.join(r, "") for r in roots}
    out |= {os.path.join(os.path.realpath(r), "") for r in roots}
    return tuple(sorted(out))


class _State(threading.local):
    """Per-thread: whether a check is watching a learner's function on this thread."""

    def __init__(self) -> None:
        self.watching = 0
        self.processes_allowed = False
        self.inside = False  # the hook is running (its own frame reads raise events too)


class Guard:
    """The hook and what it needs; ``install()`` makes one and adds its hook."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes
        self.state = _State()
        self.refused: list[str] = []
        self.baseline_threads: set[int] = set()  # a graded kernel's own threads
        self.labsim_dir = os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(_THIS_FILE))), "")
        self._getframe = sys._getframe

    def trusted(self, filename: str) -> bool:
        return (filename.startswith(self.prefixes) or filename.startswith("<frozen")
                or filename.startswith(RELEASED_PREFIX))

    def _trigger(self, skip: str = "") -> Any:
        """The innermost Python frame outside this module (and outside the folder ``skip``):
        the code whose call raised the event."""
        frame = self._getframe(1)
        while frame is not None and (frame.f_code.co_filename == _THIS_FILE or (
                skip and frame.f_code.co_filename.startswith(skip))):
            frame = frame.f_back
        return frame

    def _caller_untrusted(self, skip: str = "") -> bool:
        """Whether the innermost Python frame (below the hook and ``skip``) is notebook
        code."""
        frame = self._trigger(skip)
        return frame is not None and not self.trusted(frame.f_code.co_filename)

    def _any_untrusted(self) -> bool:
        frame = self._trigger()
        while frame is not None:
            if not self.trusted(frame.f_code.co_filename):
                return True
            frame = frame.f_back
        return False

    def _reads_labsim_source(self, args: tuple) -> bool:
        """An ``open`` of one of labsim's ``.py`` files for reading, not by the import
        system (whose reads come from ``<frozen importlib...>``)."""
        path = args[0] if args else None
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str) or not path.endswith(".py"):
            return False
        mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
        if any(c in mode for c in "wax+"):
            return False
        if not os.path.abspath(path).startswith(self.labsim_dir):
            return False
        frame = self._trigger()
        return not (frame is not None and frame.f_code.co_filename.startswith(
            "<frozen importlib"))

    def refuse(self, what: str) -> None:
        if len(self.refused) < 100:
            self.refused.append(what)
        raise GuardError(f"{what} is not available to notebook code while it is graded")

    def hook(self, event: str, args: tuple) -> None:
        if not (event in WATCHED or event.startswith(PREFIXES)):
            return
        state = self.state
        if state.inside:
            return
        state.inside = True
        try:
            self._check(event, args)
        finally:
            state.inside = False

    def _check(self, event: str, args: tuple) -> None:
        if event in ALWAYS:
            if event in ("exec", "compile") and not _is_text(event, args):
                return
            if self._caller_untrusted():
                self.refuse(_describe(event))
        elif event.startswith(CTYPES):  # ctypes' own classes make the calls: look past them
            if self._caller_untrusted(_CTYPES_DIR):
                self.refuse("ctypes")
        elif event == "open":
            if self._reads_labsim_source(args) and self._any_untrusted():
                self.refuse("reading labsim's source files")
        elif event == "object.__getattr__" or event == "object.__setattr__":
            if len(args) > 1 and args[1] in ATTRIBUTES and self._caller_untrusted():
                self.refuse(f"the attribute {args[1]}")
        else:  # starting a process
            state = self.state
            if state.watching and not state.processes_allowed and self._any_untrusted():
                self.refuse("starting a process while a check runs your function")


def _is_text(event: str, args: tuple) -> bool:
    """compile() always takes text (or an AST); exec() counts only when given text."""
    if event == "compile":
        return True
    return bool(args) and isinstance(args[0], (str, bytes))


def _describe(event: str) -> str:
    return {"compile": "compile()", "exec": "exec() or eval() of text",
            "code.__new__": "building code objects", "function.__new__":
            "building function objects"}.get(event, event)


# The process's guard.  An audit hook is process-wide and permanent by design (PEP 578), so
# the one object that answers for it is too: this list holds it, nothing else is kept here.
_GUARD: list[Guard] = []


def install() -> Guard:
    """Add the guard's audit hook to this process (once; it cannot be removed)."""
    if _GUARD:
        return _GUARD[0]
    guard = Guard(trusted_prefixes())
    _GUARD.append(guard)
    sys.addaudithook(guard.hook)
    return guard


def active() -> Guard | None:
    """This process's guard, if a graded run installed one."""
    return _GUARD[0] if _GUARD else None


@contextmanager
def watching(processes: bool = False) -> Iterator[None]:
    """Mark this thread as running a learner's function under a check (see the module);
    ``processes``: the check allows starting processes (a DataLoader's workers)."""
    guard = active()
    if guard is None:
        yield
        return
    state = guard.state
    saved = state.watching, state.processes_allowed
    state.watching, state.processes_allowed = saved[0] + 1, processes or saved[1]
    try:
        yield
    finally:
        state.watching, state.processes_allowed = saved


__all__ = ["ENV", "Guard", "GuardError", "active", "install", "trusted_prefixes", "watching"]
