"""Worker drivers of lab 08 (data parallel): run a learner's DDP on real processes.

Each driver runs inside ``labsim.lab.launch`` workers with the learner's functions shipped by
value, trains ``TrapNet`` (float64, so rounding cannot hide a bug) on shards of fixed batches
and returns what a check compares with ``serial_reference``, one process on the whole batch.
Replicas are initialised with different seeds per rank on purpose: only a broadcast makes
them equal.  ``overlap_timing_worker`` times compute, communication and whole steps of a
wider MLP for the "hidden vs exposed communication" measurement.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labsim.parallel.data_parallel import (
    DataParallelBucket,
    TrapNet,
    average_gradients,
    lm_loss,
    make_tokens,
    parameters_of,
    shard,
)

BATCH, STEPS, LR, INIT_SEED = 8, 3, 0.1, 1000


def batches(steps: int = STEPS, batch: int = BATCH) -> list[torch.Tensor]:
    """The global batches every driver and the serial reference train on."""
    return [make_tokens(100 + s, batch) for s in range(steps)]


def _model(rank: int) -> nn.Module:
    torch.manual_seed(INIT_SEED + rank)  # rank 0 starts like the serial reference
    return TrapNet().double()


def _global_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _spread(model: nn.Module) -> float:
    """Largest difference between this rank's parameters and rank 0's."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    return float((flat - ref).abs().max())


def _guard(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except NotImplementedError:
        return NotImplementedError("the exercise raised NotImplementedError")
    except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def naive_worker(rank: int, world: int, sync: Callable, average: Callable) -> dict[str, Any]:
    """``sync(model)`` then SGD steps with ``average(model)`` after each backward."""
    model = _model(rank)
    out: dict[str, Any] = {}
    res = _guard(sync, model)
    out["spread_after_sync"] = res if isinstance(res, Exception) else _spread(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for b in batches():
        loss = lm_loss(model, shard(b, rank, world))
        loss.backward()
        res = _guard(average, model)
        if isinstance(res, Exception):
            out["error"] = res
            return out
        opt.step()
        opt.zero_grad()
        losses.append(_global_mean(float(loss.detach())))
    out.update(losses=losses, params=parameters_of(model), spread=_spread(model))
    return out


class _CountAllReduce:
    """Count ``dist.all_reduce`` calls, how many were issued inside backward and how many
    were asynchronous (patched on the module, so learner code calling it is seen)."""

    def __init__(self) -> None:
        self.calls = self.in_backward = self.asynchronous = 0
        self.backward_running = False
        self._orig = dist.all_reduce

    def __enter__(self) -> _CountAllReduce:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.in_backward += self.backward_running
            self.asynchronous += bool(kwargs.get("async_op", False))
            return self._orig(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._orig


def bucket_worker(rank: int, world: int, cls: Callable, caps: Sequence[float]) -> list[Any]:
    """For each bucket cap: ``cls(model, cap)``, SGD steps with
    ``finish_gradient_synchronization()`` before each optimizer step; all-reduces counted."""
    out: list[Any] = []
    for cap in caps:
        model = _model(rank)
        ddp = _guard(cls, model, cap)
        if isinstance(ddp, Exception):
            out.append(ddp)
            continue
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        losses = []
        with _CountAllReduce() as count:
            for b in batches():
                loss = lm_loss(ddp, shard(b, rank, world))
                count.backward_running = True
                err = _guard(loss.backward)
                count.backward_running = False
                err = err or _guard(ddp.finish_gradient_synchronization)
                if isinstance(err, Exception):
                    break
                opt.step()
                opt.zero_grad()
                losses.append(float(loss.detach()))
        if isinstance(err, Exception):
            out.append(err)
            continue
        out.append({"losses": [_global_mean(v) for v in losses],
                    "params": parameters_of(model), "spread": _spread(model), "calls": count.calls,
                    "in_backward": count.in_backward,
                    "async": count.asynchronous})
    return out


def accumulate_worker(rank: int, world: int, fn: Callable, ks: Sequence[int],
                      cap: float = 600.0) -> list[Any]:
    """For each ``k``: ``fn(ddp, optimizer, micro_batches)`` per step on a
    ``DataParallelBucket`` over this rank's shard cut into ``k`` micro-batches."""
    out: list[Any] = []
    for k in ks:
        ddp = DataParallelBucket(_model(rank), bucket_cap_bytes=cap)
        opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=LR)
        losses, err = [], None
        for b in batches():
            before = ddp.n_allreduce
            res = _guard(fn, ddp, opt, list(shard(b, rank, world).chunk(k)))
            if isinstance(res, Exception):
                err = res
                break
            losses.append(_global_mean(float(res)))
            calls = ddp.n_allreduce - before
        out.append(err if err is not None else {
            "losses": losses, "params": parameters_of(ddp.module), "spread": _spread(ddp),
            "calls_per_step": calls, "buckets": len(ddp.buckets)})
    return out


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])


def overlap_timing_worker(rank: int, world: int, width: int = 768, depth: int = 8,
                          batch: int = 32, cap_bytes: float = 4e6,
                          repeat: int = 5) -> dict[str, float]:
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
    out = {"compute_s": timed(step_fn(plain, lambda: None))}
    flat = torch.zeros(sum(p.numel() for p in plain.parameters()))
    out["comm_s"] = timed(lambda: dist.all_reduce(flat))
    out["naive_s"] = timed(step_fn(plain, partial(average_gradients, plain)))
    del plain  # one model at a time keeps the workers' memory small
    bucket = DataParallelBucket(_mlp(width, depth), bucket_cap_bytes=cap_bytes)
    out["bucket_s"] = timed(step_fn(bucket, bucket.finish_gradient_synchronization))
    out["buckets"] = len(bucket.buckets)
    del bucket
    ddp = nn.parallel.DistributedDataParallel(_mlp(width, depth),
                                              bucket_cap_mb=cap_bytes / 2**20)
    out["ddp_s"] = timed(step_fn(ddp, lambda: None))
    out["grad_bytes"] = float(flat.numel() * 4)
    return out
