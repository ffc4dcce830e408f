"""Every claim of the source articles is tested in the lab it belongs to.

A lab names a claim by its tag in the markdown of the cell that tests it (``Claim 001-13``),
with the verdict the evidence supports. This table is the course's list of which lab tests
which claim; a lab that exists must name every claim listed for it.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from .conftest import ROOT

CLAIMS_BY_LAB = {
    "00": "000-12 001-1 001-2 001-3 001-5 001-6 001-7 001-8 001-9 002-1 002-2",
    "01": "000-1 001-4 002-Q2",
    "02": "000-2 001-12 002-4 002-11 002-Q2",
    "03": "000-3 001-17 001-18 002-Q2",
    "04": "000-4 001-13 000-Q2",
    "05": "000-10 002-10",
    "06": "000-9 000-Q1 002-8 002-Q1",
    "07": "000-5 001-5 001-19",
    "08": "000-5 000-8 000-11 001-10 002-4 002-5",
    "09": "000-6 002-4 002-Q2",
    "10": "000-7 001-11 002-5",
    "11": "000-7 001-11",
    "12": "001-14",
    "13": "",  # mixture of experts: beyond the source articles, every statement cited
    "14": "",  # long context: beyond the source articles, every statement cited
    "15": "000-12 000-13 001-15 001-16 001-20 001-21 002-3 002-6 002-7 002-9 002-10",
}
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_each_lab_names_every_claim_it_must_test(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    named = set(re.findall(r"Claim (\d{3}-(?:Q)?\d+)", text))
    missing = sorted(set(CLAIMS_BY_LAB[path.stem[:2]].split()) - named)
    assert not missing, f"{path.name} does not test claims {missing}"
