"""Activation recomputation at model scale: memory kept and FLOPs added, per recompute mode.

Modes (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"): ``"none"`` keeps every activation; ``"selective"`` drops the s x s attention
activations (softmax output, its dropout mask and output) and recomputes the attention core;
``"full"`` keeps each layer's input only and recomputes the whole layer's forward.
``"op-sac"`` is torchtitan's op-level selective checkpointing (``labsim.op_sac.op_sac_per_layer``):
it keeps every other matmul output and the attention kernel's, and recomputes the other
matmuls (``labsim.op_sac.op_sac_matmuls``) and the element-wise ops.

Memory comes from ``labsim.memory.activation_memory``; the FLOPs added are the recomputed
forward work: the attention core ``4 b s^2 h`` per layer for selective, one full layer
forward for full (Megatron's 72 -> 96 l h^2 accounting), over a step of forward + backward
= 3 forwards.

The segment model of a real network (``segment_peak_bytes``): segment j starting at layer
``s_j`` keeps ``boundary_bytes[s_j]`` from its forward until its backward; while backward runs
through segment j it holds the activations of all its layers, ``sum(layer_bytes[s_j:s_{j+1}])``,
plus the boundaries of the segments before it.  As in
``torch.utils.checkpoint.checkpoint_sequential`` the *last* segment is not checkpointed (its
backward follows at once, so recomputing it would save nothing): it costs no recomputation.
``every_k`` and ``sqrt_segments`` (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost": segments of sqrt(n) layers give O(sqrt(n)) memory for one extra forward) make plans.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from labsim.memory import RECOMPUTE, activation_memory
from labsim.op_sac import op_sac_matmuls
from labsim.workload import Transformer


def recompute_flops_overhead(model: Transformer, recompute: str) -> float:
    """Extra FLOPs of a training step as a fraction of the step without recomputation."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}; use one of {RECOMPUTE}")
    per_token = model.flops_per_token
    if recompute == "none":
        return 0.0
    if recompute == "selective":
        return model.layers * model.attention_core_flops(1) / model.seq_len / per_token
    if recompute == "op-sac":  # the matmuls not saved (labsim.op_sac.op_sac_matmuls)
        again = sum(2 * out * inp for _, out, inp, saved in op_sac_matmuls(model) if not saved)
        return model.layers * again / per_token
    return model.training_flops(1, "full") / model.training_flops(1, "none") - 1.0


def recompute_table(model: Transformer, *, micro_batch: int, **kwargs: Any
                    ) -> dict[str, tuple[float, float]]:
    """``{mode: (activation bytes, FLOP overhead fraction)}`` for none / selective / full.
    ``kwargs`` go to ``activation_memory`` (tp, pp, sequence_parallel, ...)."""
    return {
        mode: (
            activation_memory(model, micro_batch=micro_batch, recompute=mode, **kwargs),
            recompute_flops_overhead(model, mode),
        )
        for mode in RECOMPUTE
    }


def validate_starts(starts: Sequence[int], n: int) -> list[int]:
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
    starts = validate_starts(starts, n)
    ends = [*starts[1:], n]
    kept = 0.0
    peak = 0.0
    for s, e in zip(starts, ends):
        peak = max(peak, kept + sum(layer_bytes[s:e]))
        kept += boundary_bytes[s]
    return peak


def recomputed_layers(n: int, starts: Sequence[int]) -> int:
    """Layers run twice: all but the last segment (which is not checkpointed)."""
    starts = validate_starts(starts, n)
    return starts[-1]


