"""All-reduce on real processes, timed: the learner's ring against the library's.

``timing_worker`` runs inside ``labsim.lab.launch`` workers with the functions to compare
shipped by value and returns the median seconds per call for each size; ``rank_tensor`` is the
deterministic per-rank input every worker (timing and checking) uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def rank_tensor(rank: int, numel: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A deterministic tensor that differs per rank (so a wrong reduction shows)."""
    g = torch.Generator().manual_seed(1000 + rank * 7919 + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def timing_worker(rank: int, world: int, fns: dict[str, AllReduce], sizes: Sequence[int],
                  repeat: int = 5) -> dict[str, list[float]]:
    """Median seconds per call of each all-reduce function for each size (float32)."""
    times: dict[str, list[float]] = {}
    for name, fn in fns.items():
        times[name] = []
        for numel in sizes:
            x = rank_tensor(rank, numel, torch.float32)
            fn(x.clone())  # warm-up
            samples = []
            for _ in range(repeat):
                y = x.clone()
                dist.barrier()
                t0 = time.perf_counter()
                fn(y)
                dist.barrier()
                samples.append(time.perf_counter() - t0)
            times[name].append(sorted(samples)[len(samples) // 2])
    return times


def torch_allreduce(tensor: torch.Tensor) -> torch.Tensor:
    """``dist.all_reduce`` (gloo's or NCCL's own algorithm), with the same signature."""
    dist.all_reduce(tensor)
    return tensor


