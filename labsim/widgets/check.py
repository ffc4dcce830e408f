"""The "Check my notebook" button at the end of every lab: ``labsim check`` from inside the
notebook, which is what works on Colab and Binder as well as in JupyterLab.

Run All only shows the button.  Pressing it finds the notebook this kernel runs -- JupyterLab
and Notebook 7 name it in ``JPY_SESSION_NAME``, VS Code in ``__vsc_ipynb_file__``; Colab hands
its content over (saved to a temporary file) -- makes sure the saved file is what the kernel
ran (a function changed and run but not saved would be checked in its old form), then runs
``python -m labsim check`` on it in a separate process and prints its lines below the button:
the grader's own verdict on every check (``labsim.course.selfcheck``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _labs() -> Path:
    import labsim

    return Path(labsim.__file__).resolve().parent / "data" / "labs"


def _shell() -> Any:
    try:
        return get_ipython()  # type: ignore[name-defined]  # noqa: F821
    except NameError:
        return None


def current_notebook() -> tuple[Path | None, str]:
    """The notebook this kernel runs, as a file: (path, "") or (None, why it was not found)."""
    session = os.environ.get("JPY_SESSION_NAME", "")
    if session and Path(session).is_file():
        return Path(session), ""
    ip = _shell()
    vsc = ip.user_ns.get("__vsc_ipynb_file__") if ip is not None else None
    if vsc and Path(vsc).is_file():
        return Path(vsc), ""
    if "google.colab" in sys.modules:
        try:
            from google.colab import _message  # type: ignore[import-not-found]

            nb = _message.blocking_request("get_ipynb", request="", timeout_sec=60)["ipynb"]
        except Exception as exc:  # noqa: BLE001 - Colab's private API: say what failed
            return None, f"Colab did not hand over the notebook ({type(exc).__name__})"
        path = Path(tempfile.mkdtemp(prefix="labsim-check-")) / _name_of(nb)
        path.write_text(json.dumps(nb), encoding="utf-8")
        return path, ""
    return None, ("this front end does not say which notebook it runs: run `labsim check "
                  "NOTEBOOK` in a terminal, or pass the file: check_notebook(\"path\")")


def _name_of(nb: dict) -> str:
    """The course lab whose cells a notebook has (its file name), else a neutral name."""
    ids = {c.get("id") for c in nb.get("cells", [])}
    for candidate in sorted(_labs().glob("*.ipynb")):
        lab = json.loads(candidate.read_text(encoding="utf-8"))
        if {c.get("id") for c in lab["cells"]} & ids:
            return candidate.name
    return "notebook.ipynb"


def unsaved_changes(path: Path) -> list[str]:
    """Functions defined in this kernel by a notebook cell whose source is not in the saved
    notebook: run but not saved (by name)."""
    import inspect

    ip = _shell()
    if ip is None:
        return []
    cells = json.loads(Path(path).read_text(encoding="utf-8")).get("cells", [])
    saved = "\n".join("".join(c["source"]) if isinstance(c.get("source"), list)
                      else str(c.get("source", "")) for c in cells
                      if c.get("cell_type") == "code")
    changed = []
    for name, value in list(ip.user_ns.items()):
        if name.startswith("_") or not inspect.isfunction(value):
            continue
        if getattr(value, "__module__", "") != "__main__":
            continue
        try:
            source = inspect.getsource(value)
        except (OSError, TypeError):
            continue
        if re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\b", saved, flags=re.M) and (
                source.strip() not in saved):
            changed.append(name)
    return sorted(changed)


@dataclass
class CheckRun:
    """What a check of the notebook printed, line by line, and whether every check passed."""

    lines: list[str] = field(default_factory=list)
    ok: bool = False

    def __repr__(self) -> str:
        return "\n".join(self.lines)


def check_notebook(path: str | Path | None = None, *, timeout_cell: float = 300.0,
                   on_line: Callable[[str], Any] | None = None) -> CheckRun:
    """Check this notebook (or ``path``) the way the grader will: ``labsim check`` in a
    process of its own on the saved notebook (save first: Ctrl+S); each line of its report
    goes to ``on_line`` as it comes (the button's output area) and into the result."""
    run = CheckRun()

    def say(line: str) -> None:
        run.lines.append(line)
        if on_line is not None:
            on_line(line + "\n")

    if path is None:
        found, why = current_notebook()
        if found is None:
            say(f"labsim check: {why}")
            return run
        if "google.colab" not in sys.modules:
            stale = unsaved_changes(found)
            if stale:
                say(f"labsim check: the saved notebook differs from what this kernel ran "
                    f"({', '.join(stale[:4])}): save it (Ctrl+S), then check again")
                return run
    else:
        found = Path(path)
    say(f"checking {found.name} as the grader will: a fresh kernel runs it top to bottom "
        "(about as long as Run All)...")
    env = {k: v for k, v in os.environ.items() if k not in ("JPY_SESSION_NAME", "MPLBACKEND")}
    proc = subprocess.Popen([sys.executable, "-m", "labsim", "check", str(found),
                             f"--timeout-cell={timeout_cell:g}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if not line.startswith("checking "):
            say(line.rstrip("\n"))
    run.ok = proc.wait() == 0
    return run


def check_button(path: str | Path | None = None) -> Any:
    """The button (and the output area under it) that runs ``check_notebook``."""
    import ipywidgets as widgets

    button = widgets.Button(description="Check my notebook", icon="check",
                            layout=widgets.Layout(width="auto"),
                            tooltip="save first (Ctrl+S); runs the notebook in a fresh kernel "
                                    "and judges every check as the grader will")
    output = widgets.Output()

    def on_click(_: Any) -> None:
        button.disabled = True
        output.clear_output()
        try:
            check_notebook(path, on_line=output.append_stdout)
        finally:
            button.disabled = False

    button.on_click(on_click)
    return widgets.VBox([button, output])


__all__ = ["CheckRun", "check_button", "check_notebook", "current_notebook",
           "unsaved_changes"]
