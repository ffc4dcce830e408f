"""Watching a learner's function while it runs: what it dispatched and which references it called.

Two observers, combined by ``watch``:

- ``labsim.lab.profile.OpLog``, a ``TorchDispatchMode`` that sees every ATen and ``c10d``
  operator below ``__torch_function__`` (so ``torch._C.DisableTorchFunction()`` hides nothing);
- ``Tripwire``, a profile hook (``sys.setprofile`` and ``threading.setprofile``) that notes every
  call of a forbidden function -- labsim's own reference of an exercise, or a library shortcut
  such as ``torch.amp.GradScaler`` -- made from the learner's code.  It matches code objects,
  so a reference imported under another name, or fetched before the check started, is caught
  too.  A call counts when some frame between the check and the call is not trusted library
  code (labsim, the standard library, installed packages: the learner's notebook cells are
  not), unless the reference is called by code in its own file (a shell class such as
  ``Int8Linear`` calling a helper beside it).

Both run inside the learner's process: they catch a shortcut taken through a forbidden API,
not a learner who rewrites the observers themselves (the grader's review column names the tools
for that).  Observations travel to the grader as plain data, where the rules are applied.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings
from collections.abc import Sequence
from types import CodeType, FrameType, FunctionType
from typing import Any

import torch

from labsim.lab.profile import OpLog


def _prefixes() -> tuple[str, ...]:
    roots = {os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # labsim/
             os.path.dirname(os.path.abspath(torch.__file__)),
             sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots) + tuple(
        os.path.join(r, "") for r in roots)


def trusted(filename: str, prefixes: tuple[str, ...]) -> bool:
    """Whether code from ``filename`` is library code (not a notebook cell, not exec'd text)."""
    if filename.startswith("<frozen"):
        return True
    return filename.startswith(prefixes)


def _resolve(target: str) -> Any:
    module, _, qual = target.partition(":")
    with warnings.catch_warnings():  # importing a library to watch it should not warn
        warnings.simplefilter("ignore")
        obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _codes_of(obj: Any, owner: type | None = None) -> list[CodeType]:
    """The code objects a call of ``obj`` runs first; for a class, those of the methods and
    properties it defines itself (not helpers it shares with other classes, such as the
    functions of ``enum`` or ``dataclasses``)."""
    if isinstance(obj, property):
        return [c for f in (obj.fget, obj.fset, obj.fdel) if f is not None
                for c in _codes_of(f, owner)]
    if isinstance(obj, (staticmethod, classmethod)):
        return _codes_of(obj.__func__, owner)
    if isinstance(obj, FunctionType):
        if owner is not None and not obj.__qualname__.startswith(owner.__qualname__ + "."):
            return []
        code = obj.__code__
        if getattr(code, "co_qualname", code.co_name) != (
                obj.__qualname__ if hasattr(code, "co_qualname") else obj.__name__):
            # a decorator's wrapper (contextmanager's helper, functools.wraps): its code is
            # shared by every function so decorated; watch the function it wraps instead
            inner = getattr(obj, "__wrapped__", None)
            return _codes_of(inner) if isinstance(inner, FunctionType) else []
        return [code]
    if hasattr(obj, "__func__"):  # bound method
        return _codes_of(obj.__func__)
    wrapped = getattr(obj, "__wrapped__", None)  # numpy's dispatchers, other C wrappers
    if isinstance(wrapped, FunctionType) and not isinstance(obj, type):
        return _codes_of(wrapped)
    if isinstance(obj, type) and owner is None:
        return [c for v in vars(obj).values() for c in _codes_of(v, obj)]
    return []


def expand(target: str) -> list[str]:
    """``"module:*"`` -> every public function and class defined in ``module``."""
    module, _, qual = target.partition(":")
    if qual != "*":
        return [target]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = importlib.import_module(module)
    return [f"{module}:{name}" for name, obj in vars(mod).items()
            if not name.startswith("_") and isinstance(obj, (FunctionType, type))
            and getattr(obj, "__module__", None) == module]


def reference_codes(targets: Sequence[str]) -> dict[CodeType, str]:
    """Code object -> the name to report, for ``"module:qualname"`` targets (functions,
    classes -- every method they define --, methods and properties; ``"module:*"`` is every
    public function and class the module defines)."""
    codes: dict[CodeType, str] = {}
    for target, obj in _resolved(targets):
        for code in _codes_of(obj):
            codes.setdefault(code, target.replace(":", "."))
    return codes


def _resolved(targets: Sequence[str]) -> list[tuple[str, Any]]:
    """(target, object) for every target whose library is installed."""
    out = []
    for target in (t for raw in targets for t in expand(raw)):
        try:
            out.append((target, _resolve(target)))
        except ImportError:  # an optional library that is not installed: not a route
            continue
    return out


def passed_references(fns: Sequence[Any], targets: Sequence[str]) -> list[str]:
    """The forbidden targets among the functions handed to a check: the reference itself (or
    a class deriving from a forbidden class) passed where the learner's function belongs."""
    if not targets:
        return []
    codes = reference_codes(targets)
    classes = {id(obj): t.replace(":", ".") for t, obj in _resolved(targets)
               if isinstance(obj, type)}
    hits: list[str] = []
    for fn in fns:
        found = [codes[c] for c in _codes_of(fn) if c in codes]
        if isinstance(fn, type):
            found += [classes[id(k)] for k in fn.__mro__ if id(k) in classes]
        for name in found:
            if name not in hits:
                hits.append(name)
    return hits


class Tripwire:
    """Record calls of ``codes`` made from untrusted code while the block runs (see module).

    ``strict`` (graded runs): every call counts, whoever makes it -- in a graded run the
    references a check forbids are withheld, and those still present are tools another check
    hands to the learner, which nothing in this check's own code calls; a call of one made
    by library code (the driver calling a method of an object the learner's code built in
    another thread) is the learner's doing."""

    def __init__(self, codes: dict[CodeType, str], strict: bool = False,
                 threads: bool = False) -> None:
        self.codes = codes
        self.strict = strict
        self.threads = threads  # also note every thread started while the block runs
        self.threads_started: list[str] = []
        self._starters = _thread_starters() if threads else ()
        self.hits: list[str] = []
        self.prefixes = _prefixes()
        self._boundary: FrameType | None = None
        self._saved: tuple[Any, Any] = (None, None)

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and self._starters and any(arg is s for s in self._starters):
            # threading's own starts are noted per thread (_thread_hook, libraries' left
            # out); a direct _thread call, or torch's pool, is noted here
            if arg is self._starters[-1] or not trusted(frame.f_code.co_filename,
                                                        self.prefixes):
                self._started(getattr(arg, "__qualname__", "a thread"))
            return
        if event != "call":
            return
        name = self.codes.get(frame.f_code)
        if name is None:
            return
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename == frame.f_code.co_filename:
            return  # a reference helper called by its own module (a shell class, say)
        if self.strict and not any(f.f_code.co_filename.startswith("<frozen importlib")
                                   for f in _frames(caller, self._boundary)):
            if name not in self.hits:
                self.hits.append(name)
            return
        f = caller
        while f is not None and f is not self._boundary:
            filename = f.f_code.co_filename
            if filename.startswith("<frozen importlib"):
                return  # trusted code run by an import (a labsim module's own set-up)
            if not trusted(filename, self.prefixes):
                if name not in self.hits:
                    self.hits.append(name)
                return
            f = f.f_back

    def arm(self, boundary: FrameType | None) -> None:
        """Start watching; calls are attributed up to ``boundary`` (the frame that called the
        learner's function), not beyond."""
        self._boundary = boundary
        self._saved = (sys.getprofile(), threading.getprofile())
        if self.codes or self.threads:
            sys.setprofile(self._hook)
            threading.setprofile(self._thread_hook)

    def _started(self, what: str) -> None:
        if len(self.threads_started) < 10 and what not in self.threads_started:
            self.threads_started.append(what)

    def _thread_hook(self, frame: FrameType, event: str, arg: Any) -> None:
        """The first profile event of a thread started while armed (``threading``'s threads
        install it); a thread of a library (``LIBRARY_THREADS``) is not noted."""
        thread = threading.current_thread()
        if self.threads and not library_thread(thread):
            self._started(thread.name)
        sys.setprofile(self._hook if self.codes else None)
        self._hook(frame, event, arg)

    def disarm(self) -> None:
        if self.codes or self.threads:
            sys.setprofile(self._saved[0])
            threading.setprofile(self._saved[1])
        self._boundary = None  # the caller's frame: kept, it would hold its locals in a cycle


def _thread_starters() -> tuple[Any, ...]:
    """The builtins that start a thread without ``threading`` (``_thread``'s, and torch's
    ``torch.jit.fork``, which runs Python on its own pool)."""
    import _thread

    found = [getattr(_thread, n, None) for n in ("start_new_thread", "start_joinable_thread",
                                                  "start_new")]
    return (*(f for f in found if f is not None), torch._C.fork)  # torch's last


def _frames(frame: FrameType | None, boundary: FrameType | None) -> list[FrameType]:
    out = []
    while frame is not None and frame is not boundary:
        out.append(frame)
        frame = frame.f_back
    return out


class _FunctionNames(torch.overrides.TorchFunctionMode):
    """The names of the torch functions and methods called (``__torch_function__`` level);
    of those that hand data out of torch (``LEAVES_TORCH``), only the calls the learner's
    own code makes (torch's internals use them too)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.prefixes = _prefixes()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = getattr(func, "__name__", str(func))
        if name not in LEAVES_TORCH or not trusted(
                sys._getframe(1).f_code.co_filename, self.prefixes):
            self.names.add(name)
        return func(*args, **(kwargs or {}))


# Methods that hand a tensor's data to something other than torch (numpy, Python lists, raw
# pointers): a check whose rules read torch's operators cannot see what happens after them.
LEAVES_TORCH = frozenset({"numpy", "__array__", "tolist", "data_ptr", "untyped_storage",
                          "storage", "_typed_storage", "__dlpack__", "__array_wrap__"})
# CPU time other threads of the process may use while a learner's function runs (the kernel's
# own message threads use well under a millisecond); more is work done outside the function.
ELSEWHERE_ALLOWANCE_S = 0.02


OUTSIDE = "outside: "  # a ``references`` entry that is a rule broken outside the function


def outside_reason(obs: Any) -> str | None:
    """What ``watch`` saw happen outside the learner's function that breaks the rules every
    check holds: something the graded run's guard refused, a thread started or left running,
    work on other threads; None when nothing did."""
    refused = obs.get("refused")
    if refused:
        return (f"it tried {', '.join(map(str, list(refused)[:3]))}, which a graded run "
                "refuses to notebook code")
    started = obs.get("threads_started")
    if started:
        return (f"it started threads ({', '.join(map(str, list(started)[:3]))}): the check "
                "sees only your function's own thread, so do the work there")
    left = obs.get("threads_left")
    if left:
        return (f"it left threads running ({', '.join(map(str, list(left)[:3]))}): the check "
                "sees only your function's own thread, so do the work there (or join your "
                "threads before it returns)")
    elsewhere, own = obs.get("elsewhere_cpu_s"), obs.get("cpu_s", 0.0)
    if (isinstance(elsewhere, (int, float)) and isinstance(own, (int, float))
            and elsewhere > ELSEWHERE_ALLOWANCE_S + 0.05 * own):
        return (f"{elsewhere * 1e3:.0f} ms of CPU ran on other threads while it ran "
                f"({own * 1e3:.0f} ms on its own): the check sees only your function's own "
                "thread, so do the work there")
    return None


def _cpu_s() -> tuple[float, float]:
    """(CPU seconds of the whole process, of this thread): every thread, ended ones too."""
    import resource

    whole = resource.getrusage(resource.RUSAGE_SELF)
    mine = resource.getrusage(resource.RUSAGE_THREAD)
    return whole.ru_utime + whole.ru_stime, mine.ru_utime + mine.ru_stime


def _thread_cpu_s(native_id: int) -> float | None:
    """CPU seconds a thread of this process has run (``/proc/self/task/<id>/schedstat``, in
    nanoseconds); None where the file cannot be read (the thread ended, or not Linux)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _python_threads_cpu_s() -> dict[int, float] | None:
    """CPU seconds of every other Python thread that is not the kernel's or a library's, by
    native id; None when one cannot be read.  Native threads -- torch's OpenMP pool spinning
    after a parallel op, BLAS workers -- run no Python code, and are left out: work a learner
    hands to another thread runs on a Python thread."""
    me = threading.get_native_id()
    out: dict[int, float] = {}
    for t in threading.enumerate():
        native = getattr(t, "native_id", None)
        if native is None or native == me or library_thread(t):
            continue
        cpu = _thread_cpu_s(native)
        if cpu is None:
            return None
        out[native] = cpu
    return out


def _elsewhere_s(before: dict[int, float] | None, after: dict[int, float] | None,
                 whole_s: float, mine_s: float) -> float:
    """CPU the learner's other Python threads used between ``before`` and ``after``; where a
    thread could not be followed (it ended in between, no ``/proc``), every other thread of
    the process counts, native ones too (``whole_s - mine_s``)."""
    if before is None or after is None or any(n not in after for n in before):
        return max(0.0, whole_s - mine_s)
    return sum(max(0.0, cpu - before.get(n, 0.0)) for n, cpu in after.items())


# threads of the kernel and of libraries, which run no notebook code (by the module of the
# thread's class or of its target): ipykernel's, tqdm's monitor, a multiprocessing queue's
# feeder (a DataLoader's), the DataLoader's pin-memory thread
LIBRARY_THREADS = ("ipykernel.", "IPython.", "jupyter_client.", "zmq.", "tornado.", "tqdm.",
                   "multiprocessing.queues", "torch.utils.data.", "execnet.")


def library_thread(thread: threading.Thread) -> bool:
    """Whether ``thread`` belongs to the kernel or to a library (``LIBRARY_THREADS``)."""
    target = getattr(thread, "_target", None)
    owner = getattr(target, "__self__", None)
    modules = (type(thread).__module__, getattr(target, "__module__", None) or "",
               type(owner).__module__ if owner is not None else "")
    return any(m.startswith(LIBRARY_THREADS) for m in modules if m)


def _threads() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate()
            if t.ident is not None and not library_thread(t)}


class watch:  # noqa: N801 - used as a context manager, like a function
    """Run a block under the operator log (``ops``) and a tripwire on the ``forbid`` targets
    (``"module:qualname"``); ``summary()`` is what was seen, as plain data::

        with watch(["labsim.roofline:matmul_flops"]) as seen:
            value = learner_fn(*args)
        seen.summary()   # {"ops": {...}, "largest_new": ..., "references": [...], ...}

    It also notes what happened outside the block's own thread: the CPU time the other Python
    threads (not the kernel's or a library's; every thread where one cannot be followed) used
    meanwhile (``elsewhere``: on by default; off where a process
    group's communication threads work in the background), threads started and still running
    at the end, and operations the graded run's guard refused (``labsim.lab.guard``, also
    refused in threads).  While it runs, torch uses one thread of its own, and the guard
    refuses starting a process unless ``processes``.
    """

    def __init__(self, forbid: Sequence[str] = (), *, ops: bool = True,
                 keep_created: bool = False, functions: bool = False,
                 elsewhere: bool | None = None, processes: bool = False) -> None:
        from labsim.lab import guard

        self.wire = Tripwire(reference_codes(forbid), strict=guard.active() is not None,
                             threads=not processes)
        self.log = OpLog(keep_created=keep_created) if ops else None
        self.names = _FunctionNames() if functions else None
        if elsewhere is None:
            elsewhere = not (torch.distributed.is_available()
                             and torch.distributed.is_initialized())
        self.elsewhere = elsewhere
        self.processes = processes
        self._cpu0 = (0.0, 0.0)
        self._cpu1: tuple[float, float] | None = None  # None until the block ends
        self._threads_cpu0: dict[int, float] | None = None
        self._threads_cpu1: dict[int, float] | None = None
        self._threads0: dict[int, str] = {}
        self._left: list[str] = []
        self._refused: list[str] = []
        self._torch_threads = 0

    def __enter__(self) -> watch:
        from labsim.lab import guard

        guard_now = guard.active()
        self._refused0 = len(guard_now.refused) if guard_now is not None else 0
        self._watching = guard.watching(self.processes)
        self._watching.__enter__()
        self._threads0 = _threads()
        if self.elsewhere:
            self._torch_threads = torch.get_num_threads()
            torch.set_num_threads(1)
        if self.log is not None:
            self.log.__enter__()
        if self.names is not None:
            self.names.__enter__()
        self._cpu0 = _cpu_s()
        if self.elsewhere:
            self._threads_cpu0 = _python_threads_cpu_s()
        self.wire.arm(sys._getframe(1))
        return self

    def __exit__(self, *exc: object) -> None:
        self.wire.disarm()
        self._cpu1 = _cpu_s()
        if self.elsewhere:
            self._threads_cpu1 = _python_threads_cpu_s()
        if self.names is not None:
            self.names.__exit__(*exc)
        if self.log is not None:
            self.log.__exit__(*exc)
        if self.elsewhere:
            torch.set_num_threads(self._torch_threads)
        self._left = sorted(name for ident, name in _threads().items()
                            if ident not in self._threads0)
        self._watching.__exit__(*exc)
        from labsim.lab import guard

        guard_now = guard.active()
        if guard_now is not None:
            self._refused = list(dict.fromkeys(guard_now.refused[self._refused0:]))

    def summary(self) -> dict[str, Any]:
        out = self.log.summary() if self.log is not None else {}
        if self.names is not None:
            out["functions"] = sorted(self.names.names)
        out["references"] = list(self.wire.hits)
        if self.elsewhere:  # read now when asked from inside the block
            ended = self._cpu1 is not None
            end = self._cpu1 if ended else _cpu_s()
            threads_end = self._threads_cpu1 if ended else _python_threads_cpu_s()
            whole = end[0] - self._cpu0[0]
            mine = end[1] - self._cpu0[1]
            out["cpu_s"] = round(mine, 6)
            out["elsewhere_cpu_s"] = round(
                _elsewhere_s(self._threads_cpu0, threads_end, whole, mine), 6)
        if self._left:
            out["threads_left"] = self._left[:10]
        if self.wire.threads_started:
            out["threads_started"] = list(self.wire.threads_started)
        if self._refused:
            out["refused"] = self._refused[:10]
        reason = outside_reason(out)
        if reason is not None:  # carried with the references by every driver, workers' too
            out["references"].append(OUTSIDE + reason)
        return out
