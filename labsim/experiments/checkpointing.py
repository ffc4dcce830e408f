"""Activation checkpointing on a real network: what a plan keeps, its peak, its time.

``measure_step`` runs a forward (the learner's ``checkpointed_forward``) and backward on a
``labsim.lab.models.residual_mlp`` and measures bytes saved for backward
(``labsim.lab.memory.MemoryMeter``), the peak of memory allocated during the step
(``labsim.lab.memory.LiveBytes``, which works on a CPU too, where the allocator keeps no
peak statistic) and the step's time.  ``block_bytes`` counts what one block saves.

``int8_saved_activations`` stores every floating activation autograd saves as int8 rows with
one fp32 scale per row (``torch.autograd.graph.saved_tensors_hooks``): what 8-bit activation
storage saves and what it costs in gradient error.  Systems that do this in production
(ActNN, Chen et al., ICML 2021; GACT, Liu et al., ICML 2022) use per-group scales and
stochastic rounding so that the compressed gradient stays unbiased; this is the plain
round-to-nearest form, so its gradient error can be measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from labsim.lab.device import synchronize
from labsim.lab.memory import LiveBytes, MemoryMeter


@dataclass(frozen=True)
class StepMeasurement:
    """One training step of a checkpointing plan.

    ``saved_bytes``: activation bytes kept for backward at the end of the forward pass;
    ``peak_bytes``: the peak of bytes allocated during forward + backward (activations,
    recomputed activations, gradients, temporaries; weights and the batch excluded);
    ``step_s``: median wall time of forward + backward over the repetitions.
    """

    label: str
    saved_bytes: int
    peak_bytes: int
    step_s: float

    def __repr__(self) -> str:
        return (
            f"{self.label:>16}: saved {self.saved_bytes / 1e6:7.2f} MB, "
            f"peak {self.peak_bytes / 1e6:7.2f} MB, step {self.step_s * 1e3:7.1f} ms"
        )


def measure_step(
    forward: Callable[[Sequence[nn.Module], torch.Tensor, Sequence[int] | None], torch.Tensor],
    blocks: nn.ModuleList,
    x: torch.Tensor,
    starts: Sequence[int] | None,
    *,
    label: str = "",
    repeat: int = 3,
) -> StepMeasurement:
    """Measure ``forward(blocks, x, starts)`` + backward of ``mean(out**2)``.

    One instrumented step gives the bytes (``MemoryMeter`` for what the forward keeps, a
    storage tracker for the peak); ``repeat`` plain steps give the time.
    """
    blocks.zero_grad(set_to_none=True)
    tracker = LiveBytes()
    with tracker:
        with MemoryMeter(blocks) as meter:
            loss = forward(blocks, x, starts).square().mean()
        loss.backward()
    times = []
    for _ in range(repeat):
        blocks.zero_grad(set_to_none=True)
        synchronize(x.device)
        t0 = time.perf_counter()
        forward(blocks, x, starts).square().mean().backward()
        synchronize(x.device)
        times.append(time.perf_counter() - t0)
    blocks.zero_grad(set_to_none=True)
    times.sort()
    return StepMeasurement(
        label or str(starts), meter.saved_bytes, tracker.peak, times[len(times) // 2]
    )


def step_flops(
    forward: Callable[[nn.ModuleList, torch.Tensor, list[int]], torch.Tensor],
    blocks: nn.ModuleList,
    x: torch.Tensor,
    starts: list[int],
) -> int:
    """FLOPs one training step (forward, ``mean(out**2)``, backward) really executes with
    ``forward(blocks, x, starts)``, recomputation included, counted op by op by
    ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions and attention; the
    element-wise ops it leaves out are a few FLOPs per element).  Counting, not assuming,
    matters: PyTorch's non-reentrant ``checkpoint`` stops recomputing once the tensors the
    backward needs exist (``torch.utils.checkpoint``'s early stop), so a segment's last op is
    not rerun."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        forward(blocks, x, starts).square().mean().backward()
    blocks.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


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

    from labsim.lab.memory import LiveBytes

    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    b, s, _ = x.shape
    scores_bytes = b * layer.cfg.heads * s * s * x.element_size()
    with FlopCounterMode(display=False) as flops:
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
