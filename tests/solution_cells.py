"""The exercises of a lab as its solution notebook writes them (the single source), for tests.

``exercises("07_collectives")`` runs the lab's exercise cells -- with the solution blocks in
place -- in a fresh namespace that has the imports the labs' setup cells give, and returns it:
``ns["ring_allreduce"]`` is the solution function, compiled from a notebook cell (untrusted
code, as a learner's), never labsim's reference.
"""

from __future__ import annotations

import json
from typing import Any

from .conftest import ROOT

PREAMBLE = """
import math, time, copy
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from labsim.parallel.data_parallel import lm_loss
from labsim.checks.quantization.reference import Int8Linear
from labsim.pipeline import Op
"""

TRITON_PREAMBLE = """
import os
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
import triton
import triton.language as tl
"""


def exercise_sources(stem: str) -> list[str]:
    """The source of every exercise cell of ``solutions/<stem>.ipynb``, in order."""
    nb = json.loads((ROOT / "solutions" / f"{stem}.ipynb").read_text(encoding="utf-8"))
    out = []
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and "### BEGIN SOLUTION" in src:
            out.append(src)
    return out


def exercises(stem: str) -> dict[str, Any]:
    """The namespace the exercise cells of ``stem``'s solution define (see module doc)."""
    ns: dict[str, Any] = {"__name__": f"solution_{stem.replace('-', '_')}"}
    exec(compile(PREAMBLE, f"<solution {stem} preamble>", "exec"), ns)  # noqa: S102
    sources = exercise_sources(stem)
    if any("@triton.jit" in src for src in sources):  # the lab's setup cell imports Triton
        exec(compile(TRITON_PREAMBLE, f"<solution {stem} triton>", "exec"), ns)  # noqa: S102
    for i, src in enumerate(sources):
        exec(compile(src, f"<solution {stem} exercise {i}>", "exec"), ns)  # noqa: S102
    return ns
