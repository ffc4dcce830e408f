"""ZeRO and FSDP on real processes: bytes each rank holds and bytes it sends.

``bytes_worker`` (inside ``labsim.lab.launch`` workers) takes one MLP through a training step
under data-parallel Adam (everything replicated, gradients all-reduced), ``ShardedOptimizer``
around Adam (ZeRO-1), ``Zero3Linear`` layers or a learner's (ZeRO-3 by hand) and FSDP2's
``fully_shard`` (ZeRO-3), in fp32 and with a bf16 compute dtype (``MixedPrecisionPolicy``),
and measures what each rank holds (``labsim.lab.memory``) and what its collectives move
(``labsim.lab.comm.CommRecorder``, at the dispatcher).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labsim.collectives.bandwidth import sent_factor
from labsim.lab.comm import CommRecorder
from labsim.lab.device import rank_device
from labsim.lab.memory import grad_bytes, optimizer_state_bytes, param_bytes
from labsim.lab.profile import OpLog
from labsim.parallel.zero import ShardedOptimizer, fsdp_wrap, zero3_wrap

SETUPS = ("data-parallel Adam", "ZeRO-1", "ZeRO-3 by hand", "FSDP2", "FSDP2, bf16 compute")
# bytes a rank sends per byte of a collective's whole tensor on a ring of n ranks
# (broadcast and reduce: every rank but one passes the tensor on, as in a chain)
def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


@dataclass(frozen=True)
class RankBytes:
    """What one rank holds after a training step -- parameters, gradients and optimizer state
    in bytes -- the model's parameter count ``numel`` (Psi), and what its collectives moved:
    ``sent_bytes`` the bytes a ring implementation sends per rank (all-reduce 2(n-1)/n of its
    tensor, all-gather and reduce-scatter (n-1)/n), ``by_kind`` the whole tensors' bytes per
    kind of collective."""

    params: int
    grads: int
    optimizer: int
    numel: int
    sent_bytes: float = 0.0
    by_kind: dict[str, int] = field(default_factory=dict)


def _wrap(name: str, model: nn.Module, world: int, zero3_linear: Any = None) -> nn.Module:
    if name.startswith("FSDP2"):
        policy = None
        if "bf16" in name:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.float32)
        return fsdp_wrap(model, world, mp_policy=policy)
    if name == "ZeRO-3 by hand":
        return zero3_wrap(model, zero3_linear)
    return model


def bytes_worker(rank: int, world: int, width: int = 256, depth: int = 4,
                 batch: int = 8, zero3_linear: Any = None,
                 zero1_optimizer: Any = None) -> dict[str, RankBytes]:
    """One training step of an fp32 MLP per setup of ``SETUPS``; returns {setup: RankBytes}
    (DTensors counted by their local shard).  ``zero3_linear``: the ZeRO-3 layer class
    (``cls(linear)``, a learner's) of "ZeRO-3 by hand"; default ``Zero3Linear``.
    ``zero1_optimizer``: the ZeRO-1 class (``cls(params, optimizer_cls, **kwargs)``, a
    learner's); default ``ShardedOptimizer``.  Its state is what the tensors its own code
    created still hold after the step (parameters and gradients aside), whatever it calls
    them.  The
    data-parallel run all-reduces its gradients (what DDP would do); ZeRO-1 reduce-scatters
    them and all-gathers the updated parameters; ZeRO-3 and FSDP2 gather every layer before
    its forward and again before its backward and reduce-scatter its gradients."""
    device = rank_device()
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank)).to(device)
    out: dict[str, RankBytes] = {}
    for name in SETUPS:
        model = _mlp(width, depth).to(device)
        numel = sum(p.numel() for p in model.parameters())
        model = _wrap(name, model, world, zero3_linear)
        created = OpLog(keep_created=True)
        if name == "ZeRO-1":
            with created:
                opt: Any = (zero1_optimizer or ShardedOptimizer)(model.parameters(),
                                                                 torch.optim.Adam, lr=1e-3)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        with CommRecorder() as rec:
            model(x).float().square().mean().backward()
            if name == SETUPS[0]:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            grads = grad_bytes(model)  # FSDP2: reduce-scattered shards; others: full ones
            if name == "ZeRO-1":
                with created:
                    opt.step()
            else:
                opt.step()
        params = list(model.parameters())
        grad_tensors = [p.grad for p in params if p.grad is not None]
        if name == "ZeRO-1":
            state = created.settled_held_bytes(params + grad_tensors)
        else:
            state = optimizer_state_bytes(opt)
        by_kind: dict[str, int] = {}
        for op in rec.comms:
            if sent_factor(op.kind, world) is not None:
                by_kind[op.kind] = by_kind.get(op.kind, 0) + op.nbytes
        sent = sum(sent_factor(k, world) * v for k, v in by_kind.items())  # type: ignore
        out[name] = RankBytes(param_bytes(model), grads, state, numel, sent, by_kind)
    return out
