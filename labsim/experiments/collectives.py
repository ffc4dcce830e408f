"""All-reduce on real processes, timed: the learner's ring against the library's.

``timing_worker`` runs inside ``labsim.lab.launch`` workers with the functions to compare
shipped by value and returns the median seconds per call for each size; ``rank_tensor`` is the
deterministic per-rank input every worker (timing and checking) uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

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
                  repeat: int = 5, samples: bool = False) -> dict[str, list[Any]]:
    """Median seconds per call of each all-reduce function for each size (float32); with
    ``samples=True`` every call's seconds, sorted, so the caller can see their spread."""
    times: dict[str, list[Any]] = {}
    for name, fn in fns.items():
        times[name] = []
        for numel in sizes:
            x = rank_tensor(rank, numel, torch.float32)
            fn(x.clone())  # warm-up
            seconds = []
            for _ in range(repeat):
                y = x.clone()
                dist.barrier()
                t0 = time.perf_counter()
                fn(y)
                dist.barrier()
                seconds.append(time.perf_counter() - t0)
            seconds.sort()
            times[name].append(seconds if samples else seconds[len(seconds) // 2])
    return times


def held_out_verdict(predicted_s: float, seconds: Sequence[float],
                     noisy_spread: float = 0.5) -> str:
    """How a model's prediction for one held-out size compares with that size's repeated
    timings: the error against their median, read against their own spread (the middle half
    of the repeats, relative to the median).  When that spread is above ``noisy_spread`` the
    machine was too busy for the timing to judge the model, and the verdict says so."""
    if not seconds:
        raise ValueError("no timings: time the held-out size at least once (repeat >= 1)")
    ordered = sorted(seconds)
    n = len(ordered)
    median, low, high = ordered[n // 2], ordered[n // 4], ordered[(3 * n) // 4]
    spread = (high - low) / median
    error = predicted_s / median - 1
    where = (f"measured median {median * 1e6:.0f} us over {n} calls (middle half "
             f"{low * 1e6:.0f}-{high * 1e6:.0f} us, spread {spread:.0%}), predicted "
             f"{predicted_s * 1e6:.0f} us")
    if spread > noisy_spread:
        return (f"{where}: too noisy to tell -- the repeats themselves differ by more than "
                f"{noisy_spread:.0%}; rerun when the machine is quieter")
    if low <= predicted_s <= high:
        return f"{where}: within the middle half of the repeats ({error:+.0%} from the median)"
    return f"{where}: {error:+.0%} from the median, outside the repeats' middle half"


def torch_allreduce(tensor: torch.Tensor) -> torch.Tensor:
    """``dist.all_reduce`` (gloo's or NCCL's own algorithm), with the same signature."""
    dist.all_reduce(tensor)
    return tensor


