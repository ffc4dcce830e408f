"""Set up the course and run it: ``python3 tasks.py lab`` or ``python3 tasks.py test``.

One file, standard library only, so a fresh machine with nothing but Python and pip can run
it.  Both commands create ``.venv/`` beside this file (once), install the course into it and
then either open JupyterLab on ``labs/`` (its terminals find ``labsim`` on their PATH) or run
the whole test suite.  ``python3 tasks.py release X.Y.Z`` makes a release: the version, the
git ref the labs install from and open at (``labsim/course/links.py``), the labs and the
README's badges, one commit and the tag ``vX.Y.Z``.

torch: when the virtual environment has no torch yet, ``torch==2.13.0`` is installed first
(the version the course is tested with; where a local wheel of it is on pip's search path it
comes from there in seconds).  If that exact version has no wheel for your platform, the
newest torch your pip finds is installed instead.  A torch you already have is kept.
"""

from __future__ import annotations

import os
import shlex
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


def terminal_shell(prefix: Path) -> list[str] | None:
    """The shell command of the terminals JupyterLab opens: bash with the course's environment
    active, or None where there is no bash (Windows: JupyterLab's default shell).

    JupyterLab starts a *login* shell when it was not started from a terminal, and a login
    shell reads /etc/profile, which on Debian and Ubuntu sets PATH afresh: ``labsim`` would not
    be found. This bash reads the usual start-up files through an rc file written to
    ``<prefix>/etc/labsim/terminal.bashrc``, then activates ``prefix`` (the virtual
    environment)."""
    bash = shutil.which("bash")
    if os.name == "nt" or bash is None:
        return None
    rc = prefix / "etc" / "labsim" / "terminal.bashrc"
    rc.parent.mkdir(parents=True, exist_ok=True)
    rc.write_text("# The course's JupyterLab terminal: the usual start-up, then its environment.\n"
                  "[ -r /etc/profile ] && . /etc/profile\n"
                  "[ -r ~/.bashrc ] && . ~/.bashrc\n"
                  f". {shlex.quote(str(prefix / 'bin' / 'activate'))}\n")
    return [bash, "--rcfile", str(rc), "-i"]


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
    open, so the URL JupyterLab prints (with its token) is the way in. Its terminals run
    ``terminal_shell``."""
    cmd = [str(py), "-m", "jupyterlab", "--notebook-dir=labs", *argv]
    shell = terminal_shell(py.parent.parent)
    if shell is not None and not any("terminado_settings" in a for a in argv):
        cmd.append(f"--ServerApp.terminado_settings=shell_command={shlex.join(shell)}")
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
    env = lab_environment(py)
    server = subprocess.Popen(cmd, env=env)
    try:
        return server.wait()
    except KeyboardInterrupt:  # Ctrl-C reached JupyterLab too: let it shut down, then go
        return stop(server)


def lab_environment(py: Path) -> dict[str, str]:
    """JupyterLab's environment: the virtual environment's ``bin`` first on PATH, so the
    terminals JupyterLab opens (in ``labs/``) run the course's ``labsim`` as the labs say."""
    bin_dir = str(py.parent)
    path = os.environ.get("PATH", "")
    return dict(os.environ, JUPYTER_PLATFORM_DIRS="1", VIRTUAL_ENV=str(VENV),
                PATH=os.pathsep.join([bin_dir, *(p for p in path.split(os.pathsep)
                                                 if p and p != bin_dir)]))


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


def release(argv: list[str]) -> int:
    """``release X.Y.Z``: the version in pyproject.toml and labsim, ``links.RELEASE`` =
    ``vX.Y.Z``, every lab's setup cell and the README's badges at that tag, the labs
    released again (without running them), one commit, the annotated tag.  Needs a clean
    working tree; ``git push origin main vX.Y.Z`` publishes the commit and the tag."""
    import re

    if len(argv) != 1 or not re.fullmatch(r"\d+\.\d+\.\d+", argv[0]):
        print("usage: python3 tasks.py release X.Y.Z")
        return 2
    version, tag = argv[0], f"v{argv[0]}"
    git = ["git", "-C", str(ROOT)]
    if subprocess.run([*git, "status", "--porcelain"], capture_output=True,
                      text=True).stdout.strip():
        print("release: the working tree has changes; commit them first")
        return 2
    if subprocess.run([*git, "rev-parse", "--verify", "--quiet", f"refs/tags/{tag}"],
                      capture_output=True).returncode == 0:
        print(f"release: the tag {tag} exists already")
        return 2
    py = setup("lab,grade")
    edits = {
        ROOT / "pyproject.toml": (r'(?m)^version = "[^"]+"', f'version = "{version}"'),
        ROOT / "labsim" / "__init__.py": (r'__version__ = "[^"]+"', f'__version__ = "{version}"'),
        ROOT / "labsim" / "course" / "links.py": (r'(?m)^RELEASE = "[^"]+"',
                                                  f'RELEASE = "{tag}"'),
    }
    old_ref = re.search(r'(?m)^RELEASE = "([^"]+)"',
                        (ROOT / "labsim" / "course" / "links.py").read_text()).group(1)
    for path, (pattern, new) in edits.items():
        text, n = re.subn(pattern, new, path.read_text())
        if n != 1:
            print(f"release: {path} has no line matching {pattern}")
            return 1
        path.write_text(text)
    readme = ROOT / "README.md"
    readme.write_text(readme.read_text().replace(f"/blob/{old_ref}/", f"/blob/{tag}/")
                      .replace(f"/labsim/{old_ref}?labpath=", f"/labsim/{tag}?labpath="))
    _run(py, "-c", "from labsim.course.links import write_setup_cells; "
         "write_setup_cells('solutions')", cwd=ROOT)
    _run(py, "-m", "labsim", "release", "--no-execute", cwd=ROOT)
    _run(*git, "commit", "-qam", f"Release {version}")
    _run(*git, "tag", "-a", tag, "-m", f"Release {version}")
    print(f"released {tag}: publish it with `git push origin main {tag}`")
    return 0


COMMANDS = {"lab": lab, "test": test, "release": release}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(__doc__)
        print("usage: python3 tasks.py {lab|test|release} [extra arguments]")
        return 2
    return COMMANDS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
