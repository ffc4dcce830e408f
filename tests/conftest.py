"""Shared fixtures: a tiny course (one solution notebook) built with the real pipeline."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (like PYTHONHASHSEED=0 in tasks.py), so a
# failure in CI reproduces anywhere; HYPOTHESIS_PROFILE=explore draws new ones each run.
settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))

ROOT = Path(__file__).resolve().parents[1]

# Notebook kernels started by the tests must import this checkout's labsim.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
)
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Notebooks (nbval items), multi-process and browser tests are slow too, so that
    ``pytest -m "not slow"`` is the fast part of the suite."""
    for item in items:
        if (item.path.suffix == ".ipynb" or item.get_closest_marker("multiprocess")
                or item.get_closest_marker("browser")):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """A solution notebook's cell that passed but wrote to stderr fails: a warning a learner
    cannot act on is noise in their lab (nbval keeps each cell's outputs on the item)."""
    outcome = yield
    report = outcome.get_result()
    if (call.when != "call" or report.outcome != "passed" or item.path.suffix != ".ipynb"
            or item.path.parent.name != "solutions"):
        return
    noise = [str(o.get("text", "")) for o in getattr(item, "test_outputs", None) or []
             if o.get("output_type") == "stream" and o.get("name") == "stderr"
             and str(o.get("text", "")).strip()]
    if noise:
        report.outcome = "failed"
        report.longrepr = (f"{item.name} wrote to stderr (a warning or message the learner "
                           f"cannot act on; fix its cause or silence it where it is made):\n"
                           + "".join(noise)[-2000:])


def load_benchmark(name: str) -> object:
    """The script ``benchmarks/<name>.py`` as a module (its functions, without running it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"benchmark_{name}",
                                                  ROOT / "benchmarks" / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def solution_text(name: str) -> str:
    """Every cell's source of ``solutions/<name>``, cells joined by newlines: what a test
    checks a lab's prose against."""
    nb = json.loads((ROOT / "solutions" / name).read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"])


def make_notebook(cells: list[tuple[str, str] | tuple[str, str, dict]]) -> nbformat.NotebookNode:
    """Build a notebook from (kind, source[, metadata]) tuples; kind is 'code' or 'markdown'."""
    nb = nbformat.v4.new_notebook()
    for spec in cells:
        kind, source = spec[0], spec[1]
        meta = spec[2] if len(spec) > 2 else {}
        maker = nbformat.v4.new_code_cell if kind == "code" else nbformat.v4.new_markdown_cell
        nb.cells.append(maker(source, metadata=meta))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    return nb


TINY_LAB = [
    ("markdown", "# Tiny lab\nAdding and scaling."),
    ("code", "from labsim import checks as check\nimport labsim.checks._tiny"),
    ("code", 'def add(a, b):\n    """Return a + b."""\n    ### BEGIN SOLUTION\n'
             "    return a + b\n    ### END SOLUTION"),
    ("code", "# NBVAL_CHECK_OUTPUT\ncheck._tiny.add(add)", {"points": 2}),
    ("code", "class Ops:\n    def scale(self, x, k):\n        \"\"\"x times k.\"\"\"\n"
             "        ### BEGIN SOLUTION\n        return x * k\n        ### END SOLUTION\n\n\n"
             "scale = Ops().scale"),
    ("code", "# NBVAL_CHECK_OUTPUT\ncheck._tiny.scale(scale)"),
    ("code", "print('only in the solution')", {"tags": ["solution-only"]}),
    ("code", "# NBVAL_IGNORE_OUTPUT\nprint(add(4, 5))"),
]


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


@pytest.fixture()
def tiny_course(tmp_path: Path) -> tuple[Path, Path]:
    """(solutions_dir, labs_dir) holding one unreleased solution notebook, 00_tiny."""
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    solutions.mkdir()
    labs.mkdir()
    nbformat.write(make_notebook(TINY_LAB), solutions / "00_tiny.ipynb")
    return solutions, labs


def links_times(cluster, factor: float):
    """``cluster`` with its node links and NICs ``factor`` times as fast (NCCL's view of them
    too): ``benchmarks/collectives.py``'s own, which counts what that makes slower."""
    return load_benchmark("collectives").links_times(cluster, factor)
