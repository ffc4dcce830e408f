"""Binder's configuration, installed as repo2docker would into a fresh virtual environment,
gives a CPU-only torch and runs a lab top to bottom (well under Binder's memory)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import urllib.request
import venv
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.slow

LAB = ROOT / "solutions" / "00_why_gpus.ipynb"
BINDER_MEMORY_BYTES = 1.5e9


def _reachable(url: str, timeout_s: float = 5.0) -> bool:
    try:
        urllib.request.urlopen(url, timeout=timeout_s)
        return True
    except OSError:
        return False


def _requirements(tmp_path: Path) -> Path:
    """binder/requirements.txt; where PyTorch's wheel page cannot be reached (a machine whose
    network allows only package indexes), without its --find-links line, so the same pinned
    CPU wheel comes from the indexes pip is configured with."""
    path = ROOT / "binder" / "requirements.txt"
    lines = path.read_text().splitlines()
    links = [ln.split(maxsplit=1)[1] for ln in lines if ln.startswith("--find-links")]
    if all(_reachable(u) for u in links):
        return path
    copy = tmp_path / "requirements.txt"
    copy.write_text("\n".join(ln for ln in lines if not ln.startswith("--find-links")) + "\n")
    return copy


@pytest.mark.skipif(sys.platform != "linux", reason="Binder images are Linux")
def test_binder_requirements_give_cpu_torch_and_run_a_lab(tmp_path: Path) -> None:
    env_dir = tmp_path / "binder-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "-r", str(_requirements(tmp_path))], cwd=ROOT, check=True, timeout=1500)
    probe = subprocess.run(
        [str(py), "-c", "import torch, labsim; print(torch.__version__, torch.version.cuda, "
                        "torch.cuda.is_available())"],
        capture_output=True, text=True, check=True, cwd=tmp_path)
    version, cuda, available = probe.stdout.split()
    assert version.endswith("+cpu") and cuda == "None" and available == "False", probe.stdout
    runner = textwrap.dedent(f"""
        import resource, nbformat
        from nbclient import NotebookClient
        nb = nbformat.read({str(LAB)!r}, as_version=4)
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={{"metadata": {{"path": {str(LAB.parent)!r}}}}}).execute()
        print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's labsim only
    env["MPLBACKEND"] = "Agg"
    run = subprocess.run([str(py), "-c", runner], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    peak_bytes = float(run.stdout.split()[-1])
    assert peak_bytes < BINDER_MEMORY_BYTES, f"kernel peak {peak_bytes / 1e6:.0f} MB"
