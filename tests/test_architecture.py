"""docs/architecture.md stays true: every path in its topic table exists, and every module of
the layered folders appears in it (one name per topic, read straight across)."""

from __future__ import annotations

import re

from .conftest import ROOT

DOC = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
PKG = ROOT / "labsim"
TABLE = DOC.split("## Topics × layers", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0]
PATHS = set(re.findall(r"`([\w/]+(?:\.py|/))`", TABLE))


def test_every_path_in_the_table_exists() -> None:
    missing = sorted(p for p in PATHS if not (PKG / p).exists())
    assert PATHS and missing == []


def test_every_topic_module_is_in_the_table() -> None:
    folders = ["", "sim/", "plots/", "widgets/", "experiments/", "checks/", "parallel/"]
    modules = {f"{folder}{p.name}" for folder in folders for p in (PKG / folder).glob("*.py")
               if not p.name.startswith("_")}
    packages = {f"{folder}{p.name}/" for folder in ("", "checks/")
                for p in (PKG / folder).iterdir() if (p / "__init__.py").exists()
                and p.name not in {"sim", "plots", "widgets", "experiments", "checks",
                                   "parallel", "lab", "course", "cli"}}
    assert sorted((modules | packages) - PATHS) == []


def test_rows_read_straight_across() -> None:
    """In each row, every file is named after the row's topic."""
    for line in TABLE.splitlines()[2:]:
        topic, *cells = [c.strip() for c in line.strip("|").split("|")]
        for cell in cells:
            for path in re.findall(r"`([\w/]+(?:\.py|/))`", cell):
                stem = path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".py")
                assert stem == topic, f"row {topic}: {path}"
