"""Data-parallel training on real processes, timed: is the communication hidden?

``overlap_timing_worker`` (inside ``labsim.lab.launch`` workers) times compute alone, the
gradients' all-reduce alone, naive DDP (all-reduce after backward), ``DataParallelBucket``
(buckets overlapped with backward) and PyTorch's ``DistributedDataParallel`` on one MLP.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from labsim.parallel.data_parallel import DataParallelBucket, average_gradients


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])


@dataclass(frozen=True)
class OverlapTiming:
    """Median seconds per training step on one rank: backward alone (``compute_s``), the
    gradients' all-reduce alone (``comm_s``), naive DDP, ``DataParallelBucket`` and PyTorch's
    ``DistributedDataParallel``; the bucket count and the gradient bytes."""

    compute_s: float
    comm_s: float
    naive_s: float
    bucket_s: float
    ddp_s: float
    buckets: int
    grad_bytes: float


def overlap_timing_worker(rank: int, world: int, width: int = 768, depth: int = 8,
                          batch: int = 32, cap_bytes: float = 4e6,
                          repeat: int = 5) -> OverlapTiming:
    """Median seconds per training step of an MLP (fp32) on this rank, for: backward only
    (no communication), the gradients' all-reduce alone, naive DDP (all-reduce after
    backward), ``DataParallelBucket`` (overlapped) and ``DistributedDataParallel``."""
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))

    def step_fn(model: nn.Module, after: Callable[[], None]) -> Callable[[], None]:
        def step() -> None:
            model(x).square().mean().backward()
            after()
            for p in model.parameters():
                p.grad = None
        return step

    def timed(step: Callable[[], None]) -> float:
        step()  # warm-up
        samples = []
        for _ in range(repeat):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    plain = _mlp(width, depth)
    compute_s = timed(step_fn(plain, lambda: None))
    flat = torch.zeros(sum(p.numel() for p in plain.parameters()))
    comm_s = timed(lambda: dist.all_reduce(flat))
    naive_s = timed(step_fn(plain, partial(average_gradients, plain)))
    del plain  # one model at a time keeps the workers' memory small
    bucket = DataParallelBucket(_mlp(width, depth), bucket_cap_bytes=cap_bytes)
    bucket_s = timed(step_fn(bucket, bucket.finish_gradient_synchronization))
    buckets = len(bucket.buckets)
    del bucket
    ddp = nn.parallel.DistributedDataParallel(_mlp(width, depth),
                                              bucket_cap_mb=cap_bytes / 2**20)
    ddp_s = timed(step_fn(ddp, lambda: None))
    return OverlapTiming(compute_s, comm_s, naive_s, bucket_s, ddp_s, buckets,
                         float(flat.numel() * 4))


