"""Pipelines on real processes, timed: measured bubbles against the closed form.

``bubble_worker`` (inside ``labsim.lab.launch`` workers, one per stage) runs one training step
of the same 8-block MLP (float64) with each schedule: the learner's executor on the learner's
GPipe and 1F1B op lists (stages wrapped in ``labsim.parallel.pipeline.TimedStage``), then
PyTorch's own ``torch.distributed.pipelining`` schedules (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B`` with two model chunks per rank, and
``ScheduleInterleavedZeroBubble`` with one, which is ZB-H1).  Every op's compute is padded to
a known time (forward ``t_f``, backward ``t_b``, of which ``t_w`` the weight gradient when
the schedule splits it), so that a 4-stage pipeline on 2 CPU cores behaves like 4 devices:
the measured bubble can be held against ``(p - 1) / (m + p - 1)`` and friends.

What the padding cannot hide is what each op and message costs on this machine (gloo over
loopback, Python, a sleeping process woken late when the cores are busy), and that cost grows
with the load other programs put on the machine.  So every schedule runs ``rounds`` times, the
schedules taking turns (``labsim.lab.timing``'s interleaving: a load that comes and goes slows
them alike), and ``collect`` turns every rank's logs into one ``PipelineRun`` per schedule:
the median round, the spread over rounds, and each round's step time for
``labsim.lab.timing.compare`` (``step_timings``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labsim.lab.device import Timing
from labsim.lab.timing import compare, spread
from labsim.parallel.pipeline import OpTime, TimedStage, measured_bubble
from labsim.pipeline import (
    Schedule,
    bubble_fraction,
    pipeline_time,
    timeline,
    zero_bubble_h1,
)
from labsim.trace import Span, Trace

TORCH_SCHEDULES = {"torch ScheduleGPipe": ("ScheduleGPipe", 1),
                   "torch Schedule1F1B": ("Schedule1F1B", 1),
                   "torch ScheduleInterleaved1F1B, v=2": ("ScheduleInterleaved1F1B", 2),
                   "torch ScheduleInterleavedZeroBubble (ZB-H1)":
                   ("ScheduleInterleavedZeroBubble", 1)}
_KIND = {"F": "forward", "B": "backward", "I": "backward", "W": "wgrad"}


@dataclass(frozen=True)
class RankRun:
    """What one rank measured for one schedule in one round: its ops and its largest
    gradient error."""

    name: str
    ops: tuple[OpTime, ...]
    grad_error: float
    round_index: int = 0


@dataclass(frozen=True)
class PipelineRun:
    """One schedule measured on every rank in every round: the median round's step and
    bubble, the bubble the closed form predicts for uniform stages, the largest gradient error
    against one process, each round's step (seconds) and bubble; ``ops`` and ``trace`` are the
    median round's (stage = rank)."""

    name: str
    step_s: float
    bubble: float
    predicted_bubble: float
    max_grad_error: float
    ops: tuple[tuple[OpTime, ...], ...] = field(repr=False)
    steps_s: tuple[float, ...] = ()
    bubbles: tuple[float, ...] = ()
    predicted_step_s: float = 0.0

    @property
    def bubble_fraction(self) -> float:  # what labsim.plots.pipeline_gantt prints
        return self.bubble

    @property
    def excess(self) -> tuple[float, float, float]:
        """How far the measured bubble sits above the prediction (a fraction of the step):
        median, lower and upper quartile over the rounds."""
        over = [b - self.predicted_bubble for b in self.bubbles or (self.bubble,)]
        low, high = spread(over)
        return statistics.median(over), low, high

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
                  microbatches: int, width: int = 16, rows: int = 4, rounds: int = 1
                  ) -> list[RankRun]:
    """Time one step of each schedule on this rank, ``rounds`` times (see the module
    docstring): in round ``r`` the schedules run in turn starting from the ``r``-th, so each
    one runs early and late alike.  The learner's ``pipeline_step(stage, ops, inputs,
    targets, loss_fn, shape)`` runs the op lists in ``schedules`` (one per rank)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    warm_up()
    m = microbatches
    blocks = _blocks(width, 2 * world)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows * m, width, generator=gen, dtype=torch.float64)
    y = torch.randn(rows * m, width, generator=gen, dtype=torch.float64)
    ref = _serial_grads(blocks, x, y)
    mine = [2 * rank, 2 * rank + 1]  # one stage per rank: two consecutive blocks

    def learners(name: str, schedule: Schedule) -> RankRun:
        stage = TimedStage(nn.Sequential(*(blocks[i] for i in mine)), t_f, t_b)
        dist.barrier()
        stage.reset(time.perf_counter())
        pipeline_step(stage, schedule[rank], list(x.chunk(m)) if rank == 0 else None,
                      list(y.chunk(m)) if rank == world - 1 else None,
                      nn.functional.mse_loss, (rows, width))
        dist.barrier()
        run = RankRun(name, tuple(stage.log), _error([blocks[i] for i in mine],
                                                     [ref[i] for i in mine]))
        for b in blocks:
            b.zero_grad(set_to_none=True)
        return run

    jobs: list[Callable[[], RankRun]] = [
        (lambda n=name, sch=schedule: learners(n, sch)) for name, schedule in schedules.items()]
    jobs += [(lambda n=name, c=cls, v=v: _torch_run(n, c, v, rank, world, blocks, ref, x, y, m,
                                                    t_f, t_b, t_w))
             for name, (cls, v) in TORCH_SCHEDULES.items()]
    out = []
    for r in range(rounds):
        for k in range(len(jobs)):
            out.append(replace(jobs[(r + k) % len(jobs)](), round_index=r))
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


def predicted_step_s(name: str, p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """The step the closed form predicts for uniform stages: ``(m + p - 1)(t_f + t_b)`` for
    GPipe and 1F1B, ``(m + (p - 1) / v)(t_f + t_b)`` interleaved, ZB-H1's timeline."""
    if "ZB" in name or "ZeroBubble" in name:
        return timeline(zero_bubble_h1(p, m), t_f, t_b, t_w=t_w).step_time_s
    return pipeline_time(p, m, t_f, t_b, 2 if "v=2" in name else 1)


def collect(ranks: Sequence[Sequence[RankRun]], t_f: float, t_b: float, t_w: float,
            microbatches: int) -> list[PipelineRun]:
    """One ``PipelineRun`` per schedule (in the order of the first round) from every rank's
    ``bubble_worker`` result, over all its rounds."""
    p = len(ranks)
    rounds: dict[str, list[tuple[tuple[OpTime, ...], ...]]] = {}
    errors: dict[str, float] = {}
    for i, first in enumerate(ranks[0]):
        rounds.setdefault(first.name, []).append(tuple(r[i].ops for r in ranks))
        errors[first.name] = max(errors.get(first.name, 0.0),
                                 *(r[i].grad_error for r in ranks))
    runs = []
    for name, logs in rounds.items():
        measured = [measured_bubble(log) for log in logs]
        steps = tuple(step for step, _ in measured)
        middle = sorted(range(len(steps)), key=steps.__getitem__)[(len(steps) - 1) // 2]
        runs.append(PipelineRun(name, statistics.median(steps),
                                statistics.median(b for _, b in measured),
                                predicted_bubble(name, p, microbatches, t_f, t_b, t_w),
                                errors[name], logs[middle], steps,
                                tuple(b for _, b in measured),
                                predicted_step_s(name, p, microbatches, t_f, t_b, t_w)))
    return runs


def step_verdict(runs: Sequence[PipelineRun], a: str, b: str, threshold: float = 1.05) -> str:
    """``labsim.lab.timing.compare``'s verdict on schedules ``a`` and ``b``, round by round,
    followed by what the closed form predicts for the same pair."""
    by_name = {r.name: r for r in runs}
    verdict = compare(step_timings(runs), a, b, threshold=threshold).verdict
    pa, pb = by_name[a].predicted_step_s, by_name[b].predicted_step_s
    if abs(pa - pb) <= 1e-9 * max(pa, pb):
        return f"{verdict}\n    the closed form: the same time"
    fast, slow, ratio = (a, b, pb / pa) if pa < pb else (b, a, pa / pb)
    return f"{verdict}\n    the closed form: {fast} {ratio:.2f}x faster than {slow}"


def excess_verdict(a: PipelineRun, b: PipelineRun, margin: float = 0.005) -> str:
    """Whether ``a``'s bubble exceeds its prediction by more than ``b``'s does, round by round:
    a verdict when the middle half of the per-round differences lies beyond ``margin`` (a
    fraction of the step) on one side, "too noisy to tell" otherwise."""
    diffs = [(x - a.predicted_bubble) - (y - b.predicted_bubble)
             for x, y in zip(a.bubbles or (a.bubble,), b.bubbles or (b.bubble,))]
    low, high = spread(diffs)
    band = (f"{low * 100:+.1f} to {high * 100:+.1f} points over {len(diffs)} round"
            + "s" * (len(diffs) > 1))
    if low > margin:
        return (f"{a.name} exceeds its prediction by {statistics.median(diffs) * 100:.1f} "
                f"points more than {b.name} ({band})")
    if high < -margin:
        return (f"{a.name} exceeds its prediction by {-statistics.median(diffs) * 100:.1f} "
                f"points less than {b.name} ({band})")
    return (f"too noisy to tell whether {a.name} exceeds its prediction by more than "
            f"{b.name}: the difference ranged {band}")


def step_timings(runs: Sequence[PipelineRun]) -> dict[str, Timing]:
    """Each schedule's step times, round by round, for ``labsim.lab.timing.compare`` (round
    ``i`` of every schedule ran in the same launch, close in time)."""
    return {r.name: Timing(r.steps_s or (r.step_s,)) for r in runs}
