"""Results recorded on a real GPU by ``benchmarks/gpu_record.py``, for labs run without one.

A lab's GPU cell measures on a CUDA device when there is one; on a CPU it shows what was
recorded instead, labelled with the GPU, driver, CUDA and torch versions and the date, so a
number is never presented as measured here when it was not.  Records are package data
(``labsim/data/gpu_records/NN_topic.json``, one per lab); ``gpu_record`` returns None when a
lab has none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class GpuRecord:
    """One lab's recorded measurements: ``environment`` (gpu, driver, cuda, torch, date) and
    the section's ``results`` as the script wrote them."""

    lab: str
    environment: dict[str, Any]
    results: dict[str, Any]

    @property
    def label(self) -> str:
        """'recorded on NVIDIA H200 (driver 580.x, CUDA 13.0, torch 2.11.0) on 2026-12-01'."""
        e = self.environment
        return (f"recorded on {e.get('gpu') or 'no GPU'} (driver {e.get('driver') or '?'}, "
                f"CUDA {e.get('cuda') or '?'}, torch {e.get('torch') or '?'}) on "
                f"{e.get('date') or '?'}")


def gpu_record(lab: str) -> GpuRecord | None:
    """The record of ``lab`` (e.g. ``"00_why_gpus"``), or None if none was recorded."""
    path = resources.files("labsim") / "data" / "gpu_records" / f"{lab}.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text(encoding="utf-8"))
    if doc.get("status") != "measured" or doc.get("environment", {}).get("smoke"):
        return None  # a failed section, or toy sizes (``--smoke``), is not a measurement
    env = doc.pop("environment", {})
    return GpuRecord(lab, env, doc)
