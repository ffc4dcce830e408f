"""The README's main command, as a newcomer runs it: from a fresh clone, ``python3 tasks.py lab``
sets everything up and serves ``labs/`` in JupyterLab (as root too, with no browser to open).

The clone is of this checkout's last commit (what CI clones); the test waits until the server
answers, lists the served folder and opens a lab through JupyterLab's REST API, then stops the
command as a learner does, with Ctrl-C (SIGINT), and checks nothing is left running.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import ROOT

SETUP_PATIENCE_S = 1500  # a fresh virtual environment: torch, JupyterLab and the course


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_readme_main_command_serves_the_labs_from_a_fresh_clone(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "python3 tasks.py lab" in readme  # the command this test runs is the README's
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    port, token = _free_port(), secrets.token_hex(8)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.pop("DISPLAY", None)  # no browser to open: the command must say so and print the URL
    log_path = tmp_path / "lab.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["python3", "tasks.py", "lab", f"--port={port}", "--ip=127.0.0.1",
             f"--IdentityProvider.token={token}", "--LabApp.news_url="],
            cwd=clone, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    base = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + SETUP_PATIENCE_S
        while True:
            try:
                _get(f"{base}/status?token={token}")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("JupyterLab did not start:\n"
                                + log_path.read_text(errors="replace")[-3000:])
                time.sleep(1)
        listing = _get(f"{base}/contents?token={token}")
        names = {item["name"] for item in listing["content"]}
        assert {p.name for p in (clone / "labs").glob("*.ipynb")} <= names
        lab = _get(f"{base}/contents/00_why_gpus.ipynb?token={token}")
        assert lab["type"] == "notebook" and lab["content"]["cells"]
        output = log_path.read_text(errors="replace")
        assert f"127.0.0.1:{port}" in output and token in output  # the URL a learner opens
        # what every lab's opening tells the learner, typed in JupyterLab's own terminal
        said = _in_terminal(port, token, "labsim check 00_why_gpus.ipynb",
                            until="checks pass", timeout_s=600)
        checks = _check_names(clone / "labs" / "00_why_gpus.ipynb")
        assert f"0 of {len(checks)} checks pass; next: {checks[0]}" in said, said[-3000:]
        assert f"TODO  {checks[0]}: not started" in said
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            assert "--allow-root" in output
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        # the server stops its kernels and terminals first: over 60 s once with both cores
        # loaded by the rest of the suite
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 30  # exited processes may take a moment to be reaped
    while _alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(proc.pid), "processes of the lab command outlived Ctrl-C"
    assert (clone / ".venv").is_dir()  # the clone set itself up, in its own environment


def _check_names(lab: Path) -> list[str]:
    """The names of a released lab's checks, in order (as its check cells record them)."""
    cells = json.loads(lab.read_text(encoding="utf-8"))["cells"]
    return [c["metadata"]["labsim"]["check"].split(":")[-1] for c in cells
            if c["metadata"].get("labsim", {}).get("role") == "check"]


def _in_terminal(port: int, token: str, command: str, until: str, timeout_s: float) -> str:
    """Open a terminal in the running JupyterLab (its REST API and websocket, as the browser
    does), type ``command`` and return what it printed up to a line containing ``until``."""
    import asyncio
    import urllib.request

    from tornado.websocket import websocket_connect

    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/terminals?token={token}",
                                     data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=30) as reply:
        name = json.loads(reply.read())["name"]

    async def talk() -> str:
        ws = await websocket_connect(
            f"ws://127.0.0.1:{port}/terminals/websocket/{name}?token={token}")
        await ws.write_message(json.dumps(["stdin", command + "\r"]))
        seen = ""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                message = await asyncio.wait_for(ws.read_message(),
                                                 max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:  # the caller's assertion shows what was printed
                break
            if message is None:
                break
            kind, *rest = json.loads(message)
            if kind == "stdout":
                seen += "".join(rest)
                if until in seen.split(command, 1)[-1]:
                    break
        ws.close()
        return seen

    return asyncio.run(talk())


def test_terminals_start_with_the_environment_active(tmp_path: Path) -> None:
    """A terminal started as JupyterLab starts it finds the environment's commands first, even
    after a start-up file that sets PATH afresh (as Debian's /etc/profile does)."""
    import importlib.util
    import shutil

    if shutil.which("bash") is None:
        pytest.skip("no bash here: JupyterLab's default shell is used")
    spec = importlib.util.spec_from_file_location("tasks", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "activate").write_text(f'export PATH="{prefix / "bin"}:$PATH"\n')
    tool = prefix / "bin" / "labsim"
    tool.write_text("#!/bin/sh\necho course-labsim\n")
    tool.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("export PATH=/usr/bin:/bin\n")  # a PATH set afresh
    shell = tasks.terminal_shell(prefix)
    flag = next(a for a in tasks._lab_command(prefix / "bin" / "python", [])
                if a.startswith("--ServerApp.terminado_settings=shell_command="))
    assert shlex.split(flag.split("=", 2)[2]) == shell  # what JupyterLab is told to start
    out = subprocess.run([*shell, "-c", "labsim"], env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.stdout.strip().endswith("course-labsim"), out.stderr


def test_lab_overrides_merge_into_an_environment(tmp_path: Path) -> None:
    """The JupyterLab defaults tasks.py writes (widget state saved with notebooks) merge with
    what the environment's overrides.json already says."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tasks", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    path = tmp_path / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"other:plugin": {"x": 1}}))
    assert tasks.write_lab_overrides(tmp_path) == path
    written = json.loads(path.read_text())
    assert written["other:plugin"] == {"x": 1}
    assert written["@jupyter-widgets/jupyterlab-manager:plugin"]["saveState"] is True
    assert "write_lab_overrides" in (ROOT / "binder" / "postBuild").read_text()
