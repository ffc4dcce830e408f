"""Data-parallel training on real processes, timed: is the communication hidden?

``overlap_timing_worker`` (inside ``labsim.lab.launch`` workers) times compute alone, the
gradients' all-reduce alone, naive DDP (all-reduce after backward), ``DataParallelBucket``
(buckets overlapped with backward) and PyTorch's ``DistributedDataParallel`` on one MLP;
``wire_steps`` runs a bucketed DDP in this process with its all-reduces on an emulated wire of
known speed (the work handle sleeps until the bytes would have arrived), so the overlap can be
measured on a CPU whose cores gloo would otherwise share with the compute.
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
    ``DistributedDataParallel``; the bucket count and the gradient bytes; and the same
    backward while an all-reduce of the gradients' size runs beside it
    (``compute_with_comm_s``: how much the communication slows the compute it overlaps)."""

    compute_s: float
    comm_s: float
    naive_s: float
    bucket_s: float
    ddp_s: float
    buckets: int
    grad_bytes: float
    compute_with_comm_s: float = 0.0


def overlap_timing_worker(rank: int, world: int, width: int = 768, depth: int = 8,
                          batch: int = 32, cap_bytes: float = 4e6,
                          repeat: int = 3) -> OverlapTiming:
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
    contended = []
    for _ in range(repeat):
        dist.barrier()
        work = dist.all_reduce(flat, async_op=True)
        t0 = time.perf_counter()
        step_fn(plain, lambda: None)()
        contended.append(time.perf_counter() - t0)
        work.wait()
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
                         float(flat.numel() * 4), statistics.median(contended))




# --------------------------------------------------------------------------------------
# Overlap on a wire of known speed


@dataclass(frozen=True)
class WireStep:
    """One training step of a bucketed DDP whose all-reduces travel on an emulated wire.

    Times in seconds from the start of backward: ``backward_s`` (when backward returned),
    ``launches_s`` and ``arrivals_s`` per bucket all-reduce (launched by the DDP's hooks; the
    wire delivers it ``alpha_s + nbytes / bandwidth_Bps`` after it is free), ``step_s`` (when
    ``finish_gradient_synchronization`` returned); ``wire_s`` is the wire's busy time, the
    communication the step needs."""

    bandwidth_Bps: float
    backward_s: float
    launches_s: list[float]
    arrivals_s: list[float]
    nbytes: list[int]
    step_s: float
    wire_s: float

    @property
    def exposed_s(self) -> float:
        """How long after backward the last bucket arrived: communication nothing hid."""
        return max(0.0, max(self.arrivals_s, default=0.0) - self.backward_s)

    @property
    def hidden_s(self) -> float:
        """Communication that ran while backward still computed."""
        return max(0.0, self.wire_s - self.exposed_s)

    @property
    def overhead_s(self) -> float:
        """The rest of the step after backward: waiting on handles and copying the averaged
        buckets back into ``.grad`` (CPU work the wire does not account for)."""
        return max(0.0, self.step_s - self.backward_s - self.exposed_s)


class _WireWork:
    """The work handle of an emulated all-reduce: ``wait()`` sleeps until its arrival (the
    core is free meanwhile, as it is while a NIC or NVLink moves bytes)."""

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival

    def wait(self, timeout: object = None) -> bool:
        delay = self.arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return True

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.arrival


class _Wire:
    """One process standing in for N: ``broadcast`` does nothing (one replica), the world has
    one rank, and ``all_reduce`` puts its message on a wire of ``bandwidth_Bps`` that carries
    one message at a time, each ``alpha_s + nbytes / bandwidth_Bps`` (the reduction itself is
    skipped: the average of one gradient is that gradient)."""

    _PATCHED = ("all_reduce", "broadcast", "get_world_size", "get_rank")

    def __init__(self, bandwidth_Bps: float, alpha_s: float) -> None:
        self.bandwidth_Bps, self.alpha_s = bandwidth_Bps, alpha_s
        self.free_at = 0.0
        self.log: list[tuple[float, float, int]] = []

    def all_reduce(self, tensor: torch.Tensor, *args: object, async_op: bool = False,
                   **kwargs: object) -> _WireWork | None:
        now = time.perf_counter()
        nbytes = tensor.numel() * tensor.element_size()
        arrival = max(now, self.free_at) + self.alpha_s + nbytes / self.bandwidth_Bps
        self.free_at = arrival
        self.log.append((now, arrival, nbytes))
        work = _WireWork(arrival)
        if async_op:
            return work
        work.wait()
        return None

    def broadcast(self, tensor: torch.Tensor, *args: object, async_op: bool = False,
                  **kwargs: object) -> _WireWork | None:
        return _WireWork(0.0) if async_op else None

    def get_world_size(self, *args: object, **kwargs: object) -> int:
        return 1

    def get_rank(self, *args: object, **kwargs: object) -> int:
        return 0

    def __enter__(self) -> _Wire:
        self._saved = {n: getattr(dist, n) for n in self._PATCHED}
        for n in self._PATCHED:
            setattr(dist, n, getattr(self, n))
        return self

    def __exit__(self, *exc: object) -> None:
        for n, f in self._saved.items():
            setattr(dist, n, f)


def wire_steps(cls: Callable[..., nn.Module], bandwidths_Bps: tuple[float, ...] = (
        20e9, 1e9, 0.25e9), alpha_s: float = 50e-6, cap_bytes: float = 4e6, width: int = 768,
        depth: int = 8, batch: int = 32, repeat: int = 3, progress: bool = True
        ) -> list[WireStep]:
    """For each bandwidth: wrap an MLP (fp32) in ``cls(module, cap_bytes)`` -- a bucketed DDP
    such as the lab's ``BucketDDP`` -- and time training steps in this process with
    ``torch.distributed``'s calls on an emulated wire (``_Wire``: no process group needed).
    Returns the median step (by step time) of ``repeat`` after a warm-up, per bandwidth.
    Runs on one intra-op thread (restored after): on a shared CPU two threads that wait for
    each other make the step's time, not the wire, the story."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _wire_steps(cls, bandwidths_Bps, alpha_s, cap_bytes, width, depth, batch,
                           repeat, progress)
    finally:
        torch.set_num_threads(threads)


def _wire_steps(cls: Callable[..., nn.Module], bandwidths_Bps: tuple[float, ...],
                alpha_s: float, cap_bytes: float, width: int, depth: int, batch: int,
                repeat: int, progress: bool) -> list[WireStep]:
    from tqdm.auto import tqdm

    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(0))
    out = []
    for bandwidth in tqdm(bandwidths_Bps, desc="wire speeds", disable=not progress):
        with _Wire(bandwidth, alpha_s) as wire:
            ddp = cls(_mlp(width, depth), cap_bytes)
            steps = []
            for i in range(repeat + 1):
                wire.log.clear()
                wire.free_at = 0.0
                loss = ddp(x).square().mean()
                t0 = time.perf_counter()
                loss.backward()
                t_backward = time.perf_counter()
                ddp.finish_gradient_synchronization()
                t_step = time.perf_counter()
                for p in ddp.parameters():
                    p.grad = None
                if i:  # the first is a warm-up
                    log = list(wire.log)
                    steps.append(WireStep(
                        bandwidth, t_backward - t0, [a - t0 for a, _, _ in log],
                        [b - t0 for _, b, _ in log], [n for *_, n in log], t_step - t0,
                        sum(alpha_s + n / bandwidth for *_, n in log)))
        out.append(sorted(steps, key=lambda s: s.step_s)[len(steps) // 2])
    return out
