"""ZeRO stage 1 by hand: Adam whose state each rank keeps only for its shard of the parameters
(Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", P_os), and the FSDP2 (``torch.distributed.fsdp.fully_shard``) counterpart.

``ZeroAdam`` views the trainable parameters as one flat vector of Psi elements cut into
``world_size`` contiguous shards (the first ones one element longer when Psi does not
divide).  Each step: the gradients are averaged over the ranks; each rank runs Adam on its
shard only (so it holds 2 Psi / N moments instead of 2 Psi), then the updated shards are
all-gathered so every replica has the whole updated model.  Adam is elementwise, so this is
exactly unsharded Adam.  Real ZeRO reduce-scatters the gradients (each rank needs only its
shard, Psi traffic) and all-gathers the parameters (Psi): 2 Psi per step like plain DP;
gloo has no reduce-scatter on CPUs, so this reference all-reduces (same result, more
traffic) and says so.

Runs under ``torchrun --nproc_per_node=N -m labsim.lab.worker labsim.parallel.zero:demo``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from labsim.lab.device import rank_device

__all__ = ["ZeroAdam", "shard_bounds", "demo", "fsdp_wrap"]


def shard_bounds(numel: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s contiguous shard of ``numel`` elements over ``world`` ranks
    (``torch.tensor_split`` sizes: the first ``numel % world`` shards one element longer)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of range for world size {world}")
    base, extra = divmod(numel, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ZeroAdam:
    """ZeRO-1 Adam over the default process group (see the module docstring).

    ``params``: the model's trainable parameters, identical on every rank (the same order);
    ``lr``, ``betas``, ``eps`` as ``torch.optim.Adam`` (no weight decay).  ``state_tensors()``
    lists the Adam state this rank holds (two moments of its shard).
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.end = shard_bounds(self.numel, self.world, self.rank)
        self.chunk = -(-self.numel // self.world)  # all-gather needs equal pieces: pad
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard = flat[self.start:self.end].clone().requires_grad_(True)
        self.inner = torch.optim.Adam([self.shard], lr=lr, betas=betas, eps=eps)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        """The Adam moments held by this rank (empty before the first step)."""
        st = self.inner.state.get(self.shard, {})
        return [st[k] for k in ("exp_avg", "exp_avg_sq") if k in st]

    @torch.no_grad()
    def step(self) -> None:
        grads = torch.cat([p.grad.reshape(-1) if p.grad is not None else
                           torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                           for p in self.params])
        dist.all_reduce(grads)  # real ZeRO: reduce_scatter (each rank keeps its shard)
        grads.div_(self.world)
        self.shard.grad = grads[self.start:self.end].clone()
        self.inner.step()
        piece = torch.zeros(self.chunk, dtype=self.shard.dtype, device=self.shard.device)
        piece[:self.end - self.start] = self.shard
        gathered = [torch.empty_like(piece) for _ in range(self.world)]
        dist.all_gather(gathered, piece)
        flat = torch.cat([g[:shard_bounds(self.numel, self.world, r)[1] -
                            shard_bounds(self.numel, self.world, r)[0]]
                          for r, g in enumerate(gathered)])
        offset = 0
        for p in self.params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def fsdp_wrap(model: nn.Module, world: int) -> nn.Module:
    """FSDP2: shard each child module with ``fully_shard`` on a 1-D device mesh of the
    process group (CPU mesh with gloo, CUDA mesh with NCCL), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(rank_device().type, (world,))
    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def demo(rank: int, world: int) -> float:
    """torchrun smoke test: 3 ZeRO-1 Adam steps on ``TrapNet``; returns the largest
    difference between this rank's parameters and rank 0's (0.0 when right)."""
    from labsim.parallel.data_parallel import (
        TrapNet,
        broadcast_parameters,
        lm_loss,
        make_tokens,
        shard,
    )

    device = rank_device()
    torch.manual_seed(rank)
    model = TrapNet().double().to(device)
    broadcast_parameters(model)
    opt = ZeroAdam(model.parameters(), lr=0.01)
    for step in range(3):
        tokens = shard(make_tokens(step, 4 * world), rank, world).to(device)
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    return float((flat - ref).abs().max())
