"""What a graded run leaves behind and how the grader reads it, defensively.

- ``CellRecord``: nbval's line for one cell (outcome, error, outputs), from the record pipe.
  It says what happened (an exercise raised, a cell timed out, the kernel died) for the
  reasons in the CSV; it never decides a score.
- ``read_outcomes``: a check's outcomes as the learner's sandbox wrote them -- plain data only,
  size-capped, a regular file (never a link), every field checked -- or the reason they cannot
  be used.
- ``sanitize``: learner-controlled text cut to a short, printable excerpt before it appears in
  a CSV or a feedback file.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from labsim.checks import Outcome, _plain

OUTPUT_BYTES = 256 * 2**20
EXCERPT_CHARS = 200
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def sanitize(text: object, chars: int = EXCERPT_CHARS, lines: int = 1) -> str:
    """A short printable excerpt of learner-controlled ``text``: control and bidirectional
    characters replaced, at most ``lines`` lines of at most ``chars`` characters."""
    raw = str(text).replace("\r", "")
    kept = []
    for line in raw.split("\n")[:lines]:
        line = _CONTROL.sub("?", line)
        kept.append(line if len(line) <= chars else line[: chars - 3] + "...")
    more = raw.count("\n") >= lines
    return "\n".join(kept) + (" [...]" if more and lines > 1 else "")


@dataclass(frozen=True)
class CellOutput:
    """One output of a graded cell, as the run's recorder kept it: a ``"stream"`` (``name``,
    ``text``), an ``"error"`` (``ename``, ``evalue``) or a ``"display"`` (``text``)."""

    kind: str
    name: str = ""
    text: str = ""
    ename: str = ""
    evalue: str = ""

    @classmethod
    def from_json(cls, raw: object) -> CellOutput | None:
        """Read one recorded output; anything malformed is dropped (None)."""
        if not isinstance(raw, dict) or raw.get("type") not in ("stream", "error", "display"):
            return None
        fields = {k: raw.get(k, "") for k in ("name", "text", "ename", "evalue")}
        return cls(raw["type"], **{k: v if isinstance(v, str) else str(v)
                                   for k, v in fields.items()})


@dataclass(frozen=True)
class CellRecord:
    """The recorder's line for one cell of a graded run: which ``phase`` of the pytest item
    it is (``"call"``, or ``"setup"`` when the kernel could not start), the nbval
    ``outcome``, the exception nbval raised (``error_kind``, ``message``), whether the kernel
    was alive afterwards, and the cell's ``outputs``."""

    cell: int
    phase: str = "call"
    outcome: str = ""
    error_kind: str = ""
    message: str = ""
    timed_out: bool = False
    kernel_alive: bool = True
    duration_s: float = 0.0
    outputs: tuple[CellOutput, ...] = ()
    collect: int | None = None  # the check a collector cell ran
    digests: tuple[tuple[str, str], ...] | None = None  # its results' SHA-256, if it finished

    @classmethod
    def from_json(cls, raw: object) -> CellRecord | None:
        """Read one recorded line; a line without an integer ``cell`` is dropped (None)."""
        if not isinstance(raw, dict) or type(raw.get("cell")) is not int:
            return None
        outputs = raw.get("outputs") if isinstance(raw.get("outputs"), list) else []
        duration = raw.get("duration_s", 0.0)
        collect = raw.get("collect") if type(raw.get("collect")) is int else None
        digests = raw.get("digests")
        if isinstance(digests, dict):
            digests = tuple(sorted((str(k), str(v)) for k, v in list(digests.items())[:4]))
        else:
            digests = None
        return cls(
            cell=raw["cell"], phase=str(raw.get("phase", "call")),
            outcome=str(raw.get("outcome", "")), error_kind=str(raw.get("error_kind", "")),
            message=str(raw.get("message", "")), timed_out=bool(raw.get("timed_out", False)),
            kernel_alive=bool(raw.get("kernel_alive", False)),
            duration_s=float(duration) if isinstance(duration, (int, float)) else 0.0,
            outputs=tuple(o for o in map(CellOutput.from_json, outputs[:100]) if o is not None),
            collect=collect, digests=digests)

    @property
    def error(self) -> CellOutput | None:
        """The cell's error output, if it raised."""
        return next((o for o in self.outputs if o.kind == "error"), None)

    @property
    def stdout(self) -> str:
        """Everything the cell printed to standard output."""
        return "".join(o.text for o in self.outputs if o.kind == "stream" and o.name == "stdout")


def read_records(data: bytes) -> list[CellRecord]:
    """The cell records of a run's record stream (a line cut short by a kill is dropped)."""
    cells: list[CellRecord] = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            raw = json.loads(line)
        except (ValueError, RecursionError):
            break
        record = CellRecord.from_json(raw)
        if record is not None:
            cells.append(record)
    return cells


def read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a link, not a FIFO or device) of at
    most ``limit`` bytes; None otherwise.  The size is checked on the open file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 24, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                return None
        return b"".join(chunks)
    finally:
        os.close(fd)


def digest_problem(out_dir: Path, stem: str, digests: tuple[tuple[str, str], ...]) -> str:
    """"" when ``out_dir/<stem>.json``/``.bin`` are the files whose SHA-256 the run recorded
    right after the check's collector finished, else what differs."""
    for name, expected in digests:
        if name not in (f"{stem}.json", f"{stem}.bin"):
            continue
        got = sha256_regular(out_dir / name, OUTPUT_BYTES)
        if got != expected:
            return (f"{name} was changed after the check finished" if expected and got else
                    f"{name} is not the file the check left")
    return ""


def sha256_regular(path: Path, limit: int) -> str:
    """The SHA-256 of the regular file ``path`` (not a link, at most ``limit`` bytes), read
    a megabyte at a time; "" when it is not one."""
    import hashlib

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return ""
        digest, total = hashlib.sha256(), 0
        while chunk := os.read(fd, 1 << 20):
            total += len(chunk)
            if total > limit:
                return ""
            digest.update(chunk)
        return digest.hexdigest()
    finally:
        os.close(fd)


def read_outcomes(out_dir: Path, stem: str, n_cases: int) -> list[Outcome] | str:
    """A check's outcomes from ``out_dir/<stem>.json``/``.bin``, or why they are unusable."""
    text = read_regular(out_dir / f"{stem}.json", OUTPUT_BYTES)
    if text is None:
        return "missing"
    blob = read_regular(out_dir / f"{stem}.bin", OUTPUT_BYTES) or b""
    try:
        raw = _plain.decode(text, blob)
        if not isinstance(raw, dict) or not isinstance(raw.get("outcomes"), list):
            raise _plain.PlainDataError("no list of outcomes")
        outcomes = [Outcome.from_plain(o) for o in raw["outcomes"]]
    except _plain.PlainDataError as exc:
        return f"its results are not valid plain data ({sanitize(exc, 120)})"
    if len(outcomes) != n_cases:
        return f"{len(outcomes)} results for {n_cases} cases"
    return outcomes
