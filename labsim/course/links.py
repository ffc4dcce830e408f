"""Where the course lives online: the repository, its Colab and Binder links, and the setup
cell that opens every lab.

Forks change ``REPOSITORY`` (and the README badges, which a test checks against it).

``RELEASE`` is the git ref of the course that learners get: the badges open the notebooks at
it and the Colab setup cell installs the package from it, so notebook and package are always
the same version.  It is the ``main`` branch until a release is made: ``python3 tasks.py
release X.Y.Z`` sets it to the tag ``vX.Y.Z``, rewrites the setup cell of every lab and the
README's badges, commits and makes the tag (``git push origin main vX.Y.Z`` publishes both; a
test fails while the ref is missing from the repository).
"""

from __future__ import annotations

import importlib.metadata
import sys
from urllib.parse import quote

REPOSITORY = "gpu-training-lab/labsim"  # GitHub owner/name
RELEASE = "main"  # the git ref learners get (module docstring): a branch or a release tag

SETUP_CELL = (
    "# Setup: on Colab this installs the course (the version this notebook is); elsewhere it "
    "does nothing.\n"
    "import sys\n"
    'if "google.colab" in sys.modules:\n'
    f'    %pip install -q "labsim[check] @ git+https://github.com/{REPOSITORY}@{RELEASE}"\n'
    "    from labsim.course.links import restart_note\n"
    "    print(restart_note())"
)
"""The first code cell of every lab.  On Colab it installs the course at ``RELEASE`` with the
core dependencies and the ``check`` extra (what ``labsim check`` needs to run a notebook,
with no version pinned above what Colab ships), whose ranges Colab's preinstalled torch,
ipykernel and ipywidgets satisfy (so none is upgraded), and says whether the runtime must be
restarted.  The
requirement is quoted because ``%pip`` lines pass through a shell, where a bare ``>=`` or
``@`` could be misread."""

# packages a notebook runtime has loaded before the setup cell runs: an install that changes
# one of them takes effect only after a restart
_LOADED = {"numpy": "numpy", "torch": "torch", "ipywidgets": "ipywidgets",
           "matplotlib": "matplotlib", "ipykernel": "ipykernel", "PIL": "pillow"}


def restart_note(loaded: dict[str, str] | None = None) -> str:
    """One line for the setup cell: whether the packages this runtime had already imported
    (``loaded``: module name -> version; default: what ``sys.modules`` holds) still match what
    is installed, or which changed and that the runtime must be restarted."""
    if loaded is None:
        loaded = {m: str(getattr(sys.modules[m], "__version__", ""))
                  for m in _LOADED if m in sys.modules}
    changed = []
    for module, version in sorted(loaded.items()):
        try:
            installed = importlib.metadata.version(_LOADED.get(module, module))
        except importlib.metadata.PackageNotFoundError:
            continue
        if version and installed.split("+")[0] != version.split("+")[0]:
            changed.append(f"{module} {version} -> {installed}")
    if changed:
        return ("The install changed packages this runtime had already loaded ("
                + ", ".join(changed) + "): restart the runtime (Runtime > Restart session), "
                "then run the notebook again from the top.")
    return (f"labsim {importlib.metadata.version('labsim')} is installed; nothing this runtime "
            "had loaded was changed, so no restart is needed.")


def write_setup_cells(solutions: str) -> int:
    """Make the first code cell of every solution notebook in ``solutions`` the current
    ``SETUP_CELL`` (after ``RELEASE`` changed); returns how many changed."""
    import json
    from pathlib import Path

    changed = 0
    for path in sorted(Path(solutions).glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        first = next(c for c in nb["cells"] if c["cell_type"] == "code")
        if first["source"] != SETUP_CELL:
            first["source"] = SETUP_CELL
            path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False)
                            + "\n", encoding="utf-8")
            changed += 1
    return changed


def colab_url(notebook: str) -> str:
    """Open ``notebook`` (a path in the repository, e.g. 'labs/00_why_gpus.ipynb') in Colab."""
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/{RELEASE}/{notebook}"


def binder_url(notebook: str) -> str:
    """Open ``notebook`` in JupyterLab on Binder (built from ``binder/``)."""
    return f"https://mybinder.org/v2/gh/{REPOSITORY}/{RELEASE}?labpath={quote(notebook, safe='')}"
