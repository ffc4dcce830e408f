"""The learner's side of a graded run: run each check's driver on the grader's inputs and write
what the learner's functions did, as plain data, for the grader to judge.

``labsim grade`` replaces every check cell of the graded notebook by ``collect(i, fn, ...)``
and starts the kernel with ``install()`` (an IPython startup file).  The run folder
(``$LABSIM_GRADE_DIR``) holds ``in/`` -- ``checks.json`` (per check: the driver, the functions
it takes, the references it forbids) and ``kernel.json`` --, ``live/``, where the check's
inputs (``check-<i>.json``/``.bin``: the cases' names and inputs, never their expected values)
appear only while its collector runs, and ``out/``, where ``collect`` writes
``check-<i>.json``/``.bin`` (one ``Outcome`` per case).

``install`` names the code of the release's own cells ``<released SHA-256>`` (the guard of
``labsim.lab.guard`` trusts it; the learner's cells are ``<notebook cell N>``), notes the
kernel's own threads, and arms the reference tripwire while each exercise cell runs
(``exercise_hashes``), recording in ``out/exercises.json`` any reference an exercise cell
calls at definition time.  A check runs only when the notebook has no threads or processes
of its own still running (``busy``): what runs beside the learner's function is not seen.

Everything here runs inside the learner's process, so it can be tampered with; what it writes
is only the learner's claim, which the grader judges against expectations it keeps to itself.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from labsim.checks import _plain
from labsim.checks._core import Case, Spec, call_each
from labsim.checks._observe import Tripwire, library_thread, reference_codes, watch

DIR_ENV = "LABSIM_GRADE_DIR"


def _folder() -> Path:
    return Path(os.environ[DIR_ENV])


def _resolve(path: str) -> Any:
    import importlib

    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def driver_spec(entry: dict[str, Any]) -> Spec:
    """The ``Spec`` whose driver runs a check's cases: the public check named by
    ``entry["driver"]``, or the default (call the function on each case's inputs)."""
    forbid = tuple(entry.get("forbid", ()))
    if entry.get("driver"):
        spec = _resolve(entry["driver"])
        if not isinstance(spec, Spec):
            raise TypeError(f"{entry['driver']} is not a check")
        return Spec(spec.title, lambda: [], drive=spec.drive, forbid=spec.forbid + forbid,
                    functions=spec.functions, ops=spec.ops, names=spec.names,
                    torch_only=spec.torch_only, processes=spec.processes,
                    case_seconds=spec.case_seconds)
    return Spec(str(entry.get("title", "check")), lambda: [], drive=call_each, forbid=forbid,
                functions=int(entry.get("functions", 1)))


def read_cases(folder: Path, stem: str) -> list[Case]:
    """The cases (name, args, kwargs) of a check, which the run's nbval puts in ``live/``
    while the check's collector runs."""
    raw = _plain.decode((folder / "live" / f"{stem}.json").read_bytes(),
                        (folder / "live" / f"{stem}.bin").read_bytes())
    return [Case(str(name), tuple(args), dict(kwargs)) for name, args, kwargs in raw]




def busy(baseline: set[int]) -> str:
    """"" when nothing of the notebook's own runs beside a check, else what does: threads
    started since the kernel began (``baseline``: the kernel's own) and child processes other
    than labsim's launcher."""
    import threading

    mine = threading.get_ident()
    threads = [t.name for t in threading.enumerate()
               if t.ident not in baseline and t.ident != mine and not library_thread(t)]
    if threads:
        return (f"the notebook still has threads running ({', '.join(threads[:3])}); a check "
                "runs your functions alone, so shut them down first (e.g. pool.shutdown())")
    children = []
    for pid, cmdline in _children(os.getpid()):
        if "labsim.lab.zygote" not in cmdline:
            children.append(f"{pid} {cmdline[:40]}")
    if children:
        return (f"the notebook still has processes running ({'; '.join(children[:3])}); a "
                "check runs your functions alone, so end them first (e.g. pool.terminate())")
    return ""


def _children(pid: int) -> list[tuple[int, str]]:
    out = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
                continue
            if stat.rsplit(")", 1)[1].split()[0] == "Z":  # ended, not yet reaped
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                "utf-8", "replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        out.append((int(entry.name), cmd))
    return out


def write_plain(path: Path, value: Any) -> None:
    """Write ``value`` as plain data at ``path`` (.json) and beside it (.bin), atomically."""
    text, blob = _plain.encode(value)
    for suffix, data in ((".bin", blob), (".json", text.encode())):
        tmp = path.with_suffix(suffix + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path.with_suffix(suffix))


def collect(index: int, *fns: Callable[..., Any]) -> None:
    """Run check ``index``'s driver on the grader's inputs with the learner's ``fns`` and
    write the outcomes to ``out/check-<index>``."""
    from labsim.checks._core import Outcome
    from labsim.lab import guard

    folder = _folder()
    entry = json.loads((folder / "in" / "checks.json").read_text())[index]
    cases = read_cases(folder, f"check-{index}")
    active = guard.active()
    problem = busy(getattr(active, "baseline_threads", set()))
    if problem:
        outcomes = [Outcome(None, "NotebookBusy", ("NotebookBusy",), problem)] * len(cases)
    else:
        outcomes = driver_spec(entry).run(fns, cases)
    write_plain(folder / "out" / f"check-{index}.json",
                {"index": index, "outcomes": [o.to_plain() for o in outcomes]})


def name_cells(shell: Any, released: set[str]) -> None:
    """Name each cell's code ``<released SHA-256>`` when its source is one of the release's
    cells (``released``: their SHA-256), else ``<notebook cell N>`` (IPython's compiler)."""
    compiler = getattr(shell, "compile", None)
    if compiler is None or not hasattr(compiler, "get_code_name"):
        return

    def get_code_name(raw_code: str, transformed_code: str, number: int) -> str:
        digest = hashlib.sha256(raw_code.encode()).hexdigest()
        if digest in released:
            return f"<released {digest}>"
        return f"<notebook cell {number}>"

    compiler.get_code_name = get_code_name


def install(shell: Any = None) -> None:
    """Prepare the graded kernel (see the module docstring)."""
    import threading

    from labsim.lab import guard

    folder = _folder()
    config = json.loads((folder / "in" / "kernel.json").read_text())
    active = guard.active() or guard.install()
    active.baseline_threads = {t.ident for t in threading.enumerate()}
    if shell is not None:
        name_cells(shell, set(config.get("released", [])))
    try:  # tqdm's monitor thread would outlive a story cell's progress bar
        import tqdm.std

        tqdm.std.tqdm.monitor_interval = 0
    except ImportError:  # pragma: no cover - tqdm is a dependency
        pass
    hashes = set(config.get("exercise_hashes", []))
    codes = reference_codes(config.get("forbid", []))
    if shell is None or not hashes:
        return
    hits: list[list[Any]] = []
    state: dict[str, Any] = {}

    def pre(info: Any) -> None:
        digest = hashlib.sha256(str(getattr(info, "raw_cell", "")).encode()).hexdigest()
        if digest in hashes:
            wire = Tripwire(codes)
            wire.arm(None)
            state["wire"], state["digest"] = wire, digest
            state["refused"] = len(active.refused)

    def post(result: Any) -> None:
        wire = state.pop("wire", None)
        if wire is None:
            return
        wire.disarm()
        refused = [f"refused: {r}" for r in active.refused[state.pop("refused", 0):]]
        if wire.hits or refused:
            hits.append([state["digest"], [*wire.hits, *dict.fromkeys(refused)]])
            write_plain(folder / "out" / "exercises.json", hits)

    shell.events.register("pre_run_cell", pre)
    shell.events.register("post_run_cell", post)


__all__ = ["DIR_ENV", "busy", "collect", "driver_spec", "install", "name_cells", "read_cases",
           "watch", "write_plain"]
