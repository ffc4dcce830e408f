"""Worker drivers of lab 09 (ZeRO and FSDP): a learner's sharded Adam on real processes, and
FSDP2 bytes per rank.

``zero1_worker`` trains ``TrapNet`` (float64) with the learner's optimizer class on shards of
fixed batches; the check compares with ``serial_adam``, one process running
``torch.optim.Adam`` on the whole batch.  ``bytes_worker`` measures parameter, gradient and
optimizer bytes per rank of the same MLP under plain Adam, ``ZeroAdam`` and FSDP2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labsim.lab.data_parallel import INIT_SEED, _guard, _spread, batches
from labsim.lab.memory import grad_bytes, optimizer_state_bytes, param_bytes, tensor_bytes
from labsim.parallel.data_parallel import (
    TrapNet,
    broadcast_parameters,
    lm_loss,
    parameters_of,
    shard,
)
from labsim.parallel.zero import ZeroAdam, fsdp_wrap

LR = 0.05


def serial_adam(lr: float = LR) -> dict[str, Any]:
    """One process, whole batches, ``torch.optim.Adam``: the oracle of the ZeRO-1 check."""
    torch.manual_seed(INIT_SEED)
    model = TrapNet().double()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for b in batches():
        loss = lm_loss(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": parameters_of(model),
            "state_bytes": optimizer_state_bytes(opt)}


def zero1_worker(rank: int, world: int, cls: Callable[..., Any]) -> dict[str, Any]:
    """Train with ``cls(trainable_params, lr=LR)``: ``step()`` reduces the gradients, updates
    this rank's shard and all-gathers; ``state_tensors()`` lists the Adam state held here."""
    torch.manual_seed(INIT_SEED + rank)
    model = TrapNet().double()
    broadcast_parameters(model)
    opt = _guard(cls, [p for p in model.parameters() if p.requires_grad], LR)
    if isinstance(opt, Exception):
        return {"error": opt}
    losses = []
    for b in batches():
        loss = lm_loss(model, shard(b, rank, world))
        loss.backward()
        err = _guard(opt.step)
        if isinstance(err, Exception):
            return {"error": err}
        _guard(opt.zero_grad)
        for p in model.parameters():
            p.grad = None
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    state = _guard(opt.state_tensors)
    return {"losses": losses, "params": parameters_of(model), "spread": _spread(model),
            "state_bytes": state if isinstance(state, Exception) else tensor_bytes(state)}


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def bytes_worker(rank: int, world: int, width: int = 256, depth: int = 4,
                 batch: int = 8) -> dict[str, dict[str, int]]:
    """Bytes per rank after one training step of an fp32 MLP under: plain DDP-style Adam
    (everything replicated), ZeRO-1 (``ZeroAdam``) and FSDP2 (``fully_shard``, ZeRO-3).
    Returns {setup: {params, grads, optimizer, numel}} measured with ``labsim.lab.memory``
    (DTensors counted by their local shard)."""
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))
    out: dict[str, dict[str, int]] = {}
    for name in ("replicated Adam", "ZeRO-1", "FSDP2"):
        model = _mlp(width, depth)
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
        out[name] = {"params": param_bytes(model), "grads": grads, "optimizer": state,
                     "numel": numel}
    return out
