"""ZeRO stage 1 by hand: an optimizer whose state each rank keeps only for its share of the
parameters (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", P_os), ZeRO-3 by hand (``Zero3Linear``: gather each layer for forward and
again for backward, reduce-scatter its gradient) and the FSDP2
(``torch.distributed.fsdp.fully_shard``) counterpart.

``ShardedOptimizer(params, optimizer_cls, **kwargs)`` wraps any ``torch.optim.Optimizer``
class with its keyword arguments and parameter groups (the interface of Stanford CS336's
assignment 2).  Every trainable parameter is owned by one rank (greedy by size, the same on
every rank); each rank builds ``optimizer_cls`` over the parameters it owns only, so it holds
about 1/N of the optimizer state.  A step:

1. the gradients are **reduce-scattered** (``dist.reduce_scatter_tensor``, which gloo
   implements on CPUs too): each rank receives the sum of its own parameters' gradients only,
   (N-1)/N Psi elements on a ring, and divides by N;
2. the owner runs the wrapped optimizer on its parameters;
3. the updated parameters are **all-gathered** (``dist.all_gather_into_tensor``), another
   (N-1)/N Psi: 2 Psi per step, the same as plain data parallelism's all-reduce.

Owning whole parameters (not a flat slice) keeps any optimizer exact, elementwise or not
(weight decay, per-group learning rates, LAMB's per-tensor norms); the price is balance: the
collectives need equal segments, so every rank's segment is padded to the largest share (none
when the sizes split evenly, as for a stack of equal layers).  A parameter whose
gradient is ``None`` on every rank this step (frozen, or unused in this forward) is skipped
like ``torch.optim`` skips it -- it is not treated as a zero gradient, which would keep an Adam
parameter moving on its momentum; one with a gradient on some ranks only is reduced with
zeros from the others, as DDP's ``find_unused_parameters`` does.  So N ranks on N shards of a
batch train exactly like ``optimizer_cls`` in one process on the whole batch.

Runs under ``torchrun --nproc_per_node=N -m labsim.lab.worker labsim.parallel.zero:demo``
(gloo on CPUs, NCCL on GPUs; every buffer on the parameters' device).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labsim.lab.device import rank_device

__all__ = ["ShardedOptimizer", "Zero3Linear", "owners", "shard_bounds", "demo", "fsdp_wrap",
           "zero3_wrap"]


def shard_bounds(numel: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s contiguous shard of ``numel`` elements over ``world`` ranks
    (``torch.tensor_split`` sizes: the first ``numel % world`` shards one element longer)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of range for world size {world}")
    base, extra = divmod(numel, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def owners(sizes: Iterable[int], world: int, load: list[int] | None = None) -> list[int]:
    """The rank owning each parameter of ``sizes`` (elements), greedy: each goes to the rank
    holding the fewest elements so far (the lowest such rank on a tie).  ``load`` (per rank,
    updated in place) carries the counts over from earlier parameter groups."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    load = load if load is not None else [0] * world
    out = []
    for n in sizes:
        r = min(range(world), key=lambda k: (load[k], k))
        load[r] += n
        out.append(r)
    return out


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 over the default process group around ``optimizer_cls`` (see the module doc).

    ``params``: parameters or parameter groups (dicts), identical on every rank, in the same
    order; ``optimizer_cls`` and ``**kwargs``: the optimizer each rank runs on what it owns.
    ``state_tensors()`` lists the optimizer state this rank holds.
    """

    def __init__(self, params: Any, optimizer_cls: type[torch.optim.Optimizer],
                 **kwargs: Any) -> None:
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self._cls, self._kwargs = optimizer_cls, kwargs
        self._load = [0] * self.world
        self._owner: dict[int, int] = {}
        self.inner: torch.optim.Optimizer | None = None
        super().__init__(params, defaults=kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        params = [p for p in group["params"] if p.requires_grad]
        for p, r in zip(params, owners([p.numel() for p in params], self.world, self._load)):
            self._owner[id(p)] = r
        mine = {**{k: v for k, v in group.items() if k != "params"},
                "params": [p for p in params if self._owner[id(p)] == self.rank]}
        if self.inner is None:
            self.inner = self._cls([mine], **self._kwargs)
        else:
            self.inner.add_param_group(mine)

    def _trainable(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if id(p) in self._owner]

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer state tensors this rank holds (empty before the first step)."""
        assert self.inner is not None
        return [v for st in self.inner.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        params = self._trainable()
        if not params:
            return None
        device, dtype = params[0].device, params[0].dtype
        if any(p.dtype != dtype for p in params):
            raise ValueError("ShardedOptimizer needs one dtype for all parameters; "
                             "cast the model (e.g. model.float()) or shard per dtype")
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                           device=device)
        dist.all_reduce(has)  # which parameters have a gradient on some rank this step
        live = [p for p, h in zip(params, has.tolist()) if h]
        per_rank = [[p for p in live if self._owner[id(p)] == r] for r in range(self.world)]
        width = max(sum(p.numel() for p in ps) for ps in per_rank)
        if width == 0:
            return None
        send = torch.zeros(self.world, width, dtype=dtype, device=device)
        for r, ps in enumerate(per_rank):
            offset = 0
            for p in ps:
                if p.grad is not None:
                    send[r, offset:offset + p.numel()] = p.grad.reshape(-1)
                offset += p.numel()
        mine = torch.empty(width, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(mine, send.reshape(-1))
        mine.div_(self.world)
        owned = {id(p) for p in per_rank[self.rank]}
        offset = 0
        for p in params:  # the owner's gradient is the average; unused everywhere: None
            if id(p) in owned:
                p.grad = mine[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            elif self._owner[id(p)] == self.rank:
                p.grad = None
        assert self.inner is not None
        loss = self.inner.step(closure)
        piece = torch.zeros(width, dtype=dtype, device=device)
        offset = 0
        for p in per_rank[self.rank]:
            piece[offset:offset + p.numel()] = p.reshape(-1)
            offset += p.numel()
        gathered = torch.empty(self.world * width, dtype=dtype, device=device)
        dist.all_gather_into_tensor(gathered, piece)
        for r, ps in enumerate(per_rank):
            offset = r * width
            for p in ps:
                p.copy_(gathered[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        return loss


def _gather_layer(shard: torch.Tensor, out_features: int, in_features: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather a linear layer's flat shards into its (weight, bias)."""
    full = shard.new_empty(dist.get_world_size() * shard.numel())
    dist.all_gather_into_tensor(full, shard.detach().contiguous())
    n = out_features * in_features
    return full[:n].view(out_features, in_features), full[n:n + out_features]


class _GatheredLinear(torch.autograd.Function):
    """ZeRO-3's linear layer: gather the parameters for forward and free them; gather them
    again for backward, then reduce-scatter the flat gradient so each rank keeps its shard
    (the mean over ranks, as data parallelism averages)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: torch.Tensor, out_features: int,
                in_features: int) -> torch.Tensor:
        weight, bias = _gather_layer(shard, out_features, in_features)
        ctx.save_for_backward(x, shard)
        ctx.features = (out_features, in_features)
        return torch.nn.functional.linear(x, weight, bias)  # the gathered copy dies here

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:
        x, shard = ctx.saved_tensors
        out_features, in_features = ctx.features
        weight, _ = _gather_layer(shard, out_features, in_features)  # gathered again
        gy, xs = grad_y.reshape(-1, out_features), x.reshape(-1, in_features)
        flat = torch.cat([(gy.T @ xs).reshape(-1), gy.sum(0)])
        world = dist.get_world_size()
        padded = flat.new_zeros(world * shard.numel())
        padded[:flat.numel()] = flat
        mine = torch.empty_like(shard)
        dist.reduce_scatter_tensor(mine, padded)
        return grad_y @ weight, mine / world, None, None


class Zero3Linear(nn.Module):
    """A ``nn.Linear`` stored as this rank's 1/N flat shard of its weight and bias (padded to
    equal shards): ZeRO-3 by hand (Rajbhandari et al. 2020, P_os+g+p), 3 Psi per step:
    an all-gather before forward, another before backward, a reduce-scatter of the gradient."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        world, rank = dist.get_world_size(), dist.get_rank()
        if linear.bias is None:
            raise ValueError("Zero3Linear needs a bias; build the layer with bias=True")
        flat = torch.cat([linear.weight.detach().reshape(-1), linear.bias.detach()])
        per = -(-flat.numel() // world)
        padded = flat.new_zeros(world * per)
        padded[:flat.numel()] = flat
        self.shard = nn.Parameter(padded[rank * per:(rank + 1) * per].clone())
        self.out_features, self.in_features = linear.out_features, linear.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatheredLinear.apply(x, self.shard, self.out_features, self.in_features)


def zero3_wrap(model: nn.Module, layer_cls: Any = None) -> nn.Module:
    """Replace every ``nn.Linear`` child of ``model`` (a ``nn.Sequential``, say) by
    ``layer_cls(child)`` (default ``Zero3Linear``) holding this rank's shard; the ranks must
    start from equal weights."""
    make = layer_cls if layer_cls is not None else Zero3Linear
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, make(child))
    return model


def fsdp_wrap(model: nn.Module, world: int, mp_policy: Any = None,
              reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2: shard each child module with ``fully_shard`` on a 1-D device mesh of the
    process group (CPU mesh with gloo, CUDA mesh with NCCL), then the root.

    ``reshard_after_forward=True`` (the default for non-root modules) frees each layer's
    gathered parameters after its forward and gathers them again for backward: ZeRO-3, 3 Psi
    per step; ``False`` keeps them from forward to backward (no second gather, 2 Psi, like
    ZeRO-2, at the memory of unsharded parameters).  ``mp_policy``: a
    ``torch.distributed.fsdp.MixedPrecisionPolicy`` (e.g. bf16 ``param_dtype``: the gathers
    move bf16 and the layers compute in it).  A 2-D mesh (``HSDP``: shard inside a group,
    replicate across groups) is the other layout FSDP2 offers; see PyTorch's ``fully_shard``
    documentation."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(rank_device().type, (world,))
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=mesh, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def demo(rank: int, world: int) -> float:
    """torchrun smoke test: 3 ZeRO-1 AdamW steps on ``TrapNet`` on the rank's device; returns
    the largest difference between this rank's parameters and rank 0's (0.0 when right)."""
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
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    for step in range(3):
        tokens = shard(make_tokens(step, 4 * world), rank, world).to(device)
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    return float((flat - ref).abs().max())
