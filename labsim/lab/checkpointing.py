"""Activation checkpointing on a real network: segments, what they keep, what they cost.

A deep residual MLP (``residual_mlp``) is run with ``torch.utils.checkpoint.checkpoint``
(non-reentrant) over chosen segments.  A checkpointed segment keeps only its input during the
forward pass and recomputes its activations when backward reaches it (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174: segments of sqrt(n) layers
give O(sqrt(n)) memory for one extra forward pass).

The segment model used by the planner (``segment_peak_bytes``, ``plan_segments``): segment j
starting at layer ``s_j`` keeps ``boundary_bytes[s_j]`` from its forward until its backward;
while backward runs through segment j it holds the activations of all its layers,
``sum(layer_bytes[s_j:s_{j+1}])``, plus the boundaries of the segments before it.  As in
``torch.utils.checkpoint.checkpoint_sequential`` the *last* segment is not checkpointed (its
backward follows at once, so recomputing it would save nothing): it costs no recomputation.

``measure_step`` measures bytes saved for backward (``labsim.lab.memory.MemoryMeter``) and the
peak of memory allocated during a training step, with a small tracker of tensor storages that
works on a CPU too, where the allocator keeps no peak statistic.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from labsim.lab.device import synchronize
from labsim.lab.memory import MemoryMeter


class ResidualBlock(nn.Module):
    """Pre-LayerNorm MLP block of a transformer: ``x + W2 gelu(W1 LN(x))``, ffn 4x wide."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (tokens, width)
        return x + self.down(self.act(self.up(self.norm(x))))


def residual_mlp(layers: int, width: int, seed: int = 0) -> nn.ModuleList:
    """``layers`` ``ResidualBlock``s of ``width``, initialised from ``seed``."""
    if layers < 1 or width < 1:
        raise ValueError("layers and width must be >= 1")
    torch.manual_seed(seed)
    return nn.ModuleList(ResidualBlock(width) for _ in range(layers))


def _run(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def forward_segments(
    blocks: Sequence[nn.Module], x: torch.Tensor, starts: Sequence[int] | None
) -> torch.Tensor:
    """Run ``blocks`` on ``x`` in segments beginning at ``starts``, as ``checkpoint_sequential``.

    ``starts[0]`` must be 0; each segment runs from its start to the next start.  Every
    segment but the last is checkpointed (``use_reentrant=False``); the last one runs
    normally because its backward follows at once.  ``starts=None`` or ``[0]``: no
    checkpointing at all.
    """
    if not starts:
        return _run(blocks, x)
    starts = _validate(starts, len(blocks))
    ends = [*starts[1:], len(blocks)]
    for s, e in zip(starts[:-1], ends[:-1]):
        x = checkpoint(_run, blocks[s:e], x, use_reentrant=False)
    return _run(blocks[starts[-1]:], x)


def _validate(starts: Sequence[int], n: int) -> list[int]:
    starts = [int(s) for s in starts]
    if not starts or starts[0] != 0:
        raise ValueError(f"segment starts must begin with 0, got {starts}")
    if any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= n:
        raise ValueError(f"segment starts must increase and stay below {n}, got {starts}")
    return starts


def every_k(n: int, k: int) -> list[int]:
    """Segment starts for segments of ``k`` layers: ``[0, k, 2k, ...]``."""
    if k < 1:
        raise ValueError("k must be >= 1")
    return list(range(0, n, k))


def sqrt_segments(n: int) -> list[int]:
    """Chen et al.'s choice: segments of round(sqrt(n)) layers."""
    return every_k(n, max(1, round(math.sqrt(n))))


# --------------------------------------------------------------------------------------
# The planner's model


def segment_peak_bytes(
    layer_bytes: Sequence[float], boundary_bytes: Sequence[float], starts: Sequence[int]
) -> float:
    """Predicted peak activation bytes of a step with segments beginning at ``starts``.

    Peak = max over segments j of (sum of boundary bytes of the segments before j) +
    (bytes of all layers of segment j).  ``layer_bytes[i]`` is what layer i saves for
    backward, ``boundary_bytes[i]`` the size of its input (what a checkpoint keeps).
    """
    n = len(layer_bytes)
    if len(boundary_bytes) != n:
        raise ValueError("layer_bytes and boundary_bytes must have the same length")
    starts = _validate(starts, n)
    ends = [*starts[1:], n]
    kept = 0.0
    peak = 0.0
    for s, e in zip(starts, ends):
        peak = max(peak, kept + sum(layer_bytes[s:e]))
        kept += boundary_bytes[s]
    return peak


def recomputed_layers(n: int, starts: Sequence[int]) -> int:
    """Layers run twice: all but the last segment (which is not checkpointed)."""
    starts = _validate(starts, n)
    return starts[-1]


def plan_segments(
    layer_bytes: Sequence[float], boundary_bytes: Sequence[float], budget_bytes: float
) -> list[int]:
    """Segment starts that fit ``budget_bytes`` with the fewest recomputed layers.

    Dynamic programme over prefixes: ``kept[i]`` is the least boundary memory with which
    layers ``[0, i)`` can be split into checkpointed segments that all fit; smaller ``kept``
    never hurts later segments, so keeping the minimum is exact.  The answer is the longest
    un-checkpointed tail ``[i, n)`` with ``kept[i] + sum(layer_bytes[i:]) <= budget``.
    Raises ``ValueError`` if no segmentation fits.
    """
    n = len(layer_bytes)
    if n == 0 or len(boundary_bytes) != n:
        raise ValueError("need one layer_bytes and one boundary_bytes entry per layer (n > 0)")
    inf = math.inf
    kept = [inf] * (n + 1)
    prev = [-1] * (n + 1)
    kept[0] = 0.0
    prefix = [0.0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)
    for i in range(1, n + 1):
        for j in range(i):
            if kept[j] + prefix[i] - prefix[j] <= budget_bytes:
                cand = kept[j] + boundary_bytes[j]
                if cand < kept[i]:
                    kept[i], prev[i] = cand, j
    for tail in range(n):  # tail start; smaller start = fewer recomputed layers
        if kept[tail] + prefix[n] - prefix[tail] <= budget_bytes:
            starts = [tail]
            i = tail
            while i > 0:
                i = prev[i]
                starts.append(i)
            return sorted(set(starts))
    raise ValueError(
        f"no segmentation fits {budget_bytes:.4g} bytes: even one layer at a time needs "
        f"{min(segment_peak_bytes(layer_bytes, boundary_bytes, list(range(n))), inf):.4g}"
    )


# --------------------------------------------------------------------------------------
# Measurement


class _LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created inside the mode and still alive, and their peak.

    Storages that alias an input of the op (views, in-place results) are not new memory and
    are not counted; tensors made before the mode (weights, the batch) are never counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = {
            id(a.untyped_storage())
            for a in tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._sizes:
                continue
            self._sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, key)
            self.peak = max(self.peak, self.live)
        return out


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
    tracker = _LiveBytes()
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


def block_bytes(width: int, tokens: int, bytes_per_element: int = 4) -> tuple[int, int]:
    """(bytes one ``ResidualBlock`` saves for backward, bytes of its input), by counting.

    Saved: LN input and output (2 x tokens x width), up-projection output and GELU output
    (2 x tokens x 4 width), the LN mean and rstd (2 x tokens).  The input is tokens x width.
    """
    saved = (2 * tokens * width + 2 * tokens * 4 * width + 2 * tokens) * bytes_per_element
    return saved, tokens * width * bytes_per_element
