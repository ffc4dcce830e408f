"""What is alive during two training steps of the lab GPT, measured.

``step_timeline`` runs two fp32 training steps (``zero_grad``, forward, backward, optimizer
step) of a ``labsim.lab.GPT`` under ``labsim.lab.LiveBytes`` and reads the bytes alive after
each phase and the peak.  It shows what a "model states + activations" estimate leaves out:
activations are freed as the backward writes gradients, ``zero_grad(set_to_none=True)``
frees the gradients, and PyTorch's optimizers create their state (Adam's two moments, SGD's
momentum buffer) lazily, inside the first ``step()`` (``torch.optim.Adam._init_group``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PHASES = ("forward 1", "backward 1", "step 1", "forward 2", "backward 2", "step 2")
OPTIMIZERS = ("adam", "sgd", "sgd-momentum")


@dataclass(frozen=True)
class StepTimeline:
    """Bytes alive after each of ``PHASES`` (created since training started: the weights
    and the batch, made before, are not counted), and the peak of each of the two steps."""

    n_params: int
    activation_bytes: int  # alive after the first forward
    after: tuple[int, ...]  # one per PHASES
    peaks: tuple[int, int]  # the most bytes alive at once during step 1, during step 2


def step_timeline(config: Mapping[str, Any], optimizer: str = "adam",
                  set_to_none: bool = True) -> StepTimeline:
    """Two fp32 steps of the GPT of ``config`` (``layers``, ``hidden``, ``heads``,
    ``seq_len``, ``vocab``, ``batch``; tied embeddings, seed 0) with ``optimizer`` (one of
    ``OPTIMIZERS``), ``zero_grad(set_to_none=set_to_none)`` before each."""
    import torch

    from labsim.lab.datasets import random_batch
    from labsim.lab.memory import LiveBytes
    from labsim.lab.models import GPT
    from labsim.workload import Transformer

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}; use one of {OPTIMIZERS}")
    cfg = Transformer(config["layers"], config["hidden"], config["heads"], config["seq_len"],
                      config["vocab"], tied_embeddings=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    params = list(model.parameters())
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=1e-3)
    else:
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9 if optimizer != "sgd" else 0.0)
    idx, targets = random_batch(cfg, batch=config["batch"], seed=0)
    after, peaks = [], []
    with LiveBytes() as live:
        for _ in range(2):
            live.peak = live.live
            opt.zero_grad(set_to_none=set_to_none)
            loss = model(idx, targets)[1]
            after.append(live.live)
            loss.backward()
            del loss
            after.append(live.live)
            opt.step()
            after.append(live.live)
            peaks.append(live.peak)
    return StepTimeline(sum(p.numel() for p in params), after[0], tuple(after),
                        (peaks[0], peaks[1]))
