"""The learner's side of a graded run: run each check's driver on the grader's inputs and write
what the learner's functions did, as plain data, for the grader to judge.

``labsim grade`` replaces every check cell of the graded notebook by ``collect(i, fn, ...)``
and starts the kernel with ``install()`` (an IPython startup file).  The run folder
(``$LABSIM_GRADE_DIR``) holds ``in/`` -- ``checks.json`` (per check: the driver, the functions
it takes, the references it forbids) and ``check-<i>.json``/``.bin`` (the cases' names and
inputs, never their expected values) -- and ``out/``, where ``collect`` writes
``check-<i>.json``/``.bin`` (one ``Outcome`` per case).  ``install`` also arms the reference
tripwire while each exercise cell runs (``exercise_hashes``), recording in
``out/exercises.json`` any reference an exercise cell calls at definition time.

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
from labsim.checks._observe import Tripwire, reference_codes, watch

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
                    functions=spec.functions, ops=spec.ops, names=spec.names)
    return Spec(str(entry.get("title", "check")), lambda: [], drive=call_each, forbid=forbid,
                functions=int(entry.get("functions", 1)))


def read_cases(folder: Path, stem: str) -> list[Case]:
    """The cases (name, args, kwargs) the grader wrote as ``in/<stem>.json``/``.bin``."""
    raw = _plain.decode((folder / "in" / f"{stem}.json").read_bytes(),
                        (folder / "in" / f"{stem}.bin").read_bytes())
    return [Case(str(name), tuple(args), dict(kwargs)) for name, args, kwargs in raw]


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
    folder = _folder()
    entry = json.loads((folder / "in" / "checks.json").read_text())[index]
    cases = read_cases(folder, f"check-{index}")
    outcomes = driver_spec(entry).run(fns, cases)
    write_plain(folder / "out" / f"check-{index}.json",
                {"index": index, "outcomes": [o.to_plain() for o in outcomes]})


def install(shell: Any = None) -> None:
    """Arm the tripwire while each exercise cell runs (see the module docstring)."""
    folder = _folder()
    config = json.loads((folder / "in" / "kernel.json").read_text())
    hashes = set(config.get("exercise_hashes", []))
    codes = reference_codes(config.get("forbid", []))
    if shell is None or not hashes or not codes:
        return
    hits: list[list[Any]] = []
    state: dict[str, Any] = {}

    def pre(info: Any) -> None:
        digest = hashlib.sha256(str(getattr(info, "raw_cell", "")).encode()).hexdigest()
        if digest in hashes:
            wire = Tripwire(codes)
            wire.arm(None)
            state["wire"], state["digest"] = wire, digest

    def post(result: Any) -> None:
        wire = state.pop("wire", None)
        if wire is None:
            return
        wire.disarm()
        if wire.hits:
            hits.append([state["digest"], list(wire.hits)])
            write_plain(folder / "out" / "exercises.json", hits)

    shell.events.register("pre_run_cell", pre)
    shell.events.register("post_run_cell", post)


__all__ = ["DIR_ENV", "collect", "driver_spec", "install", "read_cases", "watch",
           "write_plain"]
