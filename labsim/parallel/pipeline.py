"""Pipeline parallelism by hand: one model cut into stages on real processes, micro-batches
sent point to point, in the order a schedule gives.

The schedule is data (``labsim.pipeline``: GPipe, 1F1B), the same op lists the simulator
executes; ``run_stage`` executes one stage's list with ``torch.distributed``:

* ``F i``: receive micro-batch ``i``'s activation from the previous stage (stage 0 takes the
  input), run the stage's layers, keep input and output for backward, send the output on
  (the last stage computes the loss instead);
* ``B i``: receive the gradient of the output from the next stage (the last stage starts from
  its loss), back-propagate through the stage, send the input's gradient back.

Sends are asynchronous (``isend``) and receives blocking, each tagged with its micro-batch and
direction, so every rank posts its sends before it waits and no schedule deadlocks.  The
gradients of the stage's parameters accumulate over the micro-batches (the loss is divided by
``m``): after the step they equal one process on the whole batch, the oracle ``demo`` checks.
Interleaved 1F1B (several model chunks per rank) is left to ``torch.distributed.pipelining``.

``TimedStage`` wraps a stage so that every forward lasts ``t_f`` and every backward ``t_b``
(the compute padded by sleeping, so that 2 CPU cores can run a 4-stage pipeline whose stage
times are known) and logs when each op ran (``OpTime``): the measured bubble can then be
compared with the closed form, and the order of the ops with the schedule's.

Runs under ``torchrun --nproc_per_node=N -m labsim.lab.worker labsim.parallel.pipeline:demo``
(gloo on CPUs, NCCL on GPUs: stages on the rank's device).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labsim.lab.device import rank_device
from labsim.pipeline import Op, make_schedule

__all__ = ["OpTime", "TimedStage", "demo", "measured_bubble", "run_stage", "split_stages"]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def split_stages(layers: Sequence[nn.Module], stages: int) -> list[nn.Sequential]:
    """``layers`` cut into ``stages`` consecutive groups of equal size."""
    if stages < 1 or len(layers) % stages:
        raise ValueError(f"{len(layers)} layers do not split into {stages} equal stages")
    per = len(layers) // stages
    return [nn.Sequential(*layers[s * per:(s + 1) * per]) for s in range(stages)]


@dataclass(frozen=True)
class OpTime:
    """One op a stage ran: ``kind`` "F", "B" (or, split, "I" input gradient and "W" weight
    gradient), the micro-batch (the ordinal of its forward on this stage), the stage's model
    chunk, and its start and end in seconds from the run's start."""

    kind: str
    microbatch: int
    chunk: int
    start_s: float
    end_s: float


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


class _Enter(torch.autograd.Function):
    """Marks a stage's input: its backward runs last in the stage's backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, stage: TimedStage
                ) -> torch.Tensor:
        ctx.stage, ctx.index = stage, len(stage.forwards)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        ctx.stage._end_backward(ctx.index)
        return grad, torch.zeros(()), None


class _Exit(torch.autograd.Function):
    """Marks a stage's output: its backward runs first in the stage's backward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, stage: TimedStage) -> torch.Tensor:
        ctx.stage = stage
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.stage._backward_started = time.perf_counter()
        return grad, None


class TimedStage(nn.Module):
    """``inner`` as a pipeline stage whose forward lasts ``t_f`` and backward ``t_b`` seconds
    (the compute padded by sleeping; 0 = unpadded), logging each op in ``log`` (``OpTime``,
    seconds from ``start``).  A backward starts when the gradient of the stage's output
    arrives and ends when the input's gradient is complete."""

    def __init__(self, inner: nn.Module, t_f: float = 0.0, t_b: float = 0.0,
                 chunk: int = 0) -> None:
        super().__init__()
        self.inner, self.t_f, self.t_b, self.chunk = inner, t_f, t_b, chunk
        self.start = time.perf_counter()
        self.log: list[OpTime] = []
        self.forwards: list[int] = []
        self._backward_started = 0.0
        self._anchor = torch.zeros((), requires_grad=True)  # so backward reaches _Enter

    def reset(self, start: float) -> None:
        """Forget the log; times count from ``start`` (a ``time.perf_counter()`` value)."""
        self.start, self.log, self.forwards = start, [], []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        begin = time.perf_counter()
        y = _Exit.apply(self.inner(_Enter.apply(x, self._anchor, self)), self)
        _sleep_until(begin + self.t_f)
        self.log.append(OpTime("F", len(self.forwards), self.chunk, begin - self.start,
                               time.perf_counter() - self.start))
        self.forwards.append(len(self.forwards))
        return y

    def _end_backward(self, index: int) -> None:
        _sleep_until(self._backward_started + self.t_b)
        self.log.append(OpTime("B", index, self.chunk, self._backward_started - self.start,
                               time.perf_counter() - self.start))


def measured_bubble(logs: Sequence[Sequence[OpTime]]) -> tuple[float, float]:
    """(step seconds, bubble) of a run from every rank's ops: the step from the first op's
    start to the last op's end over all ranks, the bubble the idle share of it averaged over
    ranks (``labsim.pipeline.timeline``'s definition)."""
    first = min(op.start_s for log in logs for op in log)
    end = max(op.end_s for log in logs for op in log) - first
    busy = [sum(op.end_s - op.start_s for op in log) for log in logs]
    return end, sum(1.0 - b / end for b in busy) / len(logs)


def _tag(microbatch: int, backward: bool) -> int:
    return 2 * microbatch + int(backward)


def run_stage(stage: nn.Module, ops: Sequence[Op], *, rank: int, world: int,
              inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None,
              loss_fn: Loss, activation_shape: tuple[int, ...],
              dtype: torch.dtype = torch.float32) -> float:
    """Execute this rank's ``ops`` (one model chunk per rank); ``inputs`` on stage 0 and
    ``targets`` on the last stage are the micro-batches.  Returns the summed loss on the last
    stage (0.0 elsewhere); the stage's ``.grad`` hold the gradients of the mean loss."""
    device = next(stage.parameters()).device
    m = len(inputs if inputs is not None else targets or ())
    if rank == 0 and inputs is None or rank == world - 1 and targets is None:
        raise ValueError("stage 0 needs the inputs and the last stage the targets")
    first, last = rank == 0, rank == world - 1
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    pending: list[dist.Work] = []
    total = 0.0
    for op in ops:
        i = op.microbatch
        if op.kind == "F":
            if first:
                x = inputs[i].to(device)
            else:
                x = torch.empty(activation_shape, dtype=dtype, device=device)
                dist.recv(x, rank - 1, tag=_tag(i, False))
                x.requires_grad_(True)
            y = stage(x)
            if last:
                y = loss_fn(y, targets[i].to(device)) / m
                total += float(y.detach())
            else:
                pending.append(dist.isend(y.detach().contiguous(), rank + 1, tag=_tag(i, False)))
            saved[i] = (x, y)
        else:
            x, y = saved.pop(i)
            if last:
                y.backward()
            else:
                grad = torch.empty_like(y)
                dist.recv(grad, rank + 1, tag=_tag(i, True))
                y.backward(grad)
            if not first:
                pending.append(dist.isend(x.grad.contiguous(), rank - 1, tag=_tag(i, True)))
    for work in pending:
        work.wait()
    return total


def demo(rank: int, world: int, schedule: str = "1f1b", microbatches: int = 4) -> float:
    """torchrun smoke test: an MLP of ``2 world`` layers pipelined over the ranks with
    ``schedule`` ("gpipe" or "1f1b") against one process on the whole batch; returns the
    largest difference of this stage's parameter gradients (0.0 up to rounding when right)."""
    device = rank_device()
    width, batch = 16, 8 * microbatches
    torch.manual_seed(0)  # every rank builds the same whole model and batch
    layers = [m for _ in range(2 * world) for m in (nn.Linear(width, width), nn.Tanh())]
    model = nn.Sequential(*layers).double()
    x = torch.randn(batch, width, dtype=torch.float64)
    y = torch.randn(batch, width, dtype=torch.float64)
    nn.functional.mse_loss(model(x), y).backward()
    stage = split_stages(list(model), world)[rank]
    ref = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    stage.to(device)
    ops = make_schedule(schedule, world, microbatches)[rank]
    run_stage(stage, ops, rank=rank, world=world, inputs=list(x.chunk(microbatches)),
              targets=list(y.chunk(microbatches)), loss_fn=nn.functional.mse_loss,
              activation_shape=(batch // microbatches, width), dtype=torch.float64)
    return float(max((p.grad.cpu() - r).abs().max() for p, r in zip(stage.parameters(), ref)))
