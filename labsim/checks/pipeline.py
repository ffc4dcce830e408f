"""Checks for lab 11 (pipeline parallel): schedules written as data, and an executor of one
stage's ops on real processes.

Schedules (``gpipe``, ``one_f_one_b``, ``interleaved``) are plain data, so they are checked
in this process on many (p, m, v): every rule of ``labsim.pipeline.schedule_problems``
(each op once, backward after forward, no deadlock), the schedule's own rule (GPipe: all
forwards first; 1F1B: at most ``p - s`` micro-batches in flight on stage ``s``; interleaved:
no more in flight than Megatron-LM's schedule), the per-stage activation memory this implies,
and the step time on uniform stages (``labsim.pipeline.timeline``) equal to the closed form.
A schedule built by calling labsim's own schedules fails, naming the rule.

The executor (``pipeline_step``) runs on ``NPROCS`` gloo processes, one stage each, for 1F1B
and GPipe op lists, and is compared with one process on the whole batch (float64): the loss,
every stage's gradients, the order its stage ran the ops in (``TimedStage``'s log), and its
messages (only point-to-point: a send of one activation per micro-batch to each neighbour).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labsim import pipeline as ref
from labsim.checks._core import Case, close, run_check
from labsim.checks._workers import (
    calls,
    check_outcomes,
    fail_if_stub,
    guard,
    reference_codes,
    run_workers,
)
from labsim.lab.comm import CommRecorder
from labsim.parallel import pipeline as parallel_pipeline
from labsim.parallel.pipeline import TimedStage
from labsim.pipeline import max_in_flight, pipeline_time, schedule_problems, timeline

NPROCS = 4
T_F, T_B = 1.0, 2.0  # uniform stage times of the timeline checks
SCHEDULERS = reference_codes(ref, names=["gpipe", "one_f_one_b", "interleaved_one_f_one_b",
                                         "make_schedule", "zero_bubble_h1"])
EXECUTORS = reference_codes(parallel_pipeline, names=["run_stage"])


@dataclass(frozen=True)
class Rules:
    """What a schedule for (p, m, v) must satisfy: its in-flight micro-batches per stage
    (GPipe, 1F1B exactly; interleaved at most), whether all forwards come first, and its
    step time on uniform stages."""

    p: int
    m: int
    v: int
    in_flight: tuple[int, ...]
    exact: bool
    forwards_first: bool
    step_s: float


def _schedule_rule(rule: str) -> Callable[[Any, Rules], str | None]:
    def compare(got: Any, want: Rules) -> str | None:
        schedule, used = got
        if used:
            return (f"rule: write the schedule yourself; your function called "
                    f"{', '.join(sorted(used))}")
        try:
            schedule = tuple(tuple(ref.Op(*op) for op in ops) for ops in schedule)
        except TypeError:
            return "expected a tuple of per-stage tuples of Op(kind, microbatch, chunk)"
        problems = schedule_problems(schedule, want.p, want.m, want.v)
        if problems:
            return f"not a valid schedule: {problems[0]}"
        held = tuple(max_in_flight(ops) for ops in schedule)
        if (held != want.in_flight if want.exact else
                any(h > w for h, w in zip(held, want.in_flight))):
            return (f"rule: {rule}\n  in-flight micro-batches per stage {held}, expected "
                    f"{'' if want.exact else 'at most '}{want.in_flight} (each one's "
                    f"activations stay in that stage's memory until its backward)")
        if want.forwards_first and any(
                max((k for k, op in enumerate(ops) if op.kind == "F"), default=-1) >
                min((k for k, op in enumerate(ops) if op.kind == "B"), default=len(ops))
                for ops in schedule):
            return f"rule: {rule}\n  a stage runs a backward before its last forward"
        step = timeline(schedule, T_F, T_B).step_time_s
        if abs(step - want.step_s) > 1e-9 * want.step_s:
            return (f"step time {step:g} with t_f={T_F:g}, t_b={T_B:g} per stage; the "
                    f"schedule's closed form is {want.step_s:g}: some stage waits longer "
                    "than it has to")
        return None
    return compare


def _run_schedule(fn: Callable[..., Any], *args: int) -> tuple[Any, set[str]]:
    return calls(SCHEDULERS, fn, *args)


def _schedule_check(title: str, fn: Callable[..., Any], specs: Sequence[tuple[int, ...]],
                    rules: Callable[..., Rules], rule: str) -> None:
    cases = [Case(f"p={s[0]}, m={s[1]}" + (f", v={s[2]}" if len(s) > 2 else ""),
                  (fn, *s), expected=rules(*s), compare=_schedule_rule(rule)) for s in specs]
    run_check(title, _run_schedule, cases)


GPIPE_SPECS = ((1, 1), (1, 4), (2, 1), (2, 3), (4, 4), (4, 8), (3, 7), (8, 5))
ONE_F_ONE_B_SPECS = ((1, 3), (2, 1), (2, 5), (4, 2), (4, 4), (4, 9), (3, 7), (8, 16))
INTERLEAVED_SPECS = ((2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (3, 6, 2), (4, 12, 3),
                     (2, 6, 4))


def gpipe(fn: Callable[[int, int], Any]) -> None:
    """``fn(p, m)``: GPipe as per-stage op lists: every stage all ``m`` forwards, then all
    ``m`` backwards; ``m`` micro-batches in flight on every stage."""
    def rules(p: int, m: int) -> Rules:
        return Rules(p, m, 1, (m,) * p, True, True, pipeline_time(p, m, T_F, T_B))

    _schedule_check("gpipe", fn, GPIPE_SPECS, rules,
                    "GPipe runs every forward of a stage before any of its backwards")


def one_f_one_b(fn: Callable[[int, int], Any]) -> None:
    """``fn(p, m)``: 1F1B (PipeDream-Flush): stage ``s`` holds at most ``min(p - s, m)``
    micro-batches and the step takes GPipe's ``(m + p - 1)(t_f + t_b)``."""
    def rules(p: int, m: int) -> Rules:
        return Rules(p, m, 1, tuple(min(p - s, m) for s in range(p)), True, False,
                     pipeline_time(p, m, T_F, T_B))

    _schedule_check("one_f_one_b", fn, ONE_F_ONE_B_SPECS, rules,
                    "1F1B keeps at most p - s micro-batches in flight on stage s (warm up "
                    "with p - s - 1 forwards, then one forward, one backward)")


def interleaved(fn: Callable[[int, int, int], Any]) -> None:
    """``fn(p, m, v)``: interleaved 1F1B over ``v`` model chunks per stage (chunk ``c`` of
    stage ``s`` is model chunk ``c p + s``; ``m`` a multiple of ``p``): the step takes
    ``(m + (p - 1) / v)(t_f + t_b)`` and no stage holds more micro-batch chunks than in
    Megatron-LM's schedule."""
    def rules(p: int, m: int, v: int) -> Rules:
        megatron = tuple(max_in_flight(ops) for ops in ref.interleaved_one_f_one_b(p, m, v))
        return Rules(p, m, v, megatron, False, False, pipeline_time(p, m, T_F, T_B, v))

    _schedule_check("interleaved", fn, INTERLEAVED_SPECS, rules,
                    "interleaved 1F1B holds no more (micro-batch, chunk) activations than "
                    "Megatron-LM's schedule")


# -- the executor on real processes -------------------------------------------------------------

WIDTH, ROWS = 8, 3
EXECUTOR_RUNS = (("1f1b", 6), ("gpipe", 4), ("1f1b", 2))


@dataclass(frozen=True)
class StageRun:
    """One run of the learner's executor on one rank: the loss it returned, its stage's
    gradients, the (kind, micro-batch) order its stage ran, its communication as
    (kind, elements) and any call into labsim's reference executor."""

    loss: float
    grads: list[torch.Tensor | None]
    order: list[tuple[str, int]]
    comms: list[tuple[str, int]]
    references: list[str]


def _whole(world: int, m: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    model = nn.Sequential(*[layer for _ in range(world) for layer in
                            (nn.Linear(WIDTH, WIDTH), nn.Tanh())]).double()
    gen = torch.Generator().manual_seed(4 + m)
    x = torch.randn(ROWS * m, WIDTH, generator=gen, dtype=torch.float64)
    y = torch.randn(ROWS * m, WIDTH, generator=gen, dtype=torch.float64)
    return model, x, y


def serial_pipeline(world: int, m: int) -> tuple[float, list[list[torch.Tensor]]]:
    """The oracle: the whole model on the whole batch in one process: its mean loss and each
    stage's gradients."""
    model, x, y = _whole(world, m)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    stages = parallel_pipeline.split_stages(list(model), world)
    return float(loss.detach()), [[p.grad for p in s.parameters()] for s in stages]


def executor_worker(rank: int, world: int, step: Callable[..., Any],
                    runs: Sequence[tuple[str, int]]) -> list[StageRun | Exception]:
    """The learner's ``step(stage, ops, inputs, targets, loss_fn, shape)`` on this rank's
    stage, for each (schedule, m) of ``runs``."""
    out: list[StageRun | Exception] = []
    for name, m in runs:
        model, x, y = _whole(world, m)
        stage = TimedStage(parallel_pipeline.split_stages(list(model), world)[rank])
        ops = ref.make_schedule(name, world, m)[rank]
        dist.barrier()
        with CommRecorder() as rec:
            result = guard(calls, EXECUTORS, step, stage, ops,
                           list(x.chunk(m)) if rank == 0 else None,
                           list(y.chunk(m)) if rank == world - 1 else None,
                           nn.functional.mse_loss, (ROWS, WIDTH))
        dist.barrier()
        if isinstance(result, Exception):
            out.append(result)
            continue
        loss, used = result
        out.append(StageRun(float(loss), [p.grad for p in stage.inner.parameters()],
                            [(op.kind, op.microbatch) for op in stage.log],
                            [(c.kind, c.numel) for c in rec.comms], sorted(used)))
    return out


def _expected_comms(rank: int, world: int, m: int) -> list[tuple[str, int]]:
    numel = ROWS * WIDTH
    per = ([("send", numel)] * m if rank < world - 1 else []) + \
        ([("send", numel)] * m if rank > 0 else [])
    return sorted(per + [("recv", numel)] * len(per))


def _comm_rule(got: Any, expected: Any) -> str | None:
    for rank, (g, e) in enumerate(zip(got, expected)):
        if sorted(g) != e:
            kinds = sorted({k for k, _ in g})
            return ("rule: a pipeline talks point to point only, one activation (or its "
                    "gradient) per micro-batch to each neighbour\n  rank "
                    f"{rank} issued {len(g)} operations ({', '.join(kinds) or 'none'}); "
                    f"expected {len(e)} sends and receives of {ROWS * WIDTH} elements")
    return None


def pipeline_step(step: Callable[..., Any], timeout_s: float = 120.0) -> None:
    """``step(stage, ops, inputs, targets, loss_fn, shape)`` runs one rank's op list of one
    training step (F: receive or take the input, run the stage, send on or keep the loss /
    m; B: receive the output's gradient or back-propagate the loss, send the input's
    gradient back) and returns the summed loss on the last rank: on 4 processes it equals
    one process on the whole batch, for 1F1B and GPipe, in the schedule's order."""
    title = "pipeline_step"
    n = 3 * len(EXECUTOR_RUNS) + 1
    fail_if_stub(title, n, lambda: step(nn.Identity(), (), None, None, None, (1,)))
    ranks = run_workers(title, n, executor_worker, NPROCS, (step, EXECUTOR_RUNS), timeout_s)
    world = NPROCS
    rows: list = []
    for i, (name, m) in enumerate(EXECUTOR_RUNS):
        loss, grads = serial_pipeline(world, m)
        runs = [r if isinstance(r, BaseException) else r[i] for r in ranks]
        bad = next((r for r in runs if isinstance(r, BaseException)), None)
        label = f"{name}, p={world}, m={m}"
        ops = ref.make_schedule(name, world, m)
        rows += [
            (f"{label}: loss and every stage's gradients equal one process",
             bad or (runs[-1].loss, [r.grads for r in runs]), (loss, grads),
             close(rtol=1e-9, atol=1e-12)),
            (f"{label}: each stage ran its ops in the schedule's order",
             bad or [r.order for r in runs],
             [[(op.kind, op.microbatch) for op in o] for o in ops],
             lambda got, exp: next((f"stage {s} ran {g} instead of {e}"
                                    for s, (g, e) in enumerate(zip(got, exp)) if g != e),
                                   None)),
            (f"{label}: point-to-point only, one message per micro-batch and neighbour",
             bad or [r.comms for r in runs], [_expected_comms(r, world, m)
                                              for r in range(world)], _comm_rule),
        ]
    used = sorted({name for r in ranks if not isinstance(r, BaseException)
                   for run in r if not isinstance(run, BaseException)
                   for name in run.references})
    rows.append(("your own executor: it calls nothing of labsim.parallel.pipeline", used, [],
                 lambda got, exp: None if got == exp else
                 f"rule: write the executor yourself; your code called {', '.join(got)}"))
    check_outcomes(title, rows)
