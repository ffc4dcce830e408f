"""How far to trust a simulated step time: error bands measured on stacks the model never saw.

A software profile's sustained fraction is fitted on published runs of that stack, so a
held-out run of the same stack is not unseen.  ``benchmarks/step.py --leave-one-stack-out``
predicts every run of each fitted stack with that stack's fraction replaced by the mean of the
other stacks' (docs/step.md section 3, "Leave one stack out") and writes the median and the
largest |predicted / measured - 1| per profile to ``data/step_bands.json``.  ``error_band``
reads it: a profile of a fitted stack gets its stack's figures; ``generic`` and a profile of
one's own get every stack's runs, each stack left out in turn.

The band says how far runs *like the published ones* (dense transformers on A100 / H100
clusters, 2021-2024 software) landed; a configuration unlike all of them can miss by more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from labsim.software import SoftwareProfile

__all__ = ["ErrorBand", "error_band"]


@dataclass(frozen=True)
class ErrorBand:
    """``typical``: median |error| (a fraction: 0.04 is 4 %); ``worst``: the largest; over
    ``runs`` published runs; ``basis``: which runs, with which stack left out of the fit."""

    typical: float
    worst: float
    runs: int
    basis: str

    def range_s(self, seconds: float) -> tuple[float, float]:
        """``seconds`` minus and plus the typical error."""
        return seconds * (1 - self.typical), seconds * (1 + self.typical)

    def describe(self) -> str:
        """"typically ±4 %, up to ±22 % (56 published runs, every fitted stack left out in
        turn)"."""
        return (f"typically ±{self.typical:.0%}, up to ±{self.worst:.0%} ({self.runs} "
                f"published runs, {self.basis})")


@lru_cache(maxsize=1)
def _bands() -> dict[str, ErrorBand]:
    text = resources.files("labsim").joinpath("data/step_bands.json").read_text("utf-8")
    return {name: ErrorBand(b["typical"], b["worst"], b["runs"], b["basis"])
            for name, b in json.loads(text)["profiles"].items()}


def error_band(software: str | SoftwareProfile) -> ErrorBand:
    """The step-time error band for plans run with ``software`` (a profile or its name)."""
    name = software.name if isinstance(software, SoftwareProfile) else str(software)
    bands = _bands()
    return bands.get(name, bands["*"])
