"""Reading one submitted notebook, defensively: whatever the file is, the answer is a notebook
or the reason (in words, naming what is wrong) it is ``invalid``.

- the path is ``lstat``-ed first: a symbolic link, a FIFO, a device or a directory is refused
  without being opened; the size is checked before reading and again on the open file
  (``O_NOFOLLOW | O_NONBLOCK``), reading at most the limit;
- a zip archive, UTF-16 text or other non-UTF-8 bytes, malformed or too deeply nested JSON,
  and JSON that is not a notebook are each named;
- outputs and attachments are dropped before the notebook is validated (only the learner's
  code is graded), so a large notebook costs little.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import nbformat

from labsim.course.records import read_regular

MAX_SUBMISSION_BYTES = 64 * 2**20
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_submission(path: Path, limit: int = MAX_SUBMISSION_BYTES) -> tuple[Any | None, str]:
    """(notebook, "") or (None, why it cannot be graded); reads the file once, never writes."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return None, f"cannot read the file: {exc.strerror or exc}"
    if stat.S_ISLNK(info.st_mode):
        return None, "a symbolic link, not a file: submit the notebook itself"
    if not stat.S_ISREG(info.st_mode):
        return None, f"{_kind(info.st_mode)}, not a notebook file"
    if info.st_size > limit:
        return None, (f"the file is {info.st_size / 1e6:.1f} MB, over the "
                      f"{limit / 1e6:.0f} MB limit (clear the outputs and save again)")
    data = read_regular(Path(path), limit)
    if data is None:
        return None, "the file changed while it was read, or is over the size limit"
    return parse_notebook(data)


def parse_notebook(data: bytes) -> tuple[Any | None, str]:
    """A notebook (outputs dropped) from the bytes of a file, or the reason it is not one."""
    if data.startswith(b"PK\x03\x04"):
        return None, "a zip archive, not a notebook (submit the .ipynb file itself)"
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return None, "UTF-16 text: save the notebook as UTF-8 (Jupyter's own format)"
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte {exc.start} cannot be decoded): not a notebook"
    try:
        raw = json.loads(text)
    except RecursionError:
        return None, "JSON nested too deeply to be a notebook"
    except json.JSONDecodeError as exc:
        return None, (f"not valid notebook JSON (line {exc.lineno}, column {exc.colno}: "
                      f"{exc.msg})")
    if not isinstance(raw, dict) or not isinstance(raw.get("cells"), list):
        return None, "not a Jupyter notebook (no 'cells' list)"
    for cell in raw["cells"]:
        if isinstance(cell, dict):
            if "outputs" in cell:
                cell["outputs"] = []
                cell["execution_count"] = None
            cell.pop("attachments", None)
    try:
        nb = nbformat.reads(json.dumps(raw), as_version=4)
        nbformat.validate(nb)
    except RecursionError:
        return None, "JSON nested too deeply to be a notebook"
    except nbformat.ValidationError as exc:
        return None, f"not a valid notebook: {str(exc.message).splitlines()[0][:200]}"
    except Exception as exc:  # noqa: BLE001 - nbformat raises many kinds
        return None, f"not a valid notebook: {type(exc).__name__}: {str(exc)[:200]}"
    return nb, ""
