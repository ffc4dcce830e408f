"""Every lab reads as the same kind of handout (docs/authoring.md, "A lab's handout").

The opening cell gives the title, what you will build, about how long it takes, the hardware it
uses and what changes on a GPU, and how to check your work; the Colab setup cell comes right
after it; sections are numbered; a Summary and a few Questions close the lab, and its last cell
links to the next one.  A claim tag's first appearance links to the README's table of source
articles, and no internal words reach the learner.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
CLAIM_TAG = re.compile(r"\b00[0-2]-Q?\d+\b")
SOURCE_LINK = "../README.md#the-source-articles"
INTERNAL_WORDS = re.compile(r"\bseeds?\b|\bseed's\b|\bissue \d+\b", re.I)
FIXED_HEADINGS = ("On a GPU node", "Summary", "Questions", "Check your notebook")


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _src(cell: dict) -> str:
    source = cell["source"]
    return "".join(source) if isinstance(source, list) else source


def _markdown(path: Path) -> list[str]:
    return [_src(c) for c in _cells(path) if c["cell_type"] == "markdown"]


def _headings(path: Path) -> list[str]:
    return [line[3:].strip() for text in _markdown(path) for line in text.splitlines()
            if line.startswith("## ")]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_the_opening_cell_is_the_handout(path: Path) -> None:
    first = _cells(path)[0]
    text = _src(first)
    assert first["cell_type"] == "markdown", "the first cell is the lab's title and opening"
    number = path.stem[:2]
    assert re.match(rf"# Lab {number} — \S", text), f"title must read '# Lab {number} — ...'"
    for label in ("**What you will build**", "**Time:**", "**Hardware:**",
                  "**Checking your work:**"):
        assert label in text, f"the opening names {label}"
    assert f"labsim check {path.name}" in text and "**Check my notebook**" in text
    assert "Run All stops" in text


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_the_setup_cell_follows_the_title(path: Path) -> None:
    second = _cells(path)[1]
    assert second["cell_type"] == "code"
    assert _src(second).startswith("# Setup: on Colab")


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_sections_are_numbered_and_end_with_summary_and_questions(path: Path) -> None:
    heads = _headings(path)
    numbered = [h for h in heads if re.match(r"\d+\. ", h)]
    others = [h for h in heads if h not in numbered]
    assert len(numbered) >= 2
    assert [int(h.split(".")[0]) for h in numbered] == list(range(1, len(numbered) + 1))
    assert set(others) <= set(FIXED_HEADINGS), f"unnumbered sections {others}"
    assert heads[-3:] == ["Summary", "Questions", "Check your notebook"]
    questions = next(t for t in _markdown(path) if t.lstrip().startswith("## Questions"))
    assert len(re.findall(r"^\d+\. ", questions, re.M)) >= 3, "a few questions, numbered"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_the_lab_ends_with_its_self_check(path: Path) -> None:
    """The button that grades the notebook as the grader will is the last code cell."""
    code = [_src(c) for c in _cells(path) if c["cell_type"] == "code"]
    assert code[-1] == ("# NBVAL_IGNORE_OUTPUT\nfrom labsim.widgets.check import "
                        "check_button\n\ncheck_button()")


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_the_last_cell_links_to_the_next_lab(path: Path) -> None:
    last = _cells(path)[-1]
    assert last["cell_type"] == "markdown"
    later = [p for p in SOLUTIONS if p.name > path.name]
    target = later[0].name if later else "../README.md"
    assert f"]({target})" in _src(last), f"the last cell links to {target}"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_a_claim_tag_first_appears_with_its_source(path: Path) -> None:
    tagged = [t for t in _markdown(path) if CLAIM_TAG.search(t)]
    if tagged:
        assert SOURCE_LINK in tagged[0], (
            f"the first cell naming a claim links to [the source articles]({SOURCE_LINK})")
    assert "## The source articles" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_hard_exercises_have_hints_and_no_internal_words_show(path: Path) -> None:
    code = [_src(c) for c in _cells(path) if c["cell_type"] == "code"]
    if any("### BEGIN SOLUTION" in c for c in code):
        assert any("<details>" in t and "Hint" in t for t in _markdown(path))
    for text in _markdown(path):
        assert not INTERNAL_WORDS.search(text), INTERNAL_WORDS.search(text).group(0)
