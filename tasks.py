"""Set up the course and run it: ``python3 tasks.py lab`` or ``python3 tasks.py test``.

One file, standard library only, so a fresh machine with nothing but Python and pip can run
it.  Both commands create ``.venv/`` beside this file (once), install the course into it and
then either open JupyterLab on ``labs/`` or run the whole test suite.

torch: when the virtual environment has no torch yet, ``torch==2.13.0`` is installed first
(the version the course is tested with; where a local wheel of it is on pip's search path it
comes from there in seconds).  If that exact version has no wheel for your platform, the
newest torch your pip finds is installed instead.  A torch you already have is kept.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
TESTED_TORCH = "torch==2.13.0"


def _python() -> Path:
    sub = "Scripts/python.exe" if os.name == "nt" else "bin/python"
    return VENV / sub


def _run(*args: str | Path, **kwargs) -> None:
    print("+", " ".join(str(a) for a in args), flush=True)
    subprocess.run([str(a) for a in args], check=True, **kwargs)


def _has(python: Path, module: str) -> bool:
    probe = (
        f"import importlib.util, sys; sys.exit(importlib.util.find_spec('{module}') is None)"
    )
    return subprocess.run([str(python), "-c", probe]).returncode == 0


def setup(extras: str) -> Path:
    """Create the virtual environment and install the package with ``extras``."""
    if not _python().exists():
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    py = _python()
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if not _has(py, "torch"):
        try:
            _run(*pip, TESTED_TORCH)
        except subprocess.CalledProcessError:
            print(
                f"{TESTED_TORCH} is not available here; installing the newest torch",
                flush=True,
            )
            _run(*pip, "torch")
    _run(*pip, "-e", f".[{extras}]", cwd=ROOT)
    write_lab_overrides(VENV)
    return py


# JupyterLab defaults for this environment: widget state saved with the notebook, so a saved
# lab reopens showing its explorers' last figures instead of "model not found".
LAB_OVERRIDES = {"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": True}}


def write_lab_overrides(prefix: Path) -> Path:
    """Merge ``LAB_OVERRIDES`` into ``<prefix>/share/jupyter/lab/settings/overrides.json``
    (JupyterLab's per-environment defaults; a user's own settings still win)."""
    import json

    path = prefix / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(path.read_text()) if path.exists() else {}
    for plugin, values in LAB_OVERRIDES.items():
        current.setdefault(plugin, {}).update(values)
    path.write_text(json.dumps(current, indent=2) + "\n")
    return path


def ensure_chromium() -> None:
    """The browser test drives the system's Chromium; install it with apt where we can."""
    if shutil.which("chromium") or Path("/usr/bin/chromium").exists():
        return
    can_apt = shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0
    if not can_apt:
        print("Chromium not found and apt-get unavailable: the browser tests will be skipped "
              "(install Chromium to run them)", flush=True)
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        _run("apt-get", "update", "-qq", env=env, stdout=subprocess.DEVNULL)
        _run("apt-get", "install", "-y", "-qq", "chromium", env=env, stdout=subprocess.DEVNULL)
    except subprocess.CalledProcessError:
        print("could not install Chromium: the browser tests will be skipped", flush=True)


def _lab_command(py: Path, argv: list[str]) -> list[str]:
    """``jupyter lab`` on labs/ as it must run here: as root it needs ``--allow-root`` (every
    container, Binder-like images, CI machines), and with no display there is no browser to
    open, so the URL JupyterLab prints (with its token) is the way in."""
    cmd = [str(py), "-m", "jupyterlab", "--notebook-dir=labs", *argv]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in argv:
        cmd.append("--allow-root")
    headless = sys.platform.startswith("linux") and not (
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    if headless and not any(a.startswith("--no-browser") for a in argv):
        cmd.append("--no-browser")
    return cmd


def lab(argv: list[str]) -> int:
    """Set up, then open JupyterLab on labs/ (extra arguments go to jupyter lab)."""
    py = setup("lab")
    os.chdir(ROOT)
    cmd = _lab_command(py, argv)
    print("+", " ".join(cmd), flush=True)
    if "--no-browser" in cmd:
        print("No browser to open here: open the http://127.0.0.1:... URL that JupyterLab "
              "prints below (it carries the access token). Stop it with Ctrl-C.", flush=True)
    env = dict(os.environ, JUPYTER_PLATFORM_DIRS="1")
    server = subprocess.Popen(cmd, env=env)
    try:
        return server.wait()
    except KeyboardInterrupt:  # Ctrl-C reached JupyterLab too: let it shut down, then go
        return stop(server)


def stop(server: subprocess.Popen, grace_s: float = 15) -> int:
    """Wait for a server that got Ctrl-C; then SIGTERM it, then SIGKILL it, ``grace_s`` apart.
    A Ctrl-C during start-up (jupyter_lsp's ``npm prefix -g`` scan) can leave JupyterLab
    waiting forever at exit for a thread that will not end, deaf to SIGTERM too."""
    for signal_it in (None, server.terminate, server.kill):
        if signal_it is not None:
            signal_it()
        try:
            server.wait(timeout=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue
    server.wait()
    return 0


def test_workers() -> int:
    """Test processes for the suite: one per core, at most 4 (each may run a notebook kernel
    and a launch of two gloo workers; 4 keep it within a laptop's memory)."""
    return max(1, min(4, os.cpu_count() or 1))


def test(argv: list[str]) -> int:
    """Set up, then run the whole test suite (extra arguments go to pytest; ``-n 0`` runs it
    in one process)."""
    py = setup("lab,test")
    ensure_chromium()
    os.chdir(ROOT)
    env = dict(os.environ, PYTHONHASHSEED="0", MPLBACKEND="Agg")
    suites = ["tests"] + (["solutions"] if any(ROOT.glob("solutions/*.ipynb")) else [])
    steps = [
        [py, "-m", "ruff", "check", "labsim", "tests", "benchmarks", "tasks.py"],
        [py, "-m", "pytest", *suites, "--nbval-lax", "--nbval-cell-timeout=300",
         "-p", "no:cacheprovider", "-n", str(test_workers()), "--dist", "loadscope", *argv],
    ]
    for step in steps:
        print("+", " ".join(str(s) for s in step), flush=True)
        rc = subprocess.call([str(s) for s in step], env=env)
        if rc:
            return rc
    return 0


COMMANDS = {"lab": lab, "test": test}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(__doc__)
        print("usage: python3 tasks.py {lab|test} [extra arguments]")
        return 2
    return COMMANDS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
