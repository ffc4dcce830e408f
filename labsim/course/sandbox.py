"""Run one notebook under nbval in a process of its own, with limits, for ``labsim grade``.

Each run gets a fresh working folder and its own ``pytest --nbval-lax`` process, which starts
its own kernel.  What confines it (Linux):

- **time**: a per-cell limit (nbval interrupts the cell) and a whole-notebook limit (the
  grader kills the run and everything it started);
- **memory**: the kernel is launched through ``prlimit --as=BYTES`` (address-space limit:
  an allocation beyond it raises ``MemoryError`` in the learner's code); the nbval process
  gets the same limit plus a margin;
- **network**: with ``unshare`` the run lives in new user, network, mount and PID namespaces:
  only a loopback interface (brought up for the kernel's own sockets), so any connection to
  another address fails with "Network is unreachable";
- **files**: in that mount namespace the whole file system is read-only except the run's
  working folder, so a notebook cannot change the release, the solutions or other
  submissions; the notebook runs in a second, nested user namespace, where those mounts are
  locked (its "root" cannot remount them writable);
- **output**: what one cell prints is cut at 1 MB inside the kernel (``_kernel_guard``);
- **processes**: when the run ends, the PID namespace ends with it, so nothing the notebook
  started survives; without namespaces the grader kills the run's process tree.  Runs are
  started through ``setpriv --pdeathsig KILL`` where available, so they die with the grader.

Where ``unshare`` or ``prlimit`` is missing or not permitted (macOS, containers without user
namespaces, Ubuntu's AppArmor restriction), the run still happens without that protection and
``Sandbox.warnings`` says what is missing.  The sandbox bounds accidents and simple attacks;
it is not a security boundary against a determined learner (see docs/instructors.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

KERNEL_NAME = "labsim-grade"
REPORT_FILE = "cells.jsonl"
NOTEBOOK_FILE = "graded.ipynb"
PYTEST_MARGIN_BYTES = 2 * 2**30
GiB = 2**30
POLL_S = 0.2


@dataclass(frozen=True)
class Limits:
    """Resource limits for one graded notebook.

    ``cell_s``: seconds one cell may run; ``notebook_s``: seconds for the whole run (kernel
    start included); ``memory_bytes``: the kernel's address-space limit (virtual memory, so
    leave room above the lab's peak RSS: importing torch alone maps ~0.6 GB).
    """

    cell_s: float = 120.0
    notebook_s: float = 600.0
    memory_bytes: int = 4 * GiB

    def __post_init__(self) -> None:
        if not self.cell_s > 0:
            raise ValueError(f"cell time limit must be > 0 s, got {self.cell_s}")
        if not self.notebook_s >= self.cell_s:
            raise ValueError(
                f"notebook time limit ({self.notebook_s} s) must be at least the cell time "
                f"limit ({self.cell_s} s)"
            )
        if self.memory_bytes < 512 * 2**20:
            raise ValueError(
                f"memory limit {self.memory_bytes} bytes is below 512 MiB; a Python kernel "
                "cannot start in that (give e.g. --memory 4GiB)"
            )


@dataclass(frozen=True)
class Sandbox:
    """Which protections this machine allows; ``warnings`` names each one that is missing."""

    namespaces: bool
    prlimit: bool
    warnings: tuple[str, ...] = ()
    pdeathsig: bool = False  # setpriv can make a run die with the grader

    @property
    def network_isolated(self) -> bool:
        return self.namespaces

    @property
    def readonly_fs(self) -> bool:
        return self.namespaces


def _probe_namespaces() -> str | None:
    """None when ``unshare`` can build the sandbox here, else the reason it cannot."""
    if not sys.platform.startswith("linux"):
        return f"unshare is Linux-only (this is {sys.platform})"
    if shutil.which("unshare") is None:
        return "the unshare command is not installed (util-linux)"
    script = (
        "set -e; mount --bind \"$1\" \"$1\"; mount -o remount,bind,ro /; "
        + _lo_up_command()
        + "; exec unshare -rm sh -c '! mount -o remount,bind,rw / 2>/dev/null && "
        "touch \"$0/ok\" && ! touch /.labsim-probe 2>/dev/null' \"$1\""
    )
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"labsim-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        proc = subprocess.run(
            ["unshare", "-rnmpf", "--kill-child", "sh", "-c", script, "sh", str(probe)],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if proc.returncode != 0 or not (probe / "ok").exists():
            detail = (proc.stderr.strip().splitlines() or ["no message"])[-1]
            return f"unshare cannot create user/network/mount/PID namespaces here ({detail})"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


def _lo_up_command() -> str:
    """Bring the namespace's loopback up: ``ip`` when installed, else Python's ioctl."""
    if shutil.which("ip"):
        return "ip link set lo up"
    code = (
        "import fcntl,socket,struct;s=socket.socket();"
        "r=struct.pack('16sH14x',b'lo',0x1|0x8|0x40);"
        "fcntl.ioctl(s.fileno(),0x8914,r)"
    )
    return f"{sys.executable} -c \"{code}\""


def probe() -> Sandbox:
    """Find out which protections work on this machine (takes ~0.1 s)."""
    warnings: list[str] = []
    ns_problem = _probe_namespaces()
    if ns_problem:
        warnings.append(
            f"no network or file-system isolation: {ns_problem}; submissions can reach the "
            "network and write files this user can write"
        )
    has_prlimit = sys.platform.startswith("linux") and shutil.which("prlimit") is not None
    if not has_prlimit:
        warnings.append(
            "no memory limit: the prlimit command (util-linux) is not available; a notebook "
            "can use all the memory of this machine"
        )
    return Sandbox(
        namespaces=ns_problem is None,
        prlimit=has_prlimit,
        warnings=tuple(warnings),
        pdeathsig=_has_pdeathsig(),
    )


def _has_pdeathsig() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("setpriv") is None:
        return False
    try:
        out = subprocess.run(["setpriv", "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--pdeathsig" in out.stdout


@dataclass
class PortPool:
    """Hands out five free TCP ports per run, never the same port twice in one grading."""

    used: set[int] = field(default_factory=set)

    def take(self) -> list[int]:
        ports: list[int] = []
        holders = []
        while len(ports) < 5:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            holders.append(s)
            if port not in self.used:
                ports.append(port)
                self.used.add(port)
        for s in holders:
            s.close()
        return ports


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

    @classmethod
    def from_json(cls, raw: object) -> CellRecord | None:
        """Read one recorded line; a line without an integer ``cell`` is dropped (None)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("cell"), int):
            return None
        outputs = raw.get("outputs") if isinstance(raw.get("outputs"), list) else []
        duration = raw.get("duration_s", 0.0)
        return cls(
            cell=raw["cell"], phase=str(raw.get("phase", "call")),
            outcome=str(raw.get("outcome", "")), error_kind=str(raw.get("error_kind", "")),
            message=str(raw.get("message", "")), timed_out=bool(raw.get("timed_out", False)),
            kernel_alive=bool(raw.get("kernel_alive", False)),
            duration_s=float(duration) if isinstance(duration, (int, float)) else 0.0,
            outputs=tuple(o for o in map(CellOutput.from_json, outputs) if o is not None))

    @property
    def error(self) -> CellOutput | None:
        """The cell's error output, if it raised."""
        return next((o for o in self.outputs if o.kind == "error"), None)

    @property
    def stdout(self) -> str:
        """Everything the cell printed to standard output."""
        return "".join(o.text for o in self.outputs if o.kind == "stream" and o.name == "stdout")


@dataclass(frozen=True)
class RunRecord:
    """What one sandboxed nbval run left behind."""

    cells: tuple[CellRecord, ...]
    returncode: int | None
    notebook_timed_out: bool
    wall_s: float
    log_tail: str
    cancelled: bool = False


def _kernelspec(workdir: Path, limits: Limits, box: Sandbox) -> None:
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    if box.prlimit:
        argv = ["prlimit", f"--as={limits.memory_bytes}", "--", *argv]
    spec = {"argv": argv, "display_name": "labsim grade", "language": "python"}
    folder = workdir / "jupyter" / "kernels" / KERNEL_NAME
    folder.mkdir(parents=True)
    (folder / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")


def _environment(workdir: Path, ports: list[int], threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith(("JUPYTER_", "IPYTHON", "PYTEST_"))]:
        del env[key]
    home = workdir / "home"
    tmp = workdir / "tmp"
    startup = home / ".ipython" / "profile_default" / "startup"
    for d in (home, tmp, startup):
        d.mkdir(parents=True, exist_ok=True)
    (startup / "00-labsim-grade.py").write_text(
        "from labsim.course._kernel_guard import install\ninstall()\n", encoding="utf-8"
    )
    env.update(
        HOME=str(home),
        TMPDIR=str(tmp),
        JUPYTER_PATH=str(workdir / "jupyter"),
        JUPYTER_CONFIG_DIR=str(workdir / "jupyter" / "config"),
        JUPYTER_DATA_DIR=str(workdir / "jupyter" / "data"),
        JUPYTER_RUNTIME_DIR=str(workdir / "jupyter" / "runtime"),
        IPYTHONDIR=str(home / ".ipython"),
        MPLCONFIGDIR=str(home / ".matplotlib"),
        MPLBACKEND="Agg",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONHASHSEED="0",
        MALLOC_ARENA_MAX="2",
        LABSIM_GRADE_REPORT=str(workdir / REPORT_FILE),
        LABSIM_GRADE_PORTS=",".join(str(p) for p in ports),
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
    )
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, str(threads))
    return env


def _pytest_argv(workdir: Path, limits: Limits) -> list[str]:
    return [
        sys.executable, "-m", "pytest", str(workdir / NOTEBOOK_FILE),
        "--nbval-lax", f"--nbval-cell-timeout={limits.cell_s}",
        f"--nbval-kernel-name={KERNEL_NAME}", "--nbval-kernel-startup-timeout=60",
        "-p", "labsim.course._nbval_report", "-p", "nbval.plugin", "-p", "no:cacheprovider",
        "-q", "--no-header", "-rN", "--color=no", "--rootdir", str(workdir),
        "-o", "addopts=", "-o", "filterwarnings=ignore",
    ]


def _command(workdir: Path, limits: Limits, box: Sandbox) -> list[str]:
    argv = _pytest_argv(workdir, limits)
    if box.prlimit:
        argv = ["prlimit", f"--as={limits.memory_bytes + PYTEST_MARGIN_BYTES}", "--", *argv]
    # if the grader itself is killed, the run dies with it (with namespaces: all of it)
    death = ["setpriv", "--pdeathsig", "KILL"] if box.pdeathsig else []
    if not box.namespaces:
        return [*death, *argv]
    # The read-only remount is made inside the first user namespace, whose root could undo
    # it; the second user namespace (``unshare -rm``) locks the mounts it inherits, so the
    # notebook's "root" can neither remount them writable nor unmount the working folder.
    script = (
        "set -e; mount --bind \"$1\" \"$1\"; mount -o remount,bind,ro /; "
        + _lo_up_command()
        + '; shift; exec unshare -rm "$@"'
    )
    return [*death, "unshare", "-rnmpf", "--kill-child", "sh", "-c", script, "sh", str(workdir),
            *argv]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    victims = _descendants(proc.pid)
    for pid in [proc.pid, *victims]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_notebook(
    notebook_text: str,
    workdir: Path,
    limits: Limits,
    box: Sandbox,
    ports: list[int],
    threads: int = 1,
    cancel: threading.Event | None = None,
) -> RunRecord:
    """Run ``notebook_text`` under nbval in ``workdir`` (which must be empty) and read back
    the per-cell record.  Never raises for anything the notebook does.  Setting ``cancel``
    stops the run (and everything it started) within a fraction of a second."""
    workdir = Path(workdir)
    (workdir / NOTEBOOK_FILE).write_text(notebook_text, encoding="utf-8")
    _kernelspec(workdir, limits, box)
    env = _environment(workdir, ports, threads)
    log_path = workdir / "pytest.log"
    start = time.monotonic()
    timed_out = cancelled = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _command(workdir, limits, box),
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            while proc.poll() is None:
                if time.monotonic() - start > limits.notebook_s:
                    timed_out = True
                    break
                if cancel is not None and cancel.is_set():
                    cancelled = True
                    break
                try:
                    proc.wait(timeout=POLL_S)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if proc.poll() is None:  # still ours (not reaped): stop it and all it started
                _kill_tree(proc)
            proc.wait()
    wall_s = time.monotonic() - start
    return RunRecord(
        cells=tuple(_read_cells(workdir / REPORT_FILE)),
        returncode=None if timed_out else proc.returncode,
        notebook_timed_out=timed_out,
        wall_s=wall_s,
        log_tail=_tail(log_path),
        cancelled=cancelled,
    )


def _read_cells(path: Path) -> list[CellRecord]:
    cells: list[CellRecord] = []
    if not path.exists():
        return cells
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut short by a kill
            cell = CellRecord.from_json(record)
            if cell is not None:
                cells.append(cell)
    return cells


def _tail(path: Path, nbytes: int = 4000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - nbytes))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
