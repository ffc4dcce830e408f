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

from labsim.hardware import GPU
from labsim.lab.profile import quiet_profiler
from labsim.workload import Transformer

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


def measured_device(device: torch.device | str = "cpu", *, n: int = 512,
                    nbytes: float = 32e6) -> GPU:
    """This device as a labsim ``GPU``, so that the simulator can model a step on it: its
    fp32 "peak" is the rate a ``n x n`` fp32 matmul reaches here and its memory bandwidth
    that of a ``nbytes`` copy (read + write), both measured now (best of a few runs)."""
    from labsim.experiments.precision import matmul_flops_per_s
    from labsim.lab.device import time_fn

    device = torch.device(device)
    flops = matmul_flops_per_s(n, "fp32", device, max_seconds=1.0)
    src = torch.ones(int(nbytes // 4), device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device=device, warmup=1, repeat=5, max_seconds=1.0)
    total = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
             else 16e9)
    return GPU(f"this {device.type}", {"fp32": flops, "tf32": flops}, float(total),
               2 * src.numel() * 4 / t.min_s,
               f"measured here: {n}x{n} fp32 matmul, {nbytes / 1e6:.0f} MB copy")


def gpt_step(cfg: Transformer, batch: int, *, device: torch.device | str = "cpu",
             seed: int = 0) -> Callable[[], None]:
    """One AdamW training step of the labs' GPT of shape ``cfg`` on a random batch of
    ``batch`` sequences, as a function to profile."""
    from labsim.lab.datasets import random_batch
    from labsim.lab.models import GPT

    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    idx, targets = random_batch(cfg, batch, cfg.seq_len)
    idx, targets = idx.to(device), targets.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()

    return step


def compare_kinds(real: StepProfile, simulated: dict[str, float]) -> list[dict[str, Any]]:
    """Rows of (kind, measured seconds and share, simulated seconds and share) for the kinds
    of ``KINDS``; the simulator has no ``framework`` kind (autograd, Python, the profiler)."""
    sim_total = sum(simulated.values()) or 1.0
    real_total = sum(real.seconds.values()) or 1.0
    return [{"kind": k, "measured_s": real.seconds.get(k, 0.0),
             "measured_share": real.seconds.get(k, 0.0) / real_total,
             "simulated_s": simulated.get(k, 0.0),
             "simulated_share": simulated.get(k, 0.0) / sim_total} for k in KINDS]
