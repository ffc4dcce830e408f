"""Profile a real training step with ``torch.profiler``: where its time goes, by kind of op.

``profile_step(step)`` runs ``step()`` once to warm up, then once under the profiler (CPU
activity; CUDA kernels too when a GPU is present) and attributes every operator's *self* time
(its own work, not its children's) to one kind, the kinds labsim's step simulator uses:

* ``matmul``: the GEMMs of linear layers (``aten::mm``, ``addmm``, ``matmul``, ``_scaled_mm``);
* ``attention``: the attention core (batched GEMMs over the score matrix, softmax and its
  backward, SDPA / FlashAttention kernels);
* ``optimizer``: everything inside ``Optimizer.step`` (the profiler's own scope for it);
* ``elementwise``: the rest of ATen's math (norms, activations, dropout, adds, copies);
* ``framework``: time no ATen operator owns (autograd's engine, Python, the profiler).

On a GPU the breakdown reads kernel time on the device (``self_device_time_total``), which is
what the simulator models; on a CPU it reads the host time of each operator.  The Chrome trace
(``StepProfile.to_chrome``) opens in Perfetto beside labsim's own (``StepResult.trace``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from labsim.lab.profile import quiet_profiler

KINDS = ("matmul", "attention", "elementwise", "optimizer", "framework")
_MATMUL = {"aten::mm", "aten::addmm", "aten::matmul", "aten::_scaled_mm", "aten::addmv",
           "aten::mv", "aten::linear"}
_ATTENTION = {"aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::_softmax_backward_data",
              "aten::softmax"}
_ATTENTION_PREFIXES = ("aten::_scaled_dot_product", "aten::_flash_attention",
                       "aten::_efficient_attention", "aten::_cudnn_attention")


def op_kind(name: str, in_optimizer: bool) -> str:
    """The kind (``KINDS``) of a profiler event named ``name``."""
    if in_optimizer:
        return "optimizer"
    if name in _MATMUL:
        return "matmul"
    if name in _ATTENTION or name.startswith(_ATTENTION_PREFIXES):
        return "attention"
    if name.startswith("aten::"):
        return "elementwise"
    return "framework"


@dataclass(frozen=True)
class StepProfile:
    """Seconds of one profiled step by kind (``KINDS``), the step's wall time, and the raw
    trace (Chrome trace-event JSON, as ``torch.profiler`` exported it)."""

    seconds: dict[str, float]
    step_s: float
    device: str
    trace: dict = field(repr=False)

    @property
    def fractions(self) -> dict[str, float]:
        """Each kind's share of the attributed time."""
        total = sum(self.seconds.values()) or 1.0
        return {k: v / total for k, v in self.seconds.items()}

    def to_chrome(self, path: str | Path) -> Path:
        """Write the profiler's Chrome trace to ``path`` (open it in ui.perfetto.dev)."""
        path = Path(path)
        if not path.parent.is_dir():
            raise ValueError(f"the folder {str(path.parent)!r} does not exist")
        path.write_text(json.dumps(self.trace), encoding="utf-8")
        return path

    def __repr__(self) -> str:
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms ({self.fractions[k]:.0%})"
                          for k, v in self.seconds.items())
        return f"StepProfile({self.device}: step {self.step_s * 1e3:.1f} ms; {parts})"


def _in_optimizer(event: Any) -> bool:
    node = event
    while node is not None:
        if node.name.startswith("Optimizer.step"):
            return True
        node = node.cpu_parent
    return False


def profile_step(step: Callable[[], Any], *, device: torch.device | str = "cpu",
                 warmup: int = 1) -> StepProfile:
    """Profile one call of ``step`` (after ``warmup`` unprofiled calls) on ``device``."""
    import tempfile

    device = torch.device(device)
    on_gpu = device.type == "cuda"
    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with quiet_profiler(), profile(activities=activities) as prof:
        step()
        if on_gpu:
            torch.cuda.synchronize(device)
    seconds = dict.fromkeys(KINDS, 0.0)
    for event in prof.events():
        own = (event.self_device_time_total if on_gpu else event.self_cpu_time_total) / 1e6
        if own > 0:
            seconds[op_kind(event.name, _in_optimizer(event))] += own
    events = prof.events()
    starts = [e.time_range.start for e in events]
    ends = [e.time_range.end for e in events]
    step_s = (max(ends) - min(starts)) / 1e6 if events else 0.0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text(encoding="utf-8"))
    return StepProfile(seconds, step_s, str(device), trace)
