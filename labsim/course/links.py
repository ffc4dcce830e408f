"""Where the course lives online: the repository, its Colab and Binder links, and the setup
cell that opens every lab.

Forks change ``REPOSITORY`` (and the README badges, which a test checks against it).
"""

from __future__ import annotations

from urllib.parse import quote

REPOSITORY = "gpu-training-lab/labsim"  # GitHub owner/name
BRANCH = "main"

SETUP_CELL = (
    "# Setup: on Colab this installs the course package; anywhere else it does nothing.\n"
    "import sys\n"
    'if "google.colab" in sys.modules:\n'
    f'    %pip install -q "labsim @ git+https://github.com/{REPOSITORY}"'
)
"""The first code cell of every lab. On Colab it installs the package and keeps Colab's own
torch (labsim accepts any torch >= 2.2); the requirement is quoted because ``!pip`` and
``%pip`` lines pass through a shell, where a bare ``>=`` would be a redirect."""


def colab_url(notebook: str) -> str:
    """Open ``notebook`` (a path in the repository, e.g. 'labs/00_why_gpus.ipynb') in Colab."""
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/{BRANCH}/{notebook}"


def binder_url(notebook: str) -> str:
    """Open ``notebook`` in JupyterLab on Binder (built from ``binder/``)."""
    return f"https://mybinder.org/v2/gh/{REPOSITORY}/{BRANCH}?labpath={quote(notebook, safe='')}"
