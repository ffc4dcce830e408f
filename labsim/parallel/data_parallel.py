"""Data-parallel training by hand: naive all-reduce after backward, then buckets overlapped
with backward (the design of PyTorch DDP, Li et al. 2020, "PyTorch Distributed"; code in the
style of picotron's ``DataParallelNaive`` -> ``DataParallelBucket``).

Every rank holds a full replica of the model and a different shard of the global batch.
After backward each rank's gradients are averaged over ranks with an all-reduce, so every
replica applies the same update and the replicas never drift apart.  With equal shards the
averaged gradient is exactly the gradient of the whole batch: N ranks on N shards train like
one process on the whole batch (up to float rounding), which is the oracle the lab's checks use.

* ``DataParallelNaive``: broadcast rank 0's parameters at start; after backward, one blocking
  all-reduce per gradient (all communication exposed after backward).
* ``DataParallelBucket``: gradients are packed into buckets of about ``bucket_cap_bytes`` in
  reverse registration order (the order backward produces them); a hook on each parameter
  (``register_post_accumulate_grad_hook``) notes when its gradient is final and, when a
  bucket is full, launches that bucket's all-reduce asynchronously (``async_op=True``) while
  backward continues; ``finish_gradient_synchronization()`` waits for them before the optimizer
  step.  ``no_sync()`` skips communication for gradient accumulation; without it, every
  backward launches every bucket again (PyTorch DDP does the same) and the last launch carries
  the local sum of all of them, so accumulation is right either way, at k times the traffic.

Traps the checks' model carries (``TrapNet``): a frozen parameter (no gradient, must not be
reduced), a parameter unused in forward (its gradient stays None: a bucket waiting for it would
never fill, so buckets are flushed at the end), and tied weights (one parameter used twice: its
hook fires once, with both contributions summed).

All of this runs unchanged under ``torchrun --nproc_per_node=N -m labsim.lab.worker
labsim.parallel.data_parallel:demo`` (gloo on CPUs, NCCL on GPUs).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsim.lab.device import rank_device

__all__ = ["DataParallelBucket", "DataParallelNaive", "TrainingRun", "TrapNet", "lm_loss",
           "make_tokens", "shard", "average_gradients", "broadcast_parameters", "demo"]


class TrapNet(nn.Module):
    """A tiny causal-LM-shaped model with the traps data parallelism must survive: a frozen
    layer, a layer never used in forward and an output layer tied to the embedding."""

    def __init__(self, vocab: int = 13, dim: int = 8, hidden: int = 21, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
            for _ in range(layers))
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(dim, 3)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.frozen(h))


def make_tokens(seed: int, batch: int, seq: int = 6, vocab: int = 13) -> torch.Tensor:
    """A deterministic batch of random token ids, shape (batch, seq + 1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over every predicted token of ``tokens``."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def shard(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of the rows of ``batch`` (world must divide them)."""
    if batch.shape[0] % world:
        raise ValueError(f"batch of {batch.shape[0]} rows does not split over {world} ranks")
    n = batch.shape[0] // world
    return batch[rank * n:(rank + 1) * n]


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (all replicas start equal)."""
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src)


def average_gradients(model: nn.Module) -> None:
    """Naive DDP: after backward, all-reduce every existing gradient and divide by the world
    size, one blocking collective per parameter.  Parameters without a gradient (frozen, or
    unused in this step on every rank) are skipped."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


class DataParallelNaive(nn.Module):
    """Wrap ``module``: rank 0's parameters are broadcast at construction;
    ``finish_gradient_synchronization()`` averages the gradients after backward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        broadcast_parameters(module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        average_gradients(self.module)


class _Bucket:
    """A group of parameters reduced together through one flat buffer."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.ready: set[int] = set()
        self.buffer: torch.Tensor | None = None
        self.work: Any = None


class DataParallelBucket(nn.Module):
    """DDP with gradient buckets whose all-reduces overlap backward.

    ``bucket_cap_bytes``: a bucket is closed once it holds at least this many gradient bytes
    (PyTorch DDP's ``bucket_cap_mb``, default 25 MiB).  ``n_allreduce`` counts the all-reduces
    launched since construction (the lab counts them with gradient accumulation).
    """

    def __init__(self, module: nn.Module, bucket_cap_bytes: float = 25 * 2**20) -> None:
        super().__init__()
        if bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes must be > 0, got {bucket_cap_bytes}")
        self.module = module
        self.require_backward_grad_sync = True
        self.n_allreduce = 0
        broadcast_parameters(module)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(trainable):  # backward produces gradients roughly in this order
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_cap_bytes:
                self.buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current))
        self._where = {id(p): b for b in self.buckets for p in b.params}
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._hook)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communicating."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def _hook(self, p: torch.Tensor) -> None:
        if not self.require_backward_grad_sync:
            return
        bucket = self._where[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            bucket.ready.clear()  # a second backward before the sync launches it again
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        """All-reduce the bucket's current local gradients.  A bucket launched again (a second
        backward before ``finish_gradient_synchronization``, without ``no_sync``) first waits
        for its earlier all-reduce: ``.grad`` still holds the local sum of every backward so
        far, so the latest launch carries all of them and the earlier result is dropped."""
        if bucket.work is not None:
            bucket.work.wait()
        flat = [p.grad.reshape(-1) if p.grad is not None else
                torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in bucket.params]
        bucket.buffer = torch.cat(flat)
        bucket.buffer.div_(dist.get_world_size())
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        self.n_allreduce += 1

    def finish_gradient_synchronization(self) -> None:
        """Launch buckets that never filled (a parameter unused in this step), wait for every
        all-reduce, and copy the averaged gradients back into ``.grad``."""
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            offset = 0
            for p in bucket.params:
                n = p.numel()
                p.grad = bucket.buffer[offset:offset + n].view_as(p).clone()
                offset += n
            bucket.work, bucket.buffer = None, None
            bucket.ready.clear()


def demo(rank: int, world: int) -> float:
    """torchrun smoke test: 3 SGD steps of bucketed DDP on ``TrapNet``; returns the largest
    difference between this rank's parameters and rank 0's (0.0 when right)."""
    device = rank_device()
    torch.manual_seed(rank)  # replicas start different; the broadcast makes them equal
    model = DataParallelBucket(TrapNet().double().to(device), bucket_cap_bytes=200)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        tokens = shard(make_tokens(step, 4 * world), rank, world).to(device)
        loss = lm_loss(model, tokens)
        loss.backward()
        model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    return float((flat - ref).abs().max())


@dataclass(frozen=True)
class TrainingRun:
    """What a training run produced on one rank (or in one process): each step's loss, the
    final parameters, and how far this rank's parameters ended from rank 0's."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    spread: float = 0.0


def parameters_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every named parameter (tied ones once), for comparisons."""
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def serial_reference(init_seed: int, batches: Sequence[torch.Tensor], lr: float = 0.1,
                     accumulate: int = 1) -> TrainingRun:
    """One process on whole batches: SGD steps on ``TrapNet`` (float64) initialised with
    ``init_seed``; ``accumulate`` micro-batches per step (each batch split row-wise).
    Returns the losses and the final parameters (a ``TrainingRun``)."""
    torch.manual_seed(init_seed)
    model = TrapNet().double()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for batch in batches:
        total = 0.0
        for mb in batch.chunk(accumulate):
            loss = lm_loss(model, mb) / accumulate
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return TrainingRun(losses, parameters_of(model))
