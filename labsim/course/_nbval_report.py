"""A pytest plugin that ``labsim grade`` loads into each sandboxed nbval run.

It is loaded with ``-p labsim.course._nbval_report`` in the grading subprocess only, and:

- writes one JSON line per notebook cell to the pipe whose descriptor is
  ``LABSIM_GRADE_REPORT_FD`` (cell number, outcome, what nbval said, the cell's outputs cut
  to a bounded size, whether the kernel was alive afterwards), flushed at once, so a run
  killed for its notebook time limit still leaves the record of every cell it finished.  The
  pipe leads to the run's first process, outside the learner's reach: this process makes
  itself non-dumpable (so the kernel, the same uid, cannot ptrace it or open its
  descriptors) and the kernel does not inherit the descriptor;
- starts the kernel on the ports listed in ``LABSIM_GRADE_PORTS`` (five numbers) when runs
  share a loopback (no network namespace), so parallel runs never race for the same port;
- notices a dead kernel within a fraction of a second instead of waiting for the cell time
  limit (nbval alone waits the whole limit for a reply that never comes);
- cuts every stream message to ``STREAM_LIMIT_CHARS``, so a notebook that prints 100 MB
  neither fills the grader's memory nor makes the output comparison crawl;
- holds the checks' inputs, read at start from the pipe ``LABSIM_GRADE_INPUTS_FD`` (the
  kernel never has it), and puts check ``i``'s into the run's ``live/`` folder just before
  its collector cell runs and removes them just after, so no cell of the notebook sees a
  check's inputs before that check runs;
- removes ``out/check-<i>.*`` before the collector runs and records their SHA-256 right after
  it finished without an error: the grader takes a check's results only when the files it
  gets back are the ones the finished collector left (a file written earlier, or after, or by
  a collector that never finished, is refused).
"""

from __future__ import annotations

import json
import os
import sys
import time
from queue import Empty
from typing import Any

import pytest

# jsonschema (imported by nbformat, which nbval imports) loads the optional rfc3987_syntax
# package when present, and building its grammar takes seconds per run; nbformat's schema
# does not use it.  This module is loaded before nbval, so the import is skipped.
if os.environ.get("LABSIM_GRADE_REPORT_FD"):
    sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]

STREAM_LIMIT_CHARS = 64_000
TEXT_LIMIT_CHARS = 8_000
POLL_S = 0.25
_REPORT_ENV = "LABSIM_GRADE_REPORT_FD"
_INPUTS_ENV = "LABSIM_GRADE_INPUTS_FD"
_DIR_ENV = "LABSIM_GRADE_DIR"
_PORTS_ENV = "LABSIM_GRADE_PORTS"
_PORT_NAMES = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


class KernelDied(RuntimeError):
    """The kernel process exited while a cell was running."""


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [{len(text) - limit} more characters cut by the grader]"


def _install() -> None:
    """Patch nbval's kernel wrapper: fixed ports, prompt death detection, bounded streams."""
    from nbval import kernel as nbk

    ports = os.environ.get(_PORTS_ENV, "")  # read before pytest_configure removes it
    if ports:
        numbers = [int(p) for p in ports.split(",")]
        base = nbk.KernelManager

        class PortedKernelManager(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.update(dict(zip(_PORT_NAMES, numbers)))
                kwargs.setdefault("ip", "127.0.0.1")
                super().__init__(*args, **kwargs)

        nbk.KernelManager = PortedKernelManager

    def await_reply(self: Any, msg_id: str, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                raise Empty
            try:
                msg = self.get_message(stream="shell", timeout=left)
            except Empty:
                if not self.km.is_alive():
                    raise KernelDied("the kernel process died while running this cell") from None
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                if msg["content"]["status"] == "aborted":
                    raise RuntimeError("Kernel aborted execution request")
                return

    original_get = nbk.RunningKernel.get_message

    def get_message(self: Any, stream: str, timeout: float | None = None) -> Any:
        msg = original_get(self, stream, timeout=timeout)
        content = msg.get("content", {})
        if msg.get("msg_type") == "stream" and isinstance(content.get("text"), str):
            content["text"] = _cut(content["text"], STREAM_LIMIT_CHARS)
        return msg

    nbk.RunningKernel.await_reply = await_reply
    nbk.RunningKernel.get_message = get_message


def _outputs(item: Any) -> list[dict]:
    """The outputs nbval collected for a cell, with every text cut to a bounded size."""
    kept: list[dict] = []
    for out in getattr(item, "test_outputs", None) or []:
        kind = out.get("output_type")
        if kind == "stream":
            kept.append({"type": "stream", "name": out.get("name", "stdout"),
                         "text": _cut(str(out.get("text", "")), STREAM_LIMIT_CHARS)})
        elif kind == "error":
            kept.append({"type": "error", "ename": str(out.get("ename", "")),
                         "evalue": _cut(str(out.get("evalue", "")), TEXT_LIMIT_CHARS)})
        elif kind in ("display_data", "execute_result"):
            text = out.get("data", {}).get("text/plain", "")
            kept.append({"type": "display", "text": _cut(str(text), TEXT_LIMIT_CHARS)})
    return kept


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        chunks = []
        while True:
            chunk = pipe.read(1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _collector(item: Any) -> int | None:
    """The check index of a collector cell (its ``metadata.labsim.collect``), else None."""
    cell = getattr(item, "cell", None)
    meta = cell.get("metadata", {}).get("labsim", {}) if cell is not None else {}
    index = meta.get("collect") if isinstance(meta, dict) else None
    return index if type(index) is int else None


def _sha256(path: str) -> str:
    import hashlib

    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return ""


class _Recorder:
    """Writes one JSON line per cell to the record pipe (its descriptor is held here and is
    not inherited: the kernel starts with only its standard streams), and stages each
    collector's inputs and fingerprints its results (module docstring)."""

    def __init__(self, fd: int, inputs: dict[str, bytes], folder: str) -> None:
        os.set_inheritable(fd, False)
        self.pipe = os.fdopen(fd, "w", encoding="utf-8")
        self.inputs = inputs
        self.live = os.path.join(folder, "live")
        self.out = os.path.join(folder, "out")
        os.makedirs(self.live, exist_ok=True)

    def _names(self, index: int) -> list[str]:
        return [f"check-{index}.json", f"check-{index}.bin"]

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: Any) -> None:
        index = _collector(item)
        if index is None:
            return
        for name in self._names(index):
            for folder in (self.out, self.live):
                try:
                    os.unlink(os.path.join(folder, name))
                except OSError:
                    pass
            data = self.inputs.get(name)
            if data is not None:
                tmp = os.path.join(self.live, name + ".tmp")
                with open(tmp, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, os.path.join(self.live, name))

    def _finish_collector(self, index: int, passed: bool) -> dict[str, str] | None:
        for name in self._names(index):
            try:
                os.unlink(os.path.join(self.live, name))
            except OSError:
                pass
        if not passed:
            return None
        return {name: _sha256(os.path.join(self.out, name)) for name in self._names(index)}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any) -> Any:
        outcome = yield
        report = outcome.get_result()
        if not hasattr(item, "cell_num"):
            return
        if call.when != "call" and not (call.when == "setup" and report.outcome != "passed"):
            return
        exc = call.excinfo.value if call.excinfo is not None else None
        kernel = getattr(item.parent, "kernel", None)
        index = _collector(item) if call.when == "call" else None
        digests = (self._finish_collector(index, report.outcome == "passed")
                   if index is not None else None)
        record = {
            "cell": item.cell_num,
            "phase": call.when,
            "outcome": report.outcome,
            "error_kind": type(exc).__name__ if exc is not None else "",
            "message": _cut(str(exc), TEXT_LIMIT_CHARS) if exc is not None else "",
            "timed_out": bool(getattr(item.parent, "timed_out", False)),
            "kernel_alive": bool(kernel is not None and kernel.is_alive()),
            "duration_s": round(call.stop - call.start, 3),
            "outputs": _outputs(item),
        }
        if index is not None:
            record["collect"] = index
            record["digests"] = digests
        self.pipe.write(json.dumps(record) + "\n")
        self.pipe.flush()


def _nodump() -> None:
    """prctl(PR_SET_DUMPABLE, 0): same-uid processes (the kernel) can no longer ptrace this
    one or open its /proc/PID/fd."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def pytest_configure(config: pytest.Config) -> None:
    fd = os.environ.pop(_REPORT_ENV, "")
    inputs_fd = os.environ.pop(_INPUTS_ENV, "")
    if fd.isdigit():
        _nodump()
        inputs: dict[str, bytes] = {}
        if inputs_fd.isdigit():
            from labsim.course.sandbox import unpack

            os.set_inheritable(int(inputs_fd), False)
            inputs = unpack(_read_all(int(inputs_fd)))
        _install()
        os.environ.pop(_PORTS_ENV, None)
        recorder = _Recorder(int(fd), inputs, os.environ.get(_DIR_ENV, "."))
        config.pluginmanager.register(recorder, "labsim-grade-recorder")
