"""Checks for lab 11 (pipeline parallel): schedules written as data, and an executor of one
stage's ops on real processes.

Schedules (``gpipe``, ``one_f_one_b``, ``interleaved``) are plain data, so they are checked
in this process on many (p, m, v): every rule of ``labsim.pipeline.schedule_problems``
(each op once, backward after forward, no deadlock), the schedule's own rule (GPipe: all
forwards first; 1F1B: at most ``p - s`` micro-batches in flight on stage ``s``; interleaved:
Megatron-LM's order, op for op), the per-stage activation memory this implies, and the step
time on uniform stages (``labsim.pipeline.timeline``) equal to the closed form.  PyTorch's
``torch.distributed.pipelining`` schedules compute these orders too; calling them (their
classes, or the helpers that build their op lists) trips the same tripwire as labsim's own.

The executor (``pipeline_step``) runs on ``NPROCS`` gloo processes, one stage each, for 1F1B
and GPipe op lists, and is compared with one process on the whole batch (float64): the loss,
every stage's gradients, the order its stage ran the ops in (``TimedStage``'s log), and its
messages (the rule: only point-to-point, a send of one activation per micro-batch to each
neighbour).  Every check is a ``Spec``; calling labsim's own schedules or executor trips the
reference tripwire.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labsim import pipeline as ref
from labsim.checks._core import Case, Outcome, Spec, close, plain_outcome
from labsim.checks._observe import watch
from labsim.lab.comm import CommRecorder
from labsim.parallel import pipeline as parallel_pipeline
from labsim.parallel.pipeline import TimedStage
from labsim.pipeline import max_in_flight, pipeline_time, schedule_problems, timeline

NPROCS = 4
T_F, T_B = 1.0, 2.0  # uniform stage times of the timeline checks
_TORCH_SCHEDULES = "torch.distributed.pipelining.schedules"
FORBID_SCHEDULES = (*(f"labsim.pipeline:{name}" for name in (
    "gpipe", "one_f_one_b", "interleaved_one_f_one_b", "make_schedule", "zero_bubble_h1")),
    # PyTorch's schedule classes (ScheduleInterleaved1F1B's ``_calculate_single_rank_operations``
    # among their methods) and the private helpers that build their per-rank op lists
    f"{_TORCH_SCHEDULES}:*", f"{_TORCH_SCHEDULES}:_get_1f1b_rank_ops",
    f"{_TORCH_SCHEDULES}:_get_warmup_ops")
FORBID_EXECUTOR = ("labsim.parallel.pipeline:run_stage",)


@dataclass(frozen=True)
class Rules:
    """What a schedule for (p, m, v) must satisfy: its in-flight micro-batches per stage
    (GPipe, 1F1B exactly; interleaved at most), whether all forwards come first, its step
    time on uniform stages and, where the exercise asks for one published order, that order
    (``order``: per-stage ops); ``rule`` names the schedule's own rule in words."""

    p: int
    m: int
    v: int
    in_flight: tuple[int, ...]
    exact: bool
    forwards_first: bool
    step_s: float
    rule: str
    order: tuple[tuple[ref.Op, ...], ...] | None = None


def _as_schedule(value: Any) -> tuple[tuple[ref.Op, ...], ...] | None:
    """The learner's value as per-stage tuples of ``Op``, or None when it has another form."""
    try:
        return tuple(tuple(ref.Op(*op) for op in ops) for ops in value)
    except TypeError:
        return None


def _valid(value: Any, want: Rules) -> tuple[tuple[ref.Op, ...], ...] | None:
    schedule = _as_schedule(value)
    if schedule is None or schedule_problems(schedule, want.p, want.m, want.v):
        return None
    return schedule


def in_flight_rule(case: Case, out: Outcome) -> str | None:
    """The schedule's memory rule: the micro-batches each stage holds at once (a valid
    schedule only; an invalid one fails its comparison)."""
    want: Rules = case.expected
    schedule = _valid(out.value, want)
    if schedule is None:
        return None
    held = tuple(max_in_flight(ops) for ops in schedule)
    if held != want.in_flight if want.exact else any(
            h > w for h, w in zip(held, want.in_flight)):
        return (f"{want.rule}; in-flight micro-batches per stage {held}, expected "
                f"{'' if want.exact else 'at most '}{want.in_flight} (each one's activations "
                "stay in that stage's memory until its backward)")
    return None


def forwards_first_rule(case: Case, out: Outcome) -> str | None:
    """GPipe: every stage runs all its forwards before any backward."""
    want: Rules = case.expected
    schedule = _valid(out.value, want)
    if schedule is None or not want.forwards_first:
        return None
    for s, ops in enumerate(schedule):
        last_f = max((k for k, op in enumerate(ops) if op.kind == "F"), default=-1)
        first_b = min((k for k, op in enumerate(ops) if op.kind == "B"), default=len(ops))
        if last_f > first_b:
            return f"{want.rule}; stage {s} runs a backward before its last forward"
    return None


def schedule_compare(got: Any, want: Rules) -> str | None:
    """A valid schedule (``schedule_problems``) whose step time on uniform stages is the
    schedule's closed form."""
    schedule = _as_schedule(got)
    if schedule is None:
        return "expected a tuple of per-stage tuples of Op(kind, microbatch, chunk)"
    problems = schedule_problems(schedule, want.p, want.m, want.v)
    if problems:
        return f"not a valid schedule: {problems[0]}"
    step = timeline(schedule, T_F, T_B).step_time_s
    if abs(step - want.step_s) > 1e-9 * want.step_s:
        return (f"step time {step:g} with t_f={T_F:g}, t_b={T_B:g} per stage; the "
                f"schedule's closed form is {want.step_s:g}: some stage waits longer than it "
                "has to")
    return None if want.order is None else order_difference(schedule, want)


def _op_text(op: ref.Op) -> str:
    return f"Op({op.kind!r}, {op.microbatch}, {op.chunk})"


def order_difference(schedule: tuple[tuple[ref.Op, ...], ...], want: Rules) -> str | None:
    """Where ``schedule`` first leaves the published order ``want.order`` (None if nowhere),
    in words: the stage, the position, what it runs and what the order runs there."""
    assert want.order is not None
    for s, (got, expected) in enumerate(zip(schedule, want.order)):
        at = next((k for k, (g, e) in enumerate(zip(got, expected)) if g != e), None)
        if at is None:
            continue
        warm = next(k for k, op in enumerate(expected) if op.kind == "B")
        return (f"stage {s}, op {at}: runs {_op_text(got[at])} where Megatron-LM's order runs "
                f"{_op_text(expected[at])} (stage {s} warms up with {warm} forwards"
                + (", all of them since m = p" if want.m == want.p else "")
                + "; forwards in groups of p micro-batches per chunk)")
    return None


def _schedule_cases(specs: Sequence[tuple[int, ...]], rules: Callable[..., Rules]
                    ) -> list[Case]:
    return [Case(f"p={s[0]}, m={s[1]}" + (f", v={s[2]}" if len(s) > 2 else ""), tuple(s),
                 expected=rules(*s)) for s in specs]


def _schedule_spec(title: str, specs: Sequence[tuple[int, ...]],
                   rules: Callable[..., Rules]) -> Spec:
    return Spec(title, lambda: _schedule_cases(specs, rules), compare=schedule_compare,
                rules=(in_flight_rule, forwards_first_rule), forbid=FORBID_SCHEDULES,
                ops=False)


GPIPE_SPECS = ((1, 1), (1, 4), (2, 1), (2, 3), (4, 4), (4, 8), (3, 7), (8, 5))
ONE_F_ONE_B_SPECS = ((1, 3), (2, 1), (2, 5), (4, 2), (4, 4), (4, 9), (3, 7), (8, 16))
INTERLEAVED_SPECS = ((2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (3, 6, 2), (4, 12, 3),
                     (2, 6, 4))


def _gpipe_rules(p: int, m: int) -> Rules:
    return Rules(p, m, 1, (m,) * p, True, True, pipeline_time(p, m, T_F, T_B),
                 "GPipe runs every forward of a stage before any of its backwards")


def _one_f_one_b_rules(p: int, m: int) -> Rules:
    return Rules(p, m, 1, tuple(min(p - s, m) for s in range(p)), True, False,
                 pipeline_time(p, m, T_F, T_B),
                 "1F1B keeps at most p - s micro-batches in flight on stage s (warm up with "
                 "p - s - 1 forwards, then one forward, one backward)")


def _interleaved_rules(p: int, m: int, v: int) -> Rules:
    order = ref.interleaved_one_f_one_b(p, m, v)
    megatron = tuple(max_in_flight(ops) for ops in order)
    return Rules(p, m, v, megatron, False, False, pipeline_time(p, m, T_F, T_B, v),
                 "interleaved 1F1B holds no more (micro-batch, chunk) activations than "
                 "Megatron-LM's schedule", tuple(tuple(ops) for ops in order))


gpipe = _schedule_spec("gpipe", GPIPE_SPECS, _gpipe_rules)
"""``fn(p, m)``: GPipe as per-stage op lists: every stage all ``m`` forwards, then all ``m``
backwards; ``m`` micro-batches in flight on every stage."""

one_f_one_b = _schedule_spec("one_f_one_b", ONE_F_ONE_B_SPECS, _one_f_one_b_rules)
"""``fn(p, m)``: 1F1B (PipeDream-Flush): stage ``s`` holds at most ``min(p - s, m)``
micro-batches and the step takes GPipe's ``(m + p - 1)(t_f + t_b)``."""

interleaved = _schedule_spec("interleaved", INTERLEAVED_SPECS, _interleaved_rules)
"""``fn(p, m, v)``: interleaved 1F1B over ``v`` model chunks per stage (chunk ``c`` of stage
``s`` is model chunk ``c p + s``; ``m`` a multiple of ``p``): Megatron-LM's order op for op
(with ``m = p`` every forward first, a case PyTorch's ``ScheduleInterleaved1F1B`` and
Megatron-Core since November 2024 do not have), the step taking
``(m + (p - 1) / v)(t_f + t_b)``."""


# -- the executor on real processes -------------------------------------------------------------

WIDTH, ROWS = 8, 3
EXECUTOR_RUNS = (("1f1b", 6), ("gpipe", 4), ("1f1b", 2))


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
                    runs: Sequence[tuple[str, int]], forbid: Sequence[str] = ()
                    ) -> list[dict | Outcome]:
    """The learner's ``step(stage, ops, inputs, targets, loss_fn, shape)`` on this rank's
    stage, for each (schedule, m) of ``runs``: plain data (its loss, its stage's gradients,
    the (kind, micro-batch) order its stage ran, its communication as [kind, elements], the
    references the tripwire caught), or the error it raised as an ``Outcome``."""
    out: list[dict | Outcome] = []
    for name, m in runs:
        model, x, y = _whole(world, m)
        stage = TimedStage(parallel_pipeline.split_stages(list(model), world)[rank])
        ops = ref.make_schedule(name, world, m)[rank]
        dist.barrier()
        with CommRecorder() as rec, watch(forbid, ops=False) as seen:
            try:
                loss: Any = step(stage, ops, list(x.chunk(m)) if rank == 0 else None,
                                 list(y.chunk(m)) if rank == world - 1 else None,
                                 nn.functional.mse_loss, (ROWS, WIDTH))
                loss = float(loss)
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                loss = Outcome.of_error(exc)
        dist.barrier()
        if isinstance(loss, Outcome):
            out.append(Outcome(None, loss.error, loss.error_types, loss.message,
                               {"references": seen.summary()["references"]}))
            continue
        out.append({"loss": loss, "grads": [p.grad for p in stage.inner.parameters()],
                    "order": [[op.kind, op.microbatch] for op in stage.log],
                    "comms": [[c.kind, c.numel] for c in rec.comms],
                    "references": seen.summary()["references"]})
    return out


def expected_comms(rank: int, world: int, m: int) -> list[list[Any]]:
    """One rank's point-to-point messages in one step, sorted: a send (and a receive) of one
    activation or gradient per micro-batch to (from) each neighbour."""
    numel = ROWS * WIDTH
    per = ([["send", numel]] * m if rank < world - 1 else []) + \
        ([["send", numel]] * m if rank > 0 else [])
    return sorted(per + [["recv", numel]] * len(per))


def p2p_rule(case: Case, out: Outcome) -> str | None:
    """A pipeline talks point to point only: per step one message per micro-batch and
    neighbour, each way."""
    m = int(case.args[1])
    for rank, comms in enumerate(out.observed.get("comms", [])):
        got = sorted([str(k), int(n)] for k, n in comms)
        want = expected_comms(rank, NPROCS, m)
        if got != want:
            kinds = sorted({k for k, _ in got})
            return ("a pipeline talks point to point only, one activation (or its gradient) "
                    f"per micro-batch to each neighbour; rank {rank} issued {len(got)} "
                    f"operations ({', '.join(kinds) or 'none'}), expected {len(want)} sends "
                    f"and receives of {ROWS * WIDTH} elements")
    return None


def _order_compare(got: Any, expected: Any) -> str | None:
    if not isinstance(got, list) or len(got) != len(expected):
        return f"expected the op order of {len(expected)} stages"
    return next((f"stage {s} ran {g} instead of {e}" for s, (g, e) in
                 enumerate(zip(got, expected)) if g != e), None)


def _executor_cases() -> list[Case]:
    cases = []
    for name, m in EXECUTOR_RUNS:
        loss, grads = serial_pipeline(NPROCS, m)
        label = f"{name}, p={NPROCS}, m={m}"
        order = [[[op.kind, op.microbatch] for op in ops]
                 for ops in ref.make_schedule(name, NPROCS, m)]
        cases += [
            Case(f"{label}: the loss equals one process on the whole batch", (name, m, "loss"),
                 expected=loss),
            Case(f"{label}: every stage's gradients equal one process", (name, m, "grads"),
                 expected=grads),
            Case(f"{label}: each stage ran its ops in the schedule's order",
                 (name, m, "order"), expected=order, compare=_order_compare)]
    return cases


def _executor_drive(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec,
                    timeout_s: float = 180.0) -> list[Outcome]:
    from labsim.lab.launcher import LaunchTimeout, WorkerError, launch

    step = fns[0]
    try:  # a stub fails at once, before any process group exists
        step(nn.Identity(), (), None, None, None, (1,))
    except NotImplementedError as exc:
        return [Outcome.of_error(exc)] * len(cases)
    except Exception:  # noqa: BLE001, S110 - expected: no process group in this process
        pass
    runs: list[tuple[str, int]] = []
    for c in cases:
        run = (str(c.args[0]), int(c.args[1]))
        if run not in runs:
            runs.append(run)
    try:
        ranks = launch(executor_worker, NPROCS, args=(step, runs, spec.forbid),
                       timeout_s=timeout_s, progress=spec.title).values
    except (LaunchTimeout, WorkerError) as exc:
        return [Outcome.of_error(exc)] * len(cases)
    references = sorted({r for rank in ranks for run in rank for r in (
        run.observed.get("references", []) if isinstance(run, Outcome) else run["references"])})
    outcomes = []
    for c in cases:
        k = runs.index((str(c.args[0]), int(c.args[1])))
        per = [rank[k] for rank in ranks]
        observed = {"comms": [r["comms"] for r in per if isinstance(r, dict)],
                    "references": references}
        bad = next((r for r in per if isinstance(r, Outcome)), None)
        if bad is not None:
            outcomes.append(Outcome(None, bad.error, bad.error_types, bad.message, observed))
            continue
        what = str(c.args[2])
        value = (per[-1]["loss"] if what == "loss" else [r[what] for r in per])
        outcomes.append(plain_outcome(value, observed))
    return outcomes


pipeline_step = Spec("pipeline_step", _executor_cases, drive=_executor_drive,
                     compare=close(rtol=1e-9, atol=1e-12), rules=(p2p_rule,),
                     forbid=FORBID_EXECUTOR, ops=False,
                     gives=tuple(f"labsim.pipeline:{n}" for n in (
                         "make_schedule", "gpipe", "one_f_one_b")))
"""``step(stage, ops, inputs, targets, loss_fn, shape)`` runs one rank's op list of one
training step (F: receive or take the input, run the stage, send on or keep the loss / m; B:
receive the output's gradient or back-propagate the loss, send the input's gradient back) and
returns the summed loss on the last rank: on 4 processes it equals one process on the whole
batch, for 1F1B and GPipe, in the schedule's order, talking point to point only."""
