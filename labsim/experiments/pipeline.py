"""Pipelines on real processes, timed: measured bubbles against the closed form.

``bubble_worker`` (inside ``labsim.lab.launch`` workers, one per stage) runs one training step
of the same 8-block MLP (float64) with each schedule: the learner's executor on the learner's
GPipe and 1F1B op lists (stages wrapped in ``labsim.parallel.pipeline.TimedStage``), then
PyTorch's own ``torch.distributed.pipelining`` schedules (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B`` with two model chunks per rank, and
``ScheduleInterleavedZeroBubble`` with one, which is ZB-H1).  Every op's compute is padded to
a known time (forward ``t_f``, backward ``t_b``, of which ``t_w`` the weight gradient when
the schedule splits it), so that a 4-stage pipeline on 2 CPU cores behaves like 4 devices:
the measured bubble can be held against ``(p - 1) / (m + p - 1)`` and friends.  ``collect``
turns every rank's log into one ``PipelineRun`` per schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labsim.parallel.pipeline import OpTime, TimedStage, measured_bubble
from labsim.pipeline import Schedule, bubble_fraction, timeline, zero_bubble_h1
from labsim.trace import Span, Trace

TORCH_SCHEDULES = {"torch ScheduleGPipe": ("ScheduleGPipe", 1),
                   "torch Schedule1F1B": ("Schedule1F1B", 1),
                   "torch ScheduleInterleaved1F1B, v=2": ("ScheduleInterleaved1F1B", 2),
                   "torch ScheduleInterleavedZeroBubble (ZB-H1)":
                   ("ScheduleInterleavedZeroBubble", 1)}
_KIND = {"F": "forward", "B": "backward", "I": "backward", "W": "wgrad"}


@dataclass(frozen=True)
class RankRun:
    """What one rank measured for one schedule: its ops and its largest gradient error."""

    name: str
    ops: tuple[OpTime, ...]
    grad_error: float


@dataclass(frozen=True)
class PipelineRun:
    """One schedule measured on every rank: the step and bubble measured, the bubble the
    closed form predicts for uniform stages, and the largest gradient error against one
    process; ``trace`` draws the measured ops (stage = rank)."""

    name: str
    step_s: float
    bubble: float
    predicted_bubble: float
    max_grad_error: float
    ops: tuple[tuple[OpTime, ...], ...] = field(repr=False)

    @property
    def bubble_fraction(self) -> float:  # what labsim.plots.pipeline_gantt prints
        return self.bubble

    @property
    def trace(self) -> Trace:
        first = min(op.start_s for ops in self.ops for op in ops)
        chunked = any(op.chunk for ops in self.ops for op in ops)
        return Trace((Span(rank, "compute", _KIND[op.kind], op.start_s - first,
                           op.end_s - first, f"{op.kind}{op.microbatch}"
                           + (f" chunk {op.chunk}" if chunked else ""))
                      for rank, ops in enumerate(self.ops) for op in ops),
                     detail="op", rank_label="pipeline stage")


def _blocks(width: int, n: int) -> list[nn.Module]:
    torch.manual_seed(0)  # every rank builds the same whole model
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()).double() for _ in range(n)]


def _serial_grads(blocks: Sequence[nn.Module], x: torch.Tensor,
                  y: torch.Tensor) -> list[list[torch.Tensor]]:
    model = nn.Sequential(*blocks)
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    out = [[p.grad.clone() for p in b.parameters()] for b in blocks]
    model.zero_grad(set_to_none=True)
    return out


def _error(blocks: Sequence[nn.Module], ref: Sequence[Sequence[torch.Tensor]]) -> float:
    return max(float((p.grad - r).abs().max()) if p.grad is not None else float("inf")
               for b, rb in zip(blocks, ref) for p, r in zip(b.parameters(), rb))


def warm_up() -> None:
    """Pay PyTorch's one-time costs (the first ``backward`` with an explicit gradient
    imports modules for half a second) before anything is timed."""
    (torch.ones(2, requires_grad=True) * 2).backward(torch.ones(2))
    dist.barrier()


def bubble_worker(rank: int, world: int, pipeline_step: Callable[..., float],
                  schedules: Mapping[str, Schedule], t_f: float, t_b: float, t_w: float,
                  microbatches: int, width: int = 16, rows: int = 4) -> list[RankRun]:
    """Time one step of each schedule on this rank (see the module docstring); the
    learner's ``pipeline_step(stage, ops, inputs, targets, loss_fn, shape)`` runs the op
    lists in ``schedules`` (one per rank)."""
    warm_up()
    m = microbatches
    n_blocks = 2 * world
    blocks = _blocks(width, n_blocks)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows * m, width, generator=gen, dtype=torch.float64)
    y = torch.randn(rows * m, width, generator=gen, dtype=torch.float64)
    ref = _serial_grads(blocks, x, y)
    out = []
    mine = [2 * rank, 2 * rank + 1]  # one stage per rank: two consecutive blocks
    for name, schedule in schedules.items():
        stage = TimedStage(nn.Sequential(*(blocks[i] for i in mine)), t_f, t_b)
        dist.barrier()
        stage.reset(time.perf_counter())
        pipeline_step(stage, schedule[rank], list(x.chunk(m)) if rank == 0 else None,
                      list(y.chunk(m)) if rank == world - 1 else None,
                      nn.functional.mse_loss, (rows, width))
        dist.barrier()
        out.append(RankRun(name, tuple(stage.log), _error([blocks[i] for i in mine],
                                                          [ref[i] for i in mine])))
        for b in blocks:
            b.zero_grad(set_to_none=True)
    for name, (cls, v) in TORCH_SCHEDULES.items():
        out.append(_torch_run(name, cls, v, rank, world, blocks, ref, x, y, m, t_f, t_b, t_w))
    return out


def _torch_run(name: str, cls_name: str, v: int, rank: int, world: int,
               blocks: Sequence[nn.Module], ref: Sequence[Sequence[torch.Tensor]],
               x: torch.Tensor, y: torch.Tensor, m: int, t_f: float, t_b: float,
               t_w: float) -> RankRun:
    """One step of a ``torch.distributed.pipelining`` schedule: ``v`` model chunks per rank
    (chunk c of rank r = model chunk c p + r), each op's compute padded to its share."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    n_chunks = world * v
    per = len(blocks) // n_chunks
    chunks = [rank + c * world for c in range(v)]
    log: list[OpTime] = []
    start = [0.0]
    split = "ZeroBubble" in cls_name

    def padded(fn: Callable[..., Any], kind: Callable[[dict], str], seconds: Callable[[dict],
               float], chunk: int) -> Callable[..., Any]:
        def run(mb: int, *args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            result = fn(mb, *args, **kwargs)
            deadline = begin + seconds(kwargs)
            while (left := deadline - time.perf_counter()) > 0:
                time.sleep(left)
            log.append(OpTime(kind(kwargs), mb, chunk, begin - start[0],
                              time.perf_counter() - start[0]))
            return result
        return run

    stages = []
    for g in chunks:
        module = nn.Sequential(*blocks[g * per:(g + 1) * per])
        st = PipelineStage(module, g, n_chunks, torch.device("cpu"))
        st.forward_one_chunk = padded(st.forward_one_chunk, lambda kw: "F",
                                      lambda kw: t_f / v, g)
        st.backward_one_chunk = padded(
            st.backward_one_chunk,
            lambda kw: "B" if kw.get("full_backward", True) else "I",
            lambda kw: (t_b if kw.get("full_backward", True) else t_b - t_w) / v, g)
        st.backward_weight_one_chunk = padded(st.backward_weight_one_chunk,
                                              lambda kw: "W", lambda kw: t_w / v, g)
        stages.append(st)
    cls = getattr(pipelining, cls_name)
    multi = v > 1 or split
    schedule = cls(stages if multi else stages[0], n_microbatches=m,
                   loss_fn=nn.functional.mse_loss)
    dist.barrier()
    start[0] = time.perf_counter()
    if rank == 0:
        schedule.step(x, target=y) if world == 1 else schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y)
    else:
        schedule.step()
    dist.barrier()
    mine = [b for g in chunks for b in range(g * per, (g + 1) * per)]
    error = _error([blocks[i] for i in mine], [ref[i] for i in mine])
    for b in blocks:
        b.zero_grad(set_to_none=True)
    return RankRun(name, tuple(sorted(log, key=lambda op: op.start_s)), error)


def predicted_bubble(name: str, p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """The closed form for a schedule of ``bubble_worker``: ``(p - 1) / (m + p - 1)`` for
    GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` interleaved, ZB-H1's from its timeline
    (``(p - 1)(t_F + t_B - t_W)`` of bubble, Qi et al. 2024)."""
    if "ZB" in name or "ZeroBubble" in name:
        return timeline(zero_bubble_h1(p, m), t_f, t_b, t_w=t_w).bubble_fraction
    v = 2 if "v=2" in name else 1
    return bubble_fraction(p, m, v)


def collect(ranks: Sequence[Sequence[RankRun]], t_f: float, t_b: float, t_w: float,
            microbatches: int) -> list[PipelineRun]:
    """One ``PipelineRun`` per schedule from every rank's ``bubble_worker`` result."""
    p = len(ranks)
    runs = []
    for i, first in enumerate(ranks[0]):
        logs = tuple(r[i].ops for r in ranks)
        step, bubble = measured_bubble(logs)
        runs.append(PipelineRun(first.name, step, bubble,
                                predicted_bubble(first.name, p, microbatches, t_f, t_b, t_w),
                                max(r[i].grad_error for r in ranks), logs))
    return runs
