"""Checks for lab 08 (data parallel): the learner's DDP on 2 real gloo processes against one
process on the whole batch (parallel = serial is the oracle).

The model (``TrapNet``, float64) carries a frozen layer, a layer unused in forward and tied
embedding/output weights.  Each check is one launch; a worker that raises or hangs ends the
check with a FAIL line within ``timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labsim.checks._core import Case, CheckFailed, close, run_check
from labsim.lab.launcher import LaunchTimeout, WorkerError, launch
from labsim.parallel.data_parallel import (
    DataParallelBucket,
    TrainingRun,
    TrapNet,
    lm_loss,
    make_tokens,
    parameters_of,
    serial_reference,
    shard,
)

NPROCS = 2
BATCH, STEPS, LR, INIT_SEED = 8, 3, 0.1, 1000
TOL = close(rtol=1e-9, atol=1e-12)


@dataclass(frozen=True)
class DdpRun(TrainingRun):
    """One rank's run under a learner's data parallelism, and what it did on the wire:
    ``spread_after_sync`` (rank 0 minus this rank right after ``sync_parameters``, or the error
    it raised), the all-reduces it issued (in backward, asynchronous), those per optimizer step
    and the buckets it used."""

    spread_after_sync: float | Exception = 0.0
    allreduce_calls: int = 0
    in_backward: int = 0
    asynchronous: int = 0
    calls_per_step: int = 0
    buckets: int = 0


def _launch(title: str, n_cases: int, fn: Any, args: tuple, timeout_s: float) -> Any:
    try:
        return launch(fn, NPROCS, args=args, timeout_s=timeout_s)
    except (LaunchTimeout, WorkerError) as exc:
        raise CheckFailed(f"FAIL {title}: 0/{n_cases} cases passed\n{exc}") from None


def _stub(title: str, n_cases: int, probe: Callable[[], Any]) -> None:
    """Fail at once (no processes started) when the exercise still raises
    NotImplementedError."""
    try:
        probe()
    except NotImplementedError:
        raise CheckFailed(f"FAIL {title}: 0/{n_cases} cases passed\nthe exercise raises "
                          "NotImplementedError: write it first") from None
    except Exception:  # noqa: BLE001 - expected: no process group in this process
        pass


def _check_outcomes(title: str, names: list[str], got: list[Any],
                    expected: list[Any]) -> None:
    """Run a check over results computed in one launch: case i compares ``got[i]`` (re-raised
    if that part of the run failed) with ``expected[i]``."""
    def outcome(i: int) -> Any:
        if isinstance(got[i], Exception):
            raise got[i]
        return got[i]

    cases = [Case(name, (i,), expected=exp)
             for i, (name, exp) in enumerate(zip(names, expected, strict=True))]
    run_check(title, outcome, cases, compare=TOL)


def _serial(accumulate: int = 1) -> TrainingRun:
    return serial_reference(INIT_SEED, batches(), lr=LR, accumulate=accumulate)


def naive_ddp(sync_parameters: Callable[[torch.nn.Module], None],
              average_gradients: Callable[[torch.nn.Module], None],
              timeout_s: float = 120.0) -> None:
    """``sync_parameters(model)`` must make every replica equal to rank 0's;
    ``average_gradients(model)`` after backward must leave every rank with the gradient of
    the whole batch, so 2 ranks on 2 shards train exactly like one process on the batch."""

    title, n = "naive_ddp", 6
    _stub(title, n, lambda: sync_parameters(torch.nn.Linear(1, 1)))
    _stub(title, n, lambda: average_gradients(torch.nn.Linear(1, 1)))
    ranks = _launch(title, n, naive_worker, (sync_parameters, average_gradients), timeout_s)
    ref = _serial()
    r0, r1 = ranks[0], ranks[1]
    bad = next((r for r in (r0, r1) if isinstance(r, Exception)), None)
    frozen = ref.params["frozen.weight"]
    got = [bad or r0.spread_after_sync, bad or r0.losses, bad or r0.params,
           bad or r1.spread, bad or r0.params["frozen.weight"],
           bad or r1.params["unused.weight"]]
    exp = [0.0, ref.losses, ref.params, 0.0, frozen, ref.params["unused.weight"]]
    names = ["replicas equal rank 0's after sync_parameters",
             "losses of 3 steps equal one process on the whole batch",
             "final parameters (tied embedding/head included) equal the serial run",
             "both ranks hold identical parameters after training",
             "the frozen layer is not changed",
             "the layer unused in forward is not changed"]
    _check_outcomes(title, names, got, exp)


def bucketed_ddp(cls: Callable[..., torch.nn.Module], timeout_s: float = 120.0) -> None:
    """``cls(module, bucket_cap_bytes)`` wraps a model; gradient hooks launch each full
    bucket's all-reduce asynchronously during backward and
    ``finish_gradient_synchronization()`` waits before the optimizer step.  Tried with a
    bucket per parameter, a few buckets, and one bucket for everything."""

    title = "bucketed_ddp"
    caps = (1.0, 600.0, 1e9)
    n = 7
    _stub(title, n, lambda: cls(torch.nn.Linear(1, 1), 100.0))
    ranks = _launch(title, n, bucket_worker, (cls, caps), timeout_s)
    ref = _serial()
    out = [r if isinstance(r, Exception) else None for r in ranks[0]]
    got: list[Any] = []
    for i in range(2):
        r = ranks[0][i]
        got += [out[i] or r.params, out[i] or (r.losses, ranks[1][i].spread)]
    small, big = ranks[0][0], ranks[0][2]
    got.append(out[0] or small.in_backward > 0 and small.asynchronous == small.allreduce_calls)
    got.append(out[2] or big.params)
    got.append(out[0] or small.allreduce_calls)

    tensors = sum(p.requires_grad for p in TrapNet().parameters())
    exp = [ref.params, (ref.losses, 0.0)] * 2 + [True, ref.params, tensors * STEPS]
    names = ["one bucket per parameter: final parameters equal the serial run",
             "one bucket per parameter: losses equal, ranks identical",
             "600-byte buckets: final parameters equal the serial run",
             "600-byte buckets: losses equal, ranks identical",
             "all-reduces are launched asynchronously during backward (overlap)",
             "one bucket for everything (launched at the end): parameters equal",
             "a bucket per trainable tensor: one all-reduce per bucket per step"]
    _check_outcomes(title, names, got, exp)


def accumulation(fn: Callable[..., Any], timeout_s: float = 120.0) -> None:
    """``fn(ddp, optimizer, micro_batches)``: one optimizer step of gradient accumulation
    over ``micro_batches`` (token tensors) with ``ddp.no_sync()`` on all but the last, the
    loss of each scaled by 1/k; returns the step's loss.  Must equal the big batch, with one
    all-reduce per bucket per step whatever k."""

    title, ks = "accumulation", (1, 2, 4)
    n = 6
    _stub(title, n, lambda: fn(None, None, []))
    ranks = _launch(title, n, accumulate_worker, (fn, ks), timeout_s)
    ref = _serial()
    got: list[Any] = []
    exp: list[Any] = []
    names: list[str] = []
    for i, k in enumerate(ks[1:], start=1):
        r = ranks[0][i]
        e = r if isinstance(r, Exception) else None
        got += [e or r.params, e or r.losses, e or (r.calls_per_step, r.buckets)]
        exp += [ref.params, ref.losses,
                (ranks[0][0].buckets, ranks[0][0].buckets)
                if not isinstance(ranks[0][0], Exception) else None]
        names += [f"k={k}: parameters equal one process on the big batch",
                  f"k={k}: losses equal the big batch",
                  f"k={k}: all-reduces per step = buckets (communication once per step)"]
    _check_outcomes(title, names, got, exp)


# --------------------------------------------------------------------------------------
# Worker drivers: run inside ``labsim.lab.launch`` workers with the learner's functions
# shipped by value, train ``TrapNet`` (float64, so rounding cannot hide a bug) on shards of
# fixed batches and return what the checks compare with ``serial_reference``.  Replicas start
# from different seeds per rank on purpose: only a broadcast makes them equal.


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


def naive_worker(rank: int, world: int, sync: Callable,
                 average: Callable) -> DdpRun | Exception:
    """``sync(model)`` then SGD steps with ``average(model)`` after each backward."""
    model = _model(rank)
    res = _guard(sync, model)
    after_sync = res if isinstance(res, Exception) else _spread(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for b in batches():
        loss = lm_loss(model, shard(b, rank, world))
        loss.backward()
        res = _guard(average, model)
        if isinstance(res, Exception):
            return res
        opt.step()
        opt.zero_grad()
        losses.append(_global_mean(float(loss.detach())))
    return DdpRun(losses, parameters_of(model), _spread(model), spread_after_sync=after_sync)


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


def bucket_worker(rank: int, world: int, cls: Callable,
                  caps: Sequence[float]) -> list[DdpRun | Exception]:
    """For each bucket cap: ``cls(model, cap)``, SGD steps with
    ``finish_gradient_synchronization()`` before each optimizer step; all-reduces counted."""
    out: list[DdpRun | Exception] = []
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
        out.append(DdpRun([_global_mean(v) for v in losses], parameters_of(model),
                          _spread(model), allreduce_calls=count.calls,
                          in_backward=count.in_backward, asynchronous=count.asynchronous))
    return out


def accumulate_worker(rank: int, world: int, fn: Callable, ks: Sequence[int],
                      cap: float = 600.0) -> list[DdpRun | Exception]:
    """For each ``k``: ``fn(ddp, optimizer, micro_batches)`` per step on a
    ``DataParallelBucket`` over this rank's shard cut into ``k`` micro-batches."""
    out: list[DdpRun | Exception] = []
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
        out.append(err if err is not None else DdpRun(
            losses, parameters_of(ddp.module), _spread(ddp), calls_per_step=calls,
            buckets=len(ddp.buckets)))
    return out


