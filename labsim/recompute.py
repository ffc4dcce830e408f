"""Activation recomputation at model scale: memory kept and FLOPs added, per recompute mode.

Modes (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"): ``"none"`` keeps every activation; ``"selective"`` drops the s x s attention
activations (softmax output, its dropout mask and output) and recomputes the attention core;
``"full"`` keeps each layer's input only and recomputes the whole layer's forward.

Memory comes from ``labsim.memory.activation_memory``; the FLOPs added are the recomputed
forward work: the attention core ``4 b s^2 h`` per layer for selective, one full layer
forward for full (Megatron's 72 -> 96 l h^2 accounting), over a step of forward + backward
= 3 forwards.
"""

from __future__ import annotations

from typing import Any

from labsim.memory import RECOMPUTE, activation_memory
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
