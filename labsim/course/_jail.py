"""The first process of a graded run: build the learner's world, run nbval in it, hand back
only what the grader asked for.

``labsim grade`` starts ``python -m labsim.course._jail CONFIG`` -- inside new user, mount,
network and PID namespaces (``unshare -Urnmpf``) where the machine allows them, as an
unprivileged uid where the grader is root.  This process is root of those namespaces (and
PID 1) and, before anything of the learner's runs:

1. builds a minimal root on a tmpfs: read-only binds of ``/usr`` (with the ``/bin``, ``/lib``
   links), a few files of ``/etc`` (its own ``passwd``/``group``/``hosts``), the Python
   installation, the virtual environment and the graded copy of ``labsim`` (the lab's
   references withheld; the installed package is hidden under it, and the checkout around it
   is not there: no solutions); a fresh ``/proc``; a private ``/dev`` holding only ``null``,
   ``zero``, ``full``, ``random``, ``urandom`` and a size-capped ``/dev/shm``; a size-capped
   ``/tmp``; no ``/sys``; the run folder ``/run/labsim`` (a size-capped tmpfs: ``work``, ``home``,
   ``out``) and the grader's inputs read-only at ``/run/labsim/in``; then ``pivot_root`` into
   it, the old root unmounted and the new root read-only;
2. brings up the namespace's own loopback (no other interface: no network);
3. runs pytest + nbval as uid 1000 of a nested user namespace (no capabilities, mounts
   locked, no further user namespaces; where the grader is root, the namespaces above it
   belong to the unprivileged uid 65534) under ``prlimit`` (address space, processes, file
   size, open files, no core files) with an allow-listed environment; nbval's per-cell
   record comes back through a pipe the kernel cannot reach (pytest makes itself
   non-dumpable, the kernel does not inherit it);
4. ends everything in the PID namespace at the notebook's deadline or when nbval exits, then
   copies out the files the grader named (regular files only, size-capped, never following a
   link) into the grader's folder through a descriptor opened before ``pivot_root``, with
   ``jail.json``: what was applied, what the machine could not provide, how the run ended.

Without namespaces (``isolate: false``) it runs the same nbval command with the limits it can
set, in the grader's own file system, and says so in ``jail.json``.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

RUN = "/run/labsim"
LEARNER_UID = 1000
DEVICES = ("null", "zero", "full", "random", "urandom")
ETC_FILES = ("ld.so.cache", "localtime", "nsswitch.conf", "mime.types")
RECORD_LIMIT_BYTES = 8 * 2**20
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36


def _nodump() -> None:
    """Make this process non-dumpable: a same-uid process can no longer ptrace it or open
    its ``/proc/PID/fd`` (Linux ``prctl(PR_SET_DUMPABLE, 0)``)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def _mount(*args: str) -> None:
    _run("mount", *args)


def _bind_ro(src: str, dst: Path) -> None:
    if os.path.isdir(src):
        dst.mkdir(parents=True, exist_ok=True)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.touch()
    _mount("--bind", src, str(dst))
    _mount("-o", "remount,bind,ro", str(dst))


def _tmpfs(dst: Path, size: int, mode: str = "755") -> None:
    dst.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size},mode={mode},nosuid,nodev", "tmpfs", str(dst))


def _build_root(cfg: dict[str, Any], applied: list[str]) -> None:
    root = Path(cfg["root"])
    _mount("-t", "tmpfs", "-o", "size=8m,mode=755", "tmpfs", str(root))
    for name in ("bin", "lib", "lib64", "lib32", "sbin", "libx32"):
        host = Path("/") / name
        if host.is_symlink():
            (root / name).symlink_to(os.readlink(host))
        elif host.is_dir():
            _bind_ro(str(host), root / name)
    _bind_ro("/usr", root / "usr")
    etc = root / "etc"
    etc.mkdir()
    for name in ETC_FILES:
        if os.path.isfile(f"/etc/{name}"):
            _bind_ro(f"/etc/{name}", etc / name)
    (etc / "passwd").write_text(f"root:x:0:0::/:/bin/sh\nlearner:x:{LEARNER_UID}:"
                                f"{LEARNER_UID}::{RUN}/home:/bin/sh\n")
    (etc / "group").write_text(f"root:x:0:\nlearner:x:{LEARNER_UID}:\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    # /tmp first: a venv or checkout under the host's /tmp is bound inside it, not hidden by it
    _tmpfs(root / "tmp", cfg["tmp_bytes"], "1777")
    for src, dst in cfg["binds"]:  # Python, the venv, the graded copy of labsim (and that
        # copy again over the installed package, where the venv holds one): same paths inside
        if not str(Path(dst)).startswith("/usr/"):
            _bind_ro(src, root / Path(dst).relative_to("/"))
    applied.append("minimal root: /usr, the Python installation, the venv and the labsim "
                   "package, read-only; no solutions, no other submissions, no /sys")
    (root / "proc").mkdir()
    _mount("-t", "proc", "-o", "nosuid,nodev,noexec", "proc", str(root / "proc"))
    _tmpfs(root / "dev", 1 << 20)
    for dev in DEVICES:
        (root / "dev" / dev).touch()
        _mount("--bind", f"/dev/{dev}", str(root / "dev" / dev))
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        (root / "dev" / name).symlink_to(target)
    _tmpfs(root / "dev" / "shm", cfg["shm_bytes"], "1777")
    applied.append("fresh /proc; private /dev (null, zero, full, random, urandom) and "
                   "/dev/shm; private /tmp")
    run = root / RUN.lstrip("/")
    _tmpfs(run, cfg["run_bytes"], "755")
    for sub in ("work", "home", "out", "live"):
        (run / sub).mkdir()
        os.chmod(run / sub, 0o777)
    _bind_ro(cfg["in"], run / "in")
    (root / ".old").mkdir()
    os.chdir(root)
    _run("pivot_root", ".", ".old")
    os.chdir("/")
    _run("umount", "-l", "/.old")
    os.rmdir("/.old")
    _mount("-o", "remount,ro,bind", "/")
    applied.append("the file system is read-only except the run's own tmpfs folders")


def _lo_up() -> None:
    """Bring the namespace's loopback up (``ip``, or an ioctl when ``ip`` is missing)."""
    if shutil.which("ip"):
        _run("ip", "link", "set", "lo", "up")
        return
    import fcntl
    import socket
    import struct

    s = socket.socket()
    fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH14x", b"lo", 0x1 | 0x8 | 0x40))
    s.close()


def _feed(fd: int, data: bytes) -> None:
    """Write ``data`` into the pipe ``fd`` and close it (the checks' inputs, to nbval)."""
    with os.fdopen(fd, "wb", buffering=0) as pipe:
        try:
            view = memoryview(data)
            while view:
                view = view[pipe.write(view):]
        except (BrokenPipeError, OSError):
            pass


def _reader(fd: int, sink: list[bytes]) -> None:
    """Read nbval's records from ``fd`` until it closes, keeping at most the limit."""
    total = 0
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while True:
            chunk = pipe.read(65536)
            if not chunk:
                return
            if total < RECORD_LIMIT_BYTES:
                sink.append(chunk[:RECORD_LIMIT_BYTES - total])
            total += len(chunk)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (orphans come back to this process: it is a subreaper)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_all(proc: subprocess.Popen, isolate: bool) -> None:
    if isolate:  # PID 1 of the namespace: -1 is every other process in it
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    else:
        for _ in range(3):  # a process may fork while we kill: look again
            for pid in _descendants(os.getpid()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process stuck in the kernel
        pass
    while True:  # reap the orphans that came back to us
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break


def _export(src: Path, outfd: int, name: str, limit: int) -> bool:
    """Copy the regular file ``src`` (not a link, at most ``limit`` bytes) into ``outfd``."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return False
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        return False
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                  dir_fd=outfd)
    with os.fdopen(out, "wb") as fh:
        fh.write(data)
    return True


def _write(outfd: int, name: str, data: bytes) -> None:
    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644,
                  dir_fd=outfd)
    with os.fdopen(out, "wb") as fh:
        fh.write(data)


def main(config: str) -> int:
    cfg = json.loads(Path(config).read_text())
    _nodump()
    # the checks' inputs: read now, before the learner's root hides the grader's folder; they
    # reach nbval through a pipe and each collector's folder only while it runs
    secret = Path(cfg["secret"]).read_bytes() if cfg.get("secret") else b""
    isolate = bool(cfg["isolate"])
    applied: list[str] = []
    missing: list[str] = list(cfg.get("missing", []))
    outfd = os.open(cfg["out"], os.O_RDONLY | os.O_DIRECTORY)
    if isolate:
        _build_root(cfg, applied)
        _lo_up()
        applied.append("network: only the run's own loopback")
        folder, infolder = Path(RUN), Path(RUN) / "in"
        work, home, out = folder / "work", folder / "home", folder / "out"
    else:
        try:  # orphans of the run come back to this process, to be ended with it
            ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            pass
        folder = Path(cfg["folder"]) / "box"
        shutil.copytree(cfg["in"], folder / "in")
        infolder = folder / "in"
        work, home, out = folder / "work", folder / "home", folder / "out"
        for d in (work, home, out, folder / "tmp", folder / "live"):
            d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(infolder / "graded.ipynb", work / "graded.ipynb")
    startup = home / ".ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    shutil.copyfile(infolder / "startup.py", startup / "00-labsim-grade.py")
    owner = cfg.get("owner")
    if owner is not None:  # this process is root: the learner's uid must own its folders
        for top in (work, home, out, folder / "live"):
            for dirpath, dirnames, filenames in os.walk(top):
                for name in (dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)):
                    os.chown(name, owner, owner)
    env = {k: v.replace("{folder}", str(folder)) for k, v in cfg["env"].items()}
    argv = [a.replace("{folder}", str(folder)) for a in cfg["argv"]]
    prefix: list[str] = list(cfg.get("learner", []))
    if isolate:
        applied.append(f"the notebook runs as uid {LEARNER_UID} of a nested user namespace, "
                       "with no capabilities and no further user namespaces")
    limits = [f"--{k}={v}" for k, v in cfg["rlimits"].items()]
    if cfg.get("prlimit"):
        prefix += ["prlimit", *limits, "--"]
        applied.append("limits: " + ", ".join(f"{k} {v}" for k, v in cfg["rlimits"].items()))
    read_fd, write_fd = os.pipe()
    env["LABSIM_GRADE_REPORT_FD"] = str(write_fd)
    inputs_read, inputs_write = os.pipe()
    env["LABSIM_GRADE_INPUTS_FD"] = str(inputs_read)
    records: list[bytes] = []
    start = time.monotonic()
    with open(work / "pytest.log", "wb") as log:
        proc = subprocess.Popen([*prefix, *argv], cwd=work, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT,
                                pass_fds=(write_fd, inputs_read),
                                start_new_session=not isolate)
    os.close(write_fd)
    os.close(inputs_read)
    feeder = threading.Thread(target=_feed, args=(inputs_write, secret), daemon=True)
    feeder.start()
    reader = threading.Thread(target=_reader, args=(read_fd, records), daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(1.0, cfg["notebook_s"] - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        timed_out = True
    returncode = proc.poll()
    _kill_all(proc, isolate)
    reader.join(timeout=5)
    _write(outfd, "records.jsonl", b"".join(records))
    exported = [name for name in cfg["exports"]
                if _export(out / name, outfd, name, cfg["export_bytes"])]
    _export(work / "pytest.log", outfd, "pytest.log", cfg["export_bytes"])
    report = {"isolated": isolate, "applied": applied, "missing": missing,
              "timed_out": timed_out, "returncode": None if timed_out else returncode,
              "wall_s": round(time.monotonic() - start, 3), "exported": exported}
    _write(outfd, "jail.json", json.dumps(report).encode())
    os.close(outfd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
