"""ZeRO and FSDP on real processes: bytes each rank holds.

``bytes_worker`` (inside ``labsim.lab.launch`` workers) measures parameter, gradient and
optimizer bytes per rank of one MLP under plain Adam, ``ZeroAdam`` (ZeRO-1) and FSDP2's
``fully_shard`` (ZeRO-3), with the meters of ``labsim.lab.memory``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labsim.lab.device import rank_device
from labsim.lab.memory import grad_bytes, optimizer_state_bytes, param_bytes, tensor_bytes
from labsim.parallel.zero import ZeroAdam, fsdp_wrap


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank holds after a training step: parameters, gradients and optimizer state,
    and the model's parameter count ``numel`` (Psi)."""

    params: int
    grads: int
    optimizer: int
    numel: int


def bytes_worker(rank: int, world: int, width: int = 256, depth: int = 4,
                 batch: int = 8) -> dict[str, RankBytes]:
    """Bytes per rank after one training step of an fp32 MLP under: plain DDP-style Adam
    (everything replicated), ZeRO-1 (``ZeroAdam``) and FSDP2 (``fully_shard``, ZeRO-3).
    Returns {setup: RankBytes} measured with ``labsim.lab.memory``
    (DTensors counted by their local shard)."""
    device = rank_device()
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank)).to(device)
    out: dict[str, RankBytes] = {}
    for name in ("replicated Adam", "ZeRO-1", "FSDP2"):
        model = _mlp(width, depth).to(device)
        numel = sum(p.numel() for p in model.parameters())
        if name == "FSDP2":
            model = fsdp_wrap(model, world)
        opt: Any = (ZeroAdam(model.parameters(), lr=1e-3) if name == "ZeRO-1"
                    else torch.optim.Adam(model.parameters(), lr=1e-3))
        model(x).square().mean().backward()
        grads = grad_bytes(model)  # FSDP2: reduce-scattered shards; others: full gradients
        opt.step()
        state = (tensor_bytes(opt.state_tensors()) if name == "ZeRO-1"
                 else optimizer_state_bytes(opt))
        out[name] = RankBytes(param_bytes(model), grads, state, numel)
    return out


