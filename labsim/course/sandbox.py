"""Run one notebook under nbval in a sandbox of its own, with limits, for ``labsim grade``.

Each run gets a fresh folder: ``in/`` (what the grader gives it: the graded notebook, the
kernel spec and startup file, the checks' inputs), ``out/`` (what comes back) and a mount
point for the learner's root.  ``labsim.course._jail`` (the run's first process) builds that
root and runs nbval inside it; see its docstring for what it isolates.  The grader adds:

- an unprivileged uid when it runs as root: the jail starts as root of the new namespaces,
  the learner's processes as uid 65534 (``setpriv``) on the host;
- a control group per run where the grader may create one (root, cgroup v1 or v2): the
  run's total memory and number of processes, whatever it starts;
- the whole-notebook deadline, enforced by the jail (and, with a margin, by killing it).

``probe()`` says once which pieces this machine provides; every run records in its
``jail.json`` what was applied and what was missing, and the CSV's ``sandbox`` column says it
per submission.  Scores never depend on the sandbox: they come from the grader's own
comparisons (``grade.py``); the sandbox protects the grader, its machine and the other
learners.
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
NOTEBOOK_FILE = "graded.ipynb"
GiB = 2**30
POLL_S = 0.2
DROP_UID = 65534  # "nobody": who the sandbox is on the host when the grader is root
RUN_BYTES = 1 * GiB  # the run's writable tmpfs: work folder, home, outputs
TMP_BYTES = 512 * 2**20
SHM_BYTES = 512 * 2**20
FILE_BYTES = 256 * 2**20  # largest file the notebook may write
EXPORT_BYTES = 256 * 2**20
PROCESSES = 256  # tasks (threads count) per run
OPEN_FILES = 4096
MEMORY_MARGIN_BYTES = 1 * GiB  # pytest, the launcher's workers: above the kernel's own limit
JAIL_MARGIN_S = 30.0


@dataclass(frozen=True)
class Limits:
    """Resource limits for one graded notebook.

    ``cell_s``: seconds one cell may run; ``notebook_s``: seconds for the whole run (kernel
    start included); ``memory_bytes``: each process's address-space limit (virtual memory, so
    leave room above the lab's peak RSS: importing torch alone maps ~0.6 GB) and, where a
    control group is available, the run's total memory is this plus ``MEMORY_MARGIN_BYTES``.
    """

    cell_s: float = 120.0
    notebook_s: float = 600.0
    memory_bytes: int = 4 * GiB

    def __post_init__(self) -> None:
        for name in ("cell_s", "notebook_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    value > 0 and value < float("inf")):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if not self.notebook_s >= self.cell_s:
            raise ValueError(
                f"notebook time limit ({self.notebook_s} s) must be at least the cell time "
                f"limit ({self.cell_s} s)"
            )
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int):
            raise ValueError(f"memory limit must be a whole number of bytes, got "
                             f"{self.memory_bytes!r}")
        if self.memory_bytes < 512 * 2**20:
            raise ValueError(
                f"memory limit {self.memory_bytes} bytes is below 512 MiB; a Python kernel "
                "cannot start in that (give e.g. --memory 4GiB)"
            )


@dataclass(frozen=True)
class Sandbox:
    """Which protections this machine allows; ``warnings`` names each one that is missing
    (``missing`` is the same, short, for the CSV)."""

    namespaces: bool
    prlimit: bool
    warnings: tuple[str, ...] = ()
    pdeathsig: bool = False  # setpriv can make a run die with the grader
    drop_uid: int | None = None  # the uid the sandbox runs as on the host (grader is root)
    cgroup: str = ""  # "v1", "v2" or "" (none)
    missing: tuple[str, ...] = ()

    @property
    def network_isolated(self) -> bool:
        return self.namespaces

    @property
    def readonly_fs(self) -> bool:
        return self.namespaces


def setpriv_drop() -> list[str]:
    """The command prefix that becomes the unprivileged ``DROP_UID`` (from root)."""
    return ["setpriv", f"--reuid={DROP_UID}", f"--regid={DROP_UID}", "--clear-groups", "--"]


def learner_prefix(drop: bool) -> list[str]:
    """How the jail starts the learner's processes: (from root: as ``DROP_UID``, root of a
    user namespace of its own;) no further user namespaces; uid 1000 of a nested user
    namespace, without capabilities."""
    inner = ('echo 1 > /proc/sys/user/max_user_namespaces && '
             'exec unshare -U --map-user=1000 --map-group=1000 -- "$@"')
    outer = [*setpriv_drop(), "unshare", "-U", "-r", "--"] if drop else []
    return [*outer, "sh", "-c", inner, "sh"]


def jail_prefix(drop: bool) -> list[str]:
    """How the grader starts the jail: new mount, network and PID namespaces (and, when the
    grader is not root, a user namespace whose root it is)."""
    return ["unshare", "-mnpf" if drop else "-Urnmpf", "--kill-child"]


def _probe_namespaces(drop: bool) -> str | None:
    """None when ``unshare`` can build the sandbox here, else the reason it cannot."""
    if not sys.platform.startswith("linux"):
        return f"unshare is Linux-only (this is {sys.platform})"
    for tool in ("unshare", "mount", "pivot_root"):
        if shutil.which(tool) is None:
            return f"the {tool} command is not installed (util-linux)"
    base = Path(os.environ.get("TMPDIR", "/tmp"))
    probe = base / f"labsim-probe-{os.getpid()}-{threading.get_ident()}"
    probe.mkdir(exist_ok=True)
    os.chmod(probe, 0o777)
    script = ('set -e; d="$1"; shift; mount -t tmpfs -o size=1m tmpfs "$d"; '
              'mount -t proc proc /proc; "$@" true; touch "$d/ok"; '
              'cp "$d/ok" "$d/../$(basename "$d").ok"')
    try:
        cmd = [*jail_prefix(drop), "sh", "-c", script, "sh", str(probe), *learner_prefix(drop)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        flag = base / f"{probe.name}.ok"
        if proc.returncode != 0 or not flag.exists():
            detail = (proc.stderr.strip().splitlines() or ["no message"])[-1]
            return f"unshare cannot create user/network/mount/PID namespaces here ({detail})"
        flag.unlink()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


def _probe_cgroup() -> str:
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return ""
    v1 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/pids")
    if all(p.is_dir() and os.access(p, os.W_OK) for p in v1):
        return "v1"
    root = Path("/sys/fs/cgroup")
    controllers = root / "cgroup.controllers"
    if controllers.exists() and os.access(root, os.W_OK):
        have = set(controllers.read_text().split())
        if {"memory", "pids"} <= have:
            return "v2"
    return ""


def probe() -> Sandbox:
    """Find out which protections work on this machine (takes ~0.1 s)."""
    warnings: list[str] = []
    missing: list[str] = []
    root = sys.platform.startswith("linux") and os.geteuid() == 0
    drop = root and shutil.which("setpriv") is not None
    ns_problem = _probe_namespaces(drop)
    if ns_problem:
        warnings.append(
            f"no isolation: {ns_problem}; submissions can reach the network, read and write "
            "files this user can, and see other processes"
        )
        missing.append("no namespaces (network, files and processes not isolated)")
    if root and not drop:
        warnings.append("the grader runs as root and cannot drop to an unprivileged uid "
                        "(setpriv missing)")
        missing.append("runs as root")
    has_prlimit = sys.platform.startswith("linux") and shutil.which("prlimit") is not None
    if not has_prlimit:
        warnings.append(
            "no per-process limits: the prlimit command (util-linux) is not available; a "
            "notebook can use all the memory of this machine and start any number of processes"
        )
        missing.append("no prlimit (memory, process and file-size limits)")
    cgroup = _probe_cgroup()
    if not cgroup:
        missing.append("no control group (memory is limited per process, not per run)")
    return Sandbox(
        namespaces=ns_problem is None,
        prlimit=has_prlimit,
        warnings=tuple(warnings),
        pdeathsig=_has_pdeathsig(),
        drop_uid=DROP_UID if drop else None,
        cgroup=cgroup,
        missing=tuple(missing),
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
    """Hands out five free TCP ports per run, never the same port twice in one grading (only
    needed without network namespaces, where runs share the loopback)."""

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
class RunRecord:
    """What one sandboxed run left behind: nbval's per-cell records (raw JSON lines), the
    jail's report, and the folder holding the exported files."""

    records: bytes
    jail: dict
    out_dir: Path
    returncode: int | None
    notebook_timed_out: bool
    wall_s: float
    log_tail: str
    cancelled: bool = False


def package_dirs(graded: Path | None = None) -> list[tuple[str, str]]:
    """What the learner's root shows besides /usr, as (source, target) binds: the Python
    installation and the virtual environment at their own paths, and ``graded`` (the folder
    holding the graded copy of labsim) at its own path; the installed labsim package is
    covered by the copy where the bound folders would show it, and otherwise not bound.
    Without ``graded``, the installed package itself (each folder once, outermost first)."""
    import labsim

    installed = os.path.realpath(os.path.dirname(labsim.__file__))
    roots = [os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)]
    if graded is None:
        roots.append(installed)
    out: list[str] = []
    for d in sorted(set(roots), key=len):
        if d.startswith("/usr/") or any(d == o or d.startswith(o + os.sep) for o in out):
            continue
        out.append(d)
    binds = [(d, d) for d in out]
    if graded is not None:
        root = os.path.realpath(graded)
        binds.append((root, root))
        if any(installed == d or installed.startswith(d + os.sep) for d in out):
            binds.append((os.path.join(root, "labsim"), installed))
    return binds


def _kernelspec(folder: Path, limits: Limits, box: Sandbox) -> None:
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    if box.prlimit:
        argv = ["prlimit", f"--as={limits.memory_bytes}", "--", *argv]
    spec = {"argv": argv, "display_name": "labsim grade", "language": "python"}
    target = folder / "jupyter" / "kernels" / KERNEL_NAME
    target.mkdir(parents=True)
    (target / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")


STARTUP = """\
from labsim.course._kernel_guard import install as _labsim_guard
_labsim_guard()
del _labsim_guard
from labsim.checks._collect import install as _labsim_collect
_labsim_collect(get_ipython())
del _labsim_collect
"""


def _environment(limits: Limits, threads: int, ports: list[int], isolated: bool,
                 graded: Path | None = None) -> dict[str, str]:
    """The allow-listed environment of the run ({folder} is the run folder as the run sees
    it); nothing else of the grader's environment goes in.  With ``graded`` (the folder of
    the graded copy) that copy is first on the path and every Python process of the run
    installs the guard (``labsim.lab.guard``)."""
    import labsim

    home = "{folder}/home"
    env = {
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin",
                                 "/bin"]),
        "HOME": home, "TMPDIR": "/tmp" if isolated else "{folder}/tmp",
        "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        "PYTHONPATH": (os.path.realpath(graded) if graded is not None else
                       os.path.dirname(os.path.dirname(os.path.abspath(labsim.__file__)))),
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "MALLOC_ARENA_MAX": "2",
        "MPLBACKEND": "Agg", "MPLCONFIGDIR": f"{home}/.matplotlib",
        "JUPYTER_PATH": "{folder}/in/jupyter", "JUPYTER_CONFIG_DIR": f"{home}/.jupyter",
        "JUPYTER_DATA_DIR": f"{home}/.local/share/jupyter",
        "JUPYTER_RUNTIME_DIR": f"{home}/.local/share/jupyter/runtime",
        "IPYTHONDIR": f"{home}/.ipython", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "LABSIM_GRADE_DIR": "{folder}",
    }
    if graded is not None:
        env["LABSIM_GUARD"] = "1"
    if not isolated:
        env["LABSIM_GRADE_PORTS"] = ",".join(str(p) for p in ports)
    return env


def _pytest_argv(limits: Limits) -> list[str]:
    return [
        sys.executable, "-m", "pytest", "{folder}/work/" + NOTEBOOK_FILE,
        "--nbval-lax", f"--nbval-cell-timeout={limits.cell_s}",
        f"--nbval-kernel-name={KERNEL_NAME}", "--nbval-kernel-startup-timeout=60",
        "-p", "labsim.course._nbval_report", "-p", "nbval.plugin", "-p", "no:cacheprovider",
        "-q", "--no-header", "-rN", "--color=no", "--rootdir", "{folder}/work",
        "-o", "addopts=", "-o", "filterwarnings=ignore",
    ]


class _Cgroup:
    """One control group for a run (memory and process count), or nothing."""

    def __init__(self, kind: str, name: str, memory_bytes: int) -> None:
        self.kind, self.dirs = kind, []
        if kind == "v1":
            self.dirs = [Path("/sys/fs/cgroup/memory") / name, Path("/sys/fs/cgroup/pids") / name]
        elif kind == "v2":
            self.dirs = [Path("/sys/fs/cgroup") / name]
        self.ok = False
        try:
            for d in self.dirs:
                d.mkdir()
            if kind == "v1":
                (self.dirs[0] / "memory.limit_in_bytes").write_text(str(memory_bytes))
                (self.dirs[1] / "pids.max").write_text(str(PROCESSES))
            elif kind == "v2":
                (self.dirs[0] / "memory.max").write_text(str(memory_bytes))
                (self.dirs[0] / "pids.max").write_text(str(PROCESSES))
            self.ok = bool(self.dirs)
        except OSError:
            self.close()

    def wrapper(self) -> list[str]:
        if not self.ok:
            return []
        joins = "; ".join(f'echo $$ > "{d}/cgroup.procs"' for d in self.dirs)
        return ["sh", "-c", f'{joins}; exec "$@"', "sh"]

    def close(self) -> None:
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # processes still leaving
                    time.sleep(0.05)
        self.ok = False


def prepare(folder: Path, notebook_text: str, files: dict[str, bytes], limits: Limits,
            box: Sandbox) -> None:
    """Fill ``folder/in`` with what the run needs (the folder must be empty)."""
    infolder, out = folder / "in", folder / "out"
    folder.mkdir(parents=True, exist_ok=True)
    infolder.mkdir()
    out.mkdir()
    (folder / "root").mkdir()
    (infolder / NOTEBOOK_FILE).write_text(notebook_text, encoding="utf-8")
    (infolder / "startup.py").write_text(STARTUP, encoding="utf-8")
    for name, data in files.items():
        (infolder / name).write_bytes(data)
    _kernelspec(infolder, limits, box)
    # the learner's processes (another uid) read what the grader gives them, nothing else
    os.chmod(infolder, 0o755)
    for dirpath, dirnames, filenames in os.walk(infolder):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o644)


def run_notebook(
    notebook_text: str,
    folder: Path,
    limits: Limits,
    box: Sandbox,
    ports: list[int],
    threads: int = 1,
    cancel: threading.Event | None = None,
    files: dict[str, bytes] | None = None,
    exports: tuple[str, ...] = (),
    secret: dict[str, bytes] | None = None,
    graded: Path | None = None,
) -> RunRecord:
    """Run ``notebook_text`` under nbval in ``folder`` (which must be empty); ``files`` go to
    the run's ``in/`` folder, the files named in ``exports`` come back from its ``out/``.
    ``secret`` files (the checks' inputs) never enter ``in/``: nbval holds them and puts each
    check's into the run's ``live/`` folder only while that check's collector runs.
    ``graded``: the folder holding the graded copy of labsim (``withhold.build``), which the
    run imports instead of the installed package.  Never raises for anything the notebook
    does.  Setting ``cancel`` stops the run (and everything it started) within a fraction of a
    second."""
    folder = Path(folder)
    prepare(folder, notebook_text, files or {}, limits, box)
    secret_path = folder / "secret.bin"
    secret_path.write_bytes(pack(secret or {}))
    os.chmod(secret_path, 0o644)  # for the jail (another uid when the grader is root)
    cgroup = _Cgroup(box.cgroup, f"labsim-{os.getpid()}-{folder.parent.name}-{folder.name}",
                     limits.memory_bytes + MEMORY_MARGIN_BYTES)
    missing = list(box.missing)
    if box.cgroup and not cgroup.ok:
        missing.append("the control group could not be created")
    rlimits = {"as": limits.memory_bytes + MEMORY_MARGIN_BYTES, "nproc": PROCESSES,
               "fsize": FILE_BYTES, "nofile": OPEN_FILES, "core": 0}
    config = {
        "isolate": box.namespaces, "root": str(folder / "root"), "in": str(folder / "in"),
        "out": str(folder / "out"), "folder": str(folder), "binds": package_dirs(graded),
        "secret": str(secret_path),
        "run_bytes": RUN_BYTES, "tmp_bytes": TMP_BYTES, "shm_bytes": SHM_BYTES,
        "rlimits": rlimits, "prlimit": box.prlimit,
        "env": _environment(limits, threads, ports, box.namespaces, graded),
        "argv": _pytest_argv(limits), "notebook_s": limits.notebook_s,
        "exports": list(exports), "export_bytes": EXPORT_BYTES, "missing": missing,
        "learner": learner_prefix(box.drop_uid is not None) if box.namespaces else [],
        "owner": box.drop_uid if box.namespaces else None,
    }
    (folder / "jail.json").write_text(json.dumps(config), encoding="utf-8")
    jail = [sys.executable, "-m", "labsim.course._jail", str(folder / "jail.json")]
    cmd = jail
    if box.namespaces:
        cmd = [*jail_prefix(box.drop_uid is not None), *jail]
    if box.pdeathsig:
        cmd = ["setpriv", "--pdeathsig", "KILL", "--", *cmd]
    cmd = [*cgroup.wrapper(), *cmd]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
           "PYTHONPATH": _environment(limits, threads, ports, True)["PYTHONPATH"]}
    start = time.monotonic()
    timed_out = cancelled = False
    log_path = folder / "jail.log"
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=folder, env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                while proc.poll() is None:
                    if time.monotonic() - start > limits.notebook_s + JAIL_MARGIN_S:
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
                if proc.poll() is None:
                    _kill_tree(proc)
                proc.wait()
    finally:
        cgroup.close()
    out = folder / "out"
    report = _read_json(out / "jail.json")
    timed_out = timed_out or bool(report.get("timed_out"))
    return RunRecord(
        records=_read_bytes(out / "records.jsonl", 8 * 2**20),
        jail=report,
        out_dir=out,
        returncode=None if timed_out else report.get("returncode", proc.returncode),
        notebook_timed_out=timed_out,
        wall_s=time.monotonic() - start,
        log_tail=_tail(out / "pytest.log") or _tail(log_path),
        cancelled=cancelled,
    )


def pack(files: dict[str, bytes]) -> bytes:
    """Files as one blob: an 8-byte length, a JSON index {name: [offset, size]}, the data."""
    index, chunks, offset = {}, [], 0
    for name, data in files.items():
        index[name] = [offset, len(data)]
        chunks.append(data)
        offset += len(data)
    head = json.dumps(index).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(chunks)


def unpack(blob: bytes) -> dict[str, bytes]:
    """The files of ``pack``'s blob ({} for an empty or malformed one)."""
    if len(blob) < 8:
        return {}
    size = int.from_bytes(blob[:8], "little")
    try:
        index = json.loads(blob[8:8 + size])
    except ValueError:
        return {}
    body = blob[8 + size:]
    return {str(name): body[off:off + n] for name, (off, n) in index.items()}


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


def _read_bytes(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``path`` (never a link), or b""."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b""
    try:
        import stat as st

        if not st.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(_read_bytes(path, 1 << 20) or b"{}")
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _tail(path: Path, nbytes: int = 4000) -> str:
    data = _read_bytes(path, EXPORT_BYTES)
    return data[-nbytes:].decode("utf-8", "replace")
