"""Activation checkpointing on a real network: what a plan keeps, its peak, what it recomputes,
its time.

``measure_memory`` runs a forward (the learner's ``checkpointed_forward``) and backward on a
``labsim.lab.models.residual_mlp`` and measures the bytes saved for backward
(``labsim.lab.memory.MemoryMeter``) and the peak of memory allocated during the step
(``labsim.lab.memory.LiveBytes``, which works on a CPU too, where the allocator keeps no
peak statistic); ``block_bytes`` counts what one block saves.  ``count_step`` counts what a
step executes: the FLOPs of its matmuls (``FlopCounterMode``) and every ATen operator
dispatched (``labsim.lab.profile.OpLog``), recomputation included.  ``time_plans`` times the
plans in interleaved rounds on one thread (``labsim.lab.timing``), and ``time_overhead`` sets
the time each plan adds beside the FLOPs it was counted to add, at two batch sizes: at a
handful of tokens a step does almost no arithmetic, so what checkpointing adds there is its
own fixed cost per call, which the FLOP count does not see.

``int8_saved_activations`` stores every floating activation autograd saves as int8 rows with
one fp32 scale per row (``torch.autograd.graph.saved_tensors_hooks``): what 8-bit activation
storage saves and what it costs in gradient error.  Systems that do this in production
(ActNN, Chen et al., ICML 2021; GACT, Liu et al., ICML 2022) use per-group scales and
stochastic rounding so that the compressed gradient stays unbiased; this is the plain
round-to-nearest form, so its gradient error can be measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from labsim.lab.device import Timing, synchronize
from labsim.lab.memory import LiveBytes, MemoryMeter
from labsim.lab.timing import Comparison, compare, one_thread, spread, time_interleaved

Forward = Callable[[nn.ModuleList, torch.Tensor, Sequence[int] | None], torch.Tensor]


@dataclass(frozen=True)
class PlanMemory:
    """What one checkpointing plan holds: ``saved_bytes``, the activation bytes kept for
    backward at the end of the forward pass, and ``peak_bytes``, the peak of bytes allocated
    during forward + backward (activations, recomputed activations, gradients, temporaries;
    weights and the batch excluded).  Both are exact, not timed."""

    label: str
    saved_bytes: int
    peak_bytes: int

    def __repr__(self) -> str:
        return (f"{self.label:>16}: saved {self.saved_bytes / 1e6:7.2f} MB, "
                f"peak {self.peak_bytes / 1e6:7.2f} MB")


@dataclass(frozen=True)
class StepMeasurement:
    """One training step of a checkpointing plan: its memory (``PlanMemory``'s fields) and
    ``step_s``, the median wall time of forward + backward."""

    label: str
    saved_bytes: int
    peak_bytes: int
    step_s: float

    def __repr__(self) -> str:
        return (
            f"{self.label:>16}: saved {self.saved_bytes / 1e6:7.2f} MB, "
            f"peak {self.peak_bytes / 1e6:7.2f} MB, step {self.step_s * 1e3:7.1f} ms"
        )


def _threads(x: torch.Tensor) -> Any:
    """One thread for work on a CPU (small ops gain nothing from a second thread, and a busy
    core would stall it); nothing to change on a GPU."""
    return one_thread() if x.device.type == "cpu" else nullcontext()


def _step(forward: Forward, blocks: nn.ModuleList, x: torch.Tensor,
          starts: Sequence[int] | None) -> Callable[[], None]:
    def step() -> None:
        blocks.zero_grad(set_to_none=True)  # freed before the clock starts the next one
        forward(blocks, x, starts).square().mean().backward()

    return step


def measure_memory(forward: Forward, blocks: nn.ModuleList, x: torch.Tensor,
                   starts: Sequence[int] | None, *, label: str = "") -> PlanMemory:
    """Bytes of one step of ``forward(blocks, x, starts)`` + backward of ``mean(out**2)``:
    ``MemoryMeter`` for what the forward keeps, a storage tracker for the peak."""
    blocks.zero_grad(set_to_none=True)
    with _threads(x), LiveBytes() as tracker:
        with MemoryMeter(blocks) as meter:
            loss = forward(blocks, x, starts).square().mean()
        loss.backward()
    blocks.zero_grad(set_to_none=True)
    return PlanMemory(label or str(starts), meter.saved_bytes, tracker.peak)


def measure_step(
    forward: Forward,
    blocks: nn.ModuleList,
    x: torch.Tensor,
    starts: Sequence[int] | None,
    *,
    label: str = "",
    repeat: int = 3,
) -> StepMeasurement:
    """``measure_memory`` of ``forward(blocks, x, starts)`` + backward of ``mean(out**2)``,
    and the median of ``repeat`` timed steps (on one thread on a CPU)."""
    mem = measure_memory(forward, blocks, x, starts, label=label)
    times = []
    with _threads(x):
        for _ in range(repeat):
            blocks.zero_grad(set_to_none=True)
            synchronize(x.device)
            t0 = time.perf_counter()
            forward(blocks, x, starts).square().mean().backward()
            synchronize(x.device)
            times.append(time.perf_counter() - t0)
    blocks.zero_grad(set_to_none=True)
    times.sort()
    return StepMeasurement(mem.label, mem.saved_bytes, mem.peak_bytes,
                           times[len(times) // 2] if times else float("nan"))


@dataclass(frozen=True)
class StepCount:
    """What one training step executes: ``flops``, the matmul FLOPs counted by
    ``FlopCounterMode`` (recomputation included), and ``ops``, how many times each ATen
    operator was dispatched."""

    flops: int
    ops: Mapping[str, int]

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    def extra_ops(self, base: StepCount) -> dict[str, int]:
        """Operators this step dispatched more often than ``base``, most added first."""
        extra = {k: n - base.ops.get(k, 0) for k, n in self.ops.items()
                 if n > base.ops.get(k, 0)}
        return dict(sorted(extra.items(), key=lambda kv: (-kv[1], kv[0])))


def count_step(forward: Forward, blocks: nn.ModuleList, x: torch.Tensor,
               starts: Sequence[int] | None) -> StepCount:
    """Count one step (forward, ``mean(out**2)``, backward) of ``forward(blocks, x, starts)``:
    the FLOPs ``torch.utils.flop_counter.FlopCounterMode`` adds up over every matmul actually
    executed (convolutions and attention too; element-wise ops are not counted), and every ATen
    operator dispatched.  Counting, not assuming, matters: PyTorch's non-reentrant
    ``checkpoint`` stops recomputing once the tensors the backward needs exist (its early
    stop), so a segment's last op is not rerun."""
    from torch.utils.flop_counter import FlopCounterMode

    from labsim.lab.profile import OpLog

    blocks.zero_grad(set_to_none=True)
    with _threads(x), FlopCounterMode(display=False) as counter, OpLog() as log:
        forward(blocks, x, starts).square().mean().backward()
    blocks.zero_grad(set_to_none=True)
    return StepCount(int(counter.get_total_flops()), dict(log.counts))


def time_plans(forward: Forward, blocks: nn.ModuleList, x: torch.Tensor,
               plans: Mapping[str, Sequence[int] | None], *, rounds: int = 7,
               max_seconds: float = 30.0) -> dict[str, Timing]:
    """One training step of every plan (label -> starts), timed in ``rounds`` interleaved
    rounds (``labsim.lab.timing.time_interleaved``), on one thread on a CPU: each round runs
    every plan once, so a load that comes and goes slows them alike."""
    fns = {label: _step(forward, blocks, x, starts) for label, starts in plans.items()}
    with _threads(x):
        timings = time_interleaved(fns, device=x.device, rounds=rounds,
                                   max_seconds=max_seconds)
    blocks.zero_grad(set_to_none=True)
    return timings


def combine(memory: Mapping[str, PlanMemory], timings: Mapping[str, Timing]
            ) -> list[StepMeasurement]:
    """``StepMeasurement``s of the plans both measured: bytes from ``measure_memory``, the
    median time from one ``time_plans`` run (so every plan's time comes from the same
    rounds)."""
    return [StepMeasurement(label, m.saved_bytes, m.peak_bytes, timings[label].median_s)
            for label, m in memory.items() if label in timings]


def measure_plans(forward: Forward, blocks: nn.ModuleList, x: torch.Tensor,
                  plans: Mapping[str, Sequence[int] | None], *, rounds: int = 5
                  ) -> list[StepMeasurement]:
    """``measure_memory`` of every plan, and their times from one ``time_plans`` run."""
    memory = {label: measure_memory(forward, blocks, x, starts, label=label)
              for label, starts in plans.items()}
    return combine(memory, time_plans(forward, blocks, x, plans, rounds=rounds))


@dataclass(frozen=True)
class ExtraTime:
    """Seconds a plan adds to a step: the median over rounds of (plan - plain step) in the
    same round, and the quartiles of those differences."""

    median_s: float
    low_s: float
    high_s: float

    @classmethod
    def of(cls, timings: Mapping[str, Timing], base: str, label: str) -> ExtraTime:
        diffs = [t - b for t, b in zip(timings[label].times_s, timings[base].times_s)]
        low, high = spread(diffs)
        return cls(statistics.median(diffs), low, high)

    def __str__(self) -> str:
        return (f"{self.median_s * 1e3:.1f} ms (middle half of the rounds "
                f"{self.low_s * 1e3:.1f}-{self.high_s * 1e3:.1f})")


@dataclass(frozen=True)
class PlanTime:
    """The time a plan adds to a step, beside the FLOPs it was counted to add.

    ``flops_added``: counted recompute FLOPs over the plain step's; ``large`` and ``small``:
    the plain step against this plan, round by round, at ``large_tokens`` and at
    ``small_tokens`` (so few that the step does almost no arithmetic); ``extra_large`` and
    ``extra_small``: the time the plan adds per step at each."""

    label: str
    flops_added: float
    large: Comparison
    small: Comparison
    large_tokens: int
    small_tokens: int
    extra_large: ExtraTime
    extra_small: ExtraTime

    @property
    def settled(self) -> bool:
        """Both comparisons gave a verdict (neither said "too noisy to tell")."""
        return self.large.settled and self.small.settled

    def __repr__(self) -> str:
        lines = [f"{self.label}: counted FLOPs {self.flops_added:+.1%}"]
        for tokens, comparison, extra in ((self.large_tokens, self.large, self.extra_large),
                                          (self.small_tokens, self.small, self.extra_small)):
            lines.append(f"  {tokens:>4} tokens: {comparison.verdict}")
            if comparison.settled and not comparison.same_speed:
                lines.append(f"               adds {extra} per step")
        return "\n".join(lines)


def time_overhead(small: Mapping[str, Timing], large: Mapping[str, Timing],
                  counts: Mapping[str, StepCount], *, small_tokens: int, large_tokens: int,
                  base: str = "none") -> list[PlanTime]:
    """For every plan but ``base``: ``time_plans`` at ``small_tokens`` and ``large_tokens``
    set against ``count_step``'s FLOPs (``counts``, any token count: the ratios do not depend
    on it)."""
    return [PlanTime(label, counts[label].flops / counts[base].flops - 1,
                     compare(large, base, label), compare(small, base, label),
                     large_tokens, small_tokens, ExtraTime.of(large, base, label),
                     ExtraTime.of(small, base, label))
            for label in large if label != base]


def step_flops(
    forward: Forward,
    blocks: nn.ModuleList,
    x: torch.Tensor,
    starts: Sequence[int] | None,
) -> int:
    """FLOPs one training step really executes (``count_step(...).flops``)."""
    return count_step(forward, blocks, x, starts).flops


def layer_step(layer: nn.Module, x: torch.Tensor, policy: Callable[..., Any] | str | None = None
               ) -> dict[str, Any]:
    """One step (forward, ``mean(out**2)``, backward) of a transformer ``layer``
    (``labsim.lab.models.Block``) on ``x`` (b, s, h): plain (``policy=None``), checkpointed
    whole (``"full"``), or checkpointed selectively with ``policy`` as the policy function of
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.  Returns the gradients
    (of x, then of every parameter), ``kept`` (bytes created in the forward and alive after
    it, output excluded: what is kept for backward), ``scores_kept`` (whether an s x s tensor
    is among them) and ``flops`` (matmul FLOPs executed, recomputation included)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    from torch.utils.flop_counter import FlopCounterMode

    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    b, s, _ = x.shape
    scores_bytes = b * layer.cfg.heads * s * s * x.element_size()
    with _threads(x), FlopCounterMode(display=False) as flops:
        with LiveBytes() as live:
            if policy is None:
                out = layer(x)
            elif policy == "full":
                out = checkpoint(layer, x, use_reentrant=False)
            else:
                out = checkpoint(layer, x, use_reentrant=False, context_fn=lambda: (
                    create_selective_checkpoint_contexts(policy)))
            kept = live.live - out.untyped_storage().nbytes()
            scores_kept = any(n == scores_bytes for n in live._sizes.values())
        out.square().mean().backward()
    grads = [x.grad.detach().clone(), *(p.grad.detach().clone() for p in layer.parameters())]
    return {"gradients": grads, "kept": kept, "scores_kept": scores_kept,
            "flops": int(flops.get_total_flops())}


def block_bytes(width: int, tokens: int, bytes_per_element: int = 4) -> tuple[int, int]:
    """(bytes one ``ResidualBlock`` saves for backward, bytes of its input), by counting.

    Saved: LN input and output (2 x tokens x width), up-projection output and GELU output
    (2 x tokens x 4 width), the LN mean and rstd (2 x tokens).  The input is tokens x width.
    """
    saved = (2 * tokens * width + 2 * tokens * 4 * width + 2 * tokens) * bytes_per_element
    return saved, tokens * width * bytes_per_element


# --------------------------------------------------------------------------------------
# 8-bit saved activations


@dataclass
class CompressionStats:
    """Bytes of activations saved for backward: as they were, and as stored after packing."""

    raw_bytes: int = 0
    stored_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def __repr__(self) -> str:
        return (
            f"CompressionStats(raw {self.raw_bytes / 1e6:.2f} MB -> stored "
            f"{self.stored_bytes / 1e6:.2f} MB, {self.ratio:.2f}x smaller)"
        )


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row (last dimension): ``q = round(t / s)``, ``s = max|row| / 127``."""
    rows = t.detach().reshape(-1, t.shape[-1]).float()
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    scale = scale / 127.0
    q = torch.round(rows / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_rows``, back to ``like``'s shape and dtype."""
    return (q.float() * scale).reshape(like.shape).to(like.dtype)


@contextmanager
def int8_saved_activations(
    exclude: Sequence[torch.Tensor] = (), min_numel: int = 4096
) -> Iterator[CompressionStats]:
    """Store every floating activation saved for backward as int8 rows plus an fp32 scale.

    Parameters (``exclude``) and small tensors (< ``min_numel`` elements, e.g. LayerNorm's
    mean and rstd) are kept as they are.  Backward sees the dequantised values, so gradients
    carry the quantisation error (up to half a step, max|row|/254, per element).  This is
    the simplest form of what ActNN (Chen et al., ICML 2021) and similar systems do; they add
    per-group scales and stochastic rounding so that the gradient stays unbiased.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    stats = CompressionStats()
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> object:
        ptr = t.untyped_storage().data_ptr()
        fresh = ptr not in seen
        seen.add(ptr)
        if ptr in skip or not t.is_floating_point() or t.numel() < min_numel or t.dim() < 2:
            if fresh and ptr not in skip:
                stats.raw_bytes += t.untyped_storage().nbytes()
                stats.stored_bytes += t.untyped_storage().nbytes()
            return t
        q, scale = quantize_rows(t)
        stats.raw_bytes += t.numel() * t.element_size()
        stats.stored_bytes += q.numel() * q.element_size() + scale.numel() * 4
        return (q, scale, torch.empty(t.shape, dtype=t.dtype, device="meta"))

    def unpack(packed: object) -> torch.Tensor:
        if isinstance(packed, tuple):
            q, scale, like = packed
            return dequantize_rows(q, scale, like)
        return packed  # type: ignore[return-value]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield stats


@dataclass(frozen=True)
class Int8Gradients:
    """A step with every saved activation stored as int8 rows (``int8_saved_activations``)
    against the same step stored exactly: bytes (``stats``) and how far the gradient moved
    (relative L2 error and cosine similarity of all parameters' gradients)."""

    stats: CompressionStats
    rel_error: float
    cosine: float

    def __repr__(self) -> str:
        return (f"{self.stats}\ngradient: relative error {self.rel_error:.2e}, cosine "
                f"similarity {self.cosine:.6f}")


def int8_gradients(forward: Forward, blocks: nn.ModuleList, x: torch.Tensor
                   ) -> Int8Gradients:
    """One step of ``forward(blocks, x, [0])`` (no checkpoints) + backward of
    ``mean(out**2)``, exact and with 8-bit saved activations; the gradients compared."""
    params = list(blocks.parameters())

    def grads(compress: bool) -> tuple[torch.Tensor, CompressionStats]:
        blocks.zero_grad(set_to_none=True)
        stats = CompressionStats()
        with _threads(x):
            if compress:
                with int8_saved_activations(params) as stats:
                    loss = forward(blocks, x, [0]).square().mean()
            else:
                loss = forward(blocks, x, [0]).square().mean()
            loss.backward()
        flat = torch.cat([p.grad.flatten() for p in params])
        blocks.zero_grad(set_to_none=True)
        return flat, stats

    exact, _ = grads(False)
    int8, stats = grads(True)
    rel = ((int8 - exact).norm() / exact.norm()).item()
    cos = nn.functional.cosine_similarity(int8.double(), exact.double(), dim=0).item()
    return Int8Gradients(stats, rel, cos)
