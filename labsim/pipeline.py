"""Pipeline schedules as data: which forward and backward each stage runs, in what order.

A schedule is a tuple of per-stage op lists; ``schedule[s]`` is what pipeline stage ``s`` (one
GPU of the pipeline, or one TP group) executes, in order.  An ``Op`` is a forward (``"F"``) or
backward (``"B"``) pass of one micro-batch through one model chunk held by that stage.  The
engine (``labsim.sim.step``) executes these lists; here they stay plain data so that "what
order" can be tested, printed and written by a learner without simpy.

Stage ``s`` of ``p`` holds model chunks ``s, s + p, s + 2p, ...`` (``virtual_stages`` of them,
Megatron-LM's interleaved assignment); ``Op.chunk`` is the local index (0 .. v-1), and
``Op.model_chunk(s, p)`` the global one.  Dependencies: the forward of micro-batch ``i`` on
model chunk ``g`` needs its forward on chunk ``g - 1``; the backward on chunk ``g`` needs the
backward on chunk ``g + 1`` (and this chunk's own forward).

Closed forms (Narayanan et al. 2021, section 2.2): with uniform stages and free communication,
GPipe and 1F1B take ``(m + p - 1) * (t_f + t_b)``; the bubble is ``(p - 1) / (m + p - 1)`` of
the step, and interleaving over ``v`` chunks divides the bubble time by ``v``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # annotations only: labsim.step imports this module
    from labsim.network import Placed
    from labsim.step import StepCosts

from labsim.trace import Span, Trace


class Op(NamedTuple):
    """One pass on one stage: ``kind`` "F" (forward) or "B" (backward; with a split backward
    the input gradient only) or "W" (a split backward's weight gradient) of ``microbatch``
    through the stage's local model chunk ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def model_chunk(self, stage: int, pp: int) -> int:
        """Global index of this op's model chunk (0 = first layers of the model)."""
        return self.chunk * pp + stage

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


Schedule = tuple[tuple[Op, ...], ...]


def _check(p: int, m: int, v: int = 1) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every stage runs all ``m`` forwards, then all backwards
    (last micro-batch first, as autograd does for the concatenated batch).  Stage 0 holds the
    activations of all ``m`` micro-batches at its peak."""
    _check(p, m)
    stage = tuple(Op("F", i) for i in range(m)) + tuple(Op("B", i) for i in reversed(range(m)))
    return tuple(stage for _ in range(p))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B, PipeDream-Flush (Narayanan et al. 2021, Fig. 4 top): after a warm-up of forwards,
    each stage alternates one forward and one backward, so at most ``p - s`` micro-batches are
    in flight on stage ``s`` instead of ``m``; same step time as GPipe."""
    _check(p, m)
    return _warmup_steady_cooldown(p, [Op("F", i) for i in range(m)],
                                   [Op("B", i) for i in range(m)],
                                   [min(p - s - 1, m) for s in range(p)])


def _warmup_steady_cooldown(p: int, forwards: list[Op], backwards: list[Op],
                            warmups: list[int]) -> Schedule:
    """Stage ``s`` runs ``warmups[s]`` forwards (warm-up), then alternates the next forward and
    the next backward (steady state), then the remaining backwards (cool-down).  The stages
    share the ``Op`` values, built once (a deep pipeline has p times fewer to build)."""
    total = len(forwards)
    schedule = []
    for s in range(p):
        warmup = warmups[s]
        steady = [None] * (2 * (total - warmup))
        steady[0::2] = forwards[warmup:]
        steady[1::2] = backwards[:total - warmup]
        schedule.append(tuple(forwards[:warmup] + steady + backwards[total - warmup:]))
    return tuple(schedule)


def interleaved_one_f_one_b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Fig. 4 bottom; Megatron-LM's
    ``forward_backward_pipelining_with_interleaving``): each stage holds ``v`` model chunks and
    runs micro-batches in groups of ``p`` through one chunk before moving to the next, which
    shrinks the bubble by ``v`` at the cost of ``v`` times more point-to-point messages.
    Needs ``m`` to be a multiple of ``p`` (Megatron-LM's condition)."""
    _check(p, m, v)
    if m % p:
        raise ValueError(f"interleaved 1F1B needs m={m} to be a multiple of p={p}")
    total = m * v

    def forward_op(k: int) -> Op:  # k-th forward of a stage: chunk advances every p ops
        return Op("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward_op(k: int) -> Op:  # backwards visit the chunks in reverse order
        return Op("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    # Megatron-LM: with m == p every forward goes first (no steady state)
    warmups = [total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
               for s in range(p)]
    return _warmup_steady_cooldown(p, [forward_op(k) for k in range(total)],
                                   [backward_op(k) for k in range(total)], warmups)


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called ``name`` ("gpipe", "1f1b", "interleaved") for p stages, m
    micro-batches and v chunks per stage."""
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_one_f_one_b(p, m, v)
    raise ValueError(f"unknown schedule {name!r}; choose 'gpipe', '1f1b' or 'interleaved'")


def max_in_flight(ops: tuple[Op, ...]) -> int:
    """Most (micro-batch, chunk) activations held at once by a stage running ``ops``: forwards
    done whose backward has not run yet (with a split backward, whose weight-gradient pass W
    has not: W still reads the layer inputs)."""
    deferred = {(op.microbatch, op.chunk) for op in ops if op.kind == "W"}
    held = peak = 0
    for op in ops:
        if op.kind == "F":
            held += 1
        elif op.kind == "W" or (op.kind == "B" and (op.microbatch, op.chunk) not in deferred):
            held -= 1
        peak = max(peak, held)
    return peak


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, section 3.1): 1F1B
    with each backward split into ``B`` (the input gradient, which the previous stage waits
    for) and ``W`` (the weight gradient, which only the optimizer needs).  Stage ``s`` runs
    1F1B's ``p - s - 1`` warm-up forwards, then forward / input-gradient pairs, and starts the
    deferred ``W`` passes only after ``s`` pairs, so they fill what would be the bubble; the
    remaining ``W`` run at the end.  Bubble ``(p - 1)(t_F + t_B - t_W)`` instead of 1F1B's
    ``(p - 1)(t_F + t_B + t_W)``; every stage holds at most ``p`` micro-batches (1F1B's peak).
    (PyTorch's ``ScheduleInterleavedZeroBubble`` with one stage per rank builds the same
    order.)"""
    _check(p, m)
    return tuple(_zero_bubble_stage(s, p, m) for s in range(p))


def _zero_bubble_stage(s: int, p: int, m: int) -> tuple[Op, ...]:
    warmup = min(p - s - 1, m)
    ops = [Op("F", i) for i in range(warmup)]
    waiting: list[int] = []  # input gradients done whose weight gradient is deferred
    for k in range(m):
        if k < m - warmup:  # steady state: F, B and (after s pairs) a deferred W
            ops.append(Op("F", warmup + k))
        ops.append(Op("B", k))  # cool-down: the B (and W) only
        waiting.append(k)
        if k >= s:
            ops.append(Op("W", waiting.pop(0)))
    ops.extend(Op("W", i) for i in waiting)
    return tuple(ops)


def schedule_problems(schedule: Schedule, p: int, m: int, v: int = 1) -> list[str]:
    """What is wrong with a schedule for ``p`` stages, ``m`` micro-batches and ``v`` chunks
    per stage, in words (empty when it is right): every stage runs a forward ``F`` and a
    backward ``B`` of every (micro-batch, chunk) exactly once, the backward after the forward;
    a split backward's ``W`` once after its ``B`` (for all ops or none); and the ops can run
    (no stage waits for a message that never comes).  Dependencies are those of
    ``labsim.pipeline``'s module docstring."""
    _check(p, m, v)
    if len(schedule) != p:
        return [f"{len(schedule)} stage lists for p={p} stages"]
    problems = []
    kinds = {op.kind for ops in schedule for op in ops} if all(
        isinstance(op, tuple) and len(op) == 3 for ops in schedule for op in ops) else set()
    if not kinds:
        return ["every op must be an Op(kind, microbatch, chunk)"]
    split = "W" in kinds
    for s, ops in enumerate(schedule):
        seen: dict[tuple[str, int, int], int] = {}
        for k, (kind, mb, chunk) in enumerate(ops):
            if kind not in "FBW" or not 0 <= mb < m or not 0 <= chunk < v:
                problems.append(f"stage {s} op {k}: {kind}{mb} chunk {chunk} is not an op of "
                                f"this schedule (kinds F B W, micro-batches 0..{m - 1}, "
                                f"chunks 0..{v - 1})")
                continue
            if (kind, mb, chunk) in seen:
                problems.append(f"stage {s}: {kind}{mb} chunk {chunk} runs twice")
            seen[(kind, mb, chunk)] = k
        for mb in range(m):
            for chunk in range(v):
                f, b = seen.get(("F", mb, chunk)), seen.get(("B", mb, chunk))
                w = seen.get(("W", mb, chunk))
                if f is None or b is None or (split and w is None):
                    problems.append(f"stage {s}: micro-batch {mb} chunk {chunk} lacks "
                                    + ("a forward" if f is None else "a backward" if b is None
                                       else "its weight-gradient W"))
                elif b < f or (w is not None and w < b):
                    problems.append(f"stage {s}: micro-batch {mb} chunk {chunk} runs its "
                                    "backward before its forward (or W before B)")
    if not problems:
        try:
            timeline(schedule, 1.0, 2.0, t_w=1.0 if split else 0.0)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


@dataclass(frozen=True)
class Timeline:
    """When every op of a schedule runs on uniform stages (``timeline``): the step's seconds,
    its bubble (idle share of the stages from the start to the last op, averaged over
    stages), peak (micro-batch, chunk) activations per stage, point-to-point messages between
    different stages, and the spans (stage = rank) of its ``trace``."""

    step_time_s: float
    bubble_fraction: float
    in_flight: tuple[int, ...]
    messages: int
    spans: list[Span] = field(repr=False, compare=False)

    @property
    def trace(self) -> Trace:
        return Trace(self.spans, detail="op", rank_label="pipeline stage")


_KIND_NAME = {"F": "forward", "B": "backward", "W": "wgrad"}


def timeline(schedule: Schedule, t_f: float, t_b: float, *, t_w: float = 0.0,
             p2p_s: float = 0.0) -> Timeline:
    """Run ``schedule`` on paper: ``p = len(schedule)`` uniform stages whose forward of one
    micro-batch takes ``t_f`` and backward ``t_b`` (with ``W`` ops: ``t_b - t_w`` for the
    input gradient B and ``t_w`` for W), split evenly over the ``v`` chunks of an interleaved
    schedule; every message between two stages ``p2p_s``, one at a time per direction.  Each
    op starts when its stage is free and its input has arrived: an exact evaluation of the
    schedule's critical path (``labsim.sim.pipeline.simulate_pipeline`` is the simulated
    face for the named schedules and agrees).  Raises ``ValueError`` naming the stage and op
    that wait for a message no stage ever sends."""
    p = len(schedule)
    v = 1 + max(op.chunk for ops in schedule for op in ops)
    n = p * v
    split = any(op.kind == "W" for ops in schedule for op in ops)
    dur = {"F": t_f / v, "B": (t_b - t_w if split else t_b) / v, "W": t_w / v}
    arrival: dict[tuple[str, int, int], float] = {}
    link_free: dict[tuple[int, int], float] = {}
    clock, pos, busy = [0.0] * p, [0] * p, [0.0] * p
    spans: list[Span] = []
    messages = 0

    def send(key: tuple[str, int, int], src: int, ready: float) -> None:
        nonlocal messages
        dst = key[2] % p
        if dst == src:  # the next chunk is on this stage: nothing travels
            arrival[key] = ready
            return
        start = max(ready, link_free.get((src, dst), 0.0))
        link_free[(src, dst)] = arrival[key] = start + p2p_s
        messages += 1
        spans.append(Span(src, "p2p", "send", start, start + p2p_s,
                          f"send {key[0]}{key[1]}" + (f" chunk {key[2]}" if v > 1 else "")))

    progress = True
    while progress:
        progress = False
        for s, ops in enumerate(schedule):
            while pos[s] < len(ops):
                kind, mb, chunk = ops[pos[s]]
                g = chunk * p + s
                start = clock[s]
                if kind == "F" and g > 0 or kind == "B" and g < n - 1:
                    key = (kind, mb, g)
                    if key not in arrival:
                        break  # waits for a message not sent yet
                    start = max(start, arrival[key])
                end = clock[s] = start + dur[kind]
                busy[s] += end - start
                label = f"{kind}{mb}" + (f" chunk {g}" if v > 1 else "")
                spans.append(Span(s, "compute", _KIND_NAME[kind], start, end, label))
                if kind == "F" and g < n - 1:
                    send(("F", mb, g + 1), s, end)
                elif kind == "B" and g > 0:
                    send(("B", mb, g - 1), s, end)
                pos[s] += 1
                progress = True
    stuck = [s for s in range(p) if pos[s] < len(schedule[s])]
    if stuck:
        s = stuck[0]
        kind, mb, chunk = schedule[s][pos[s]]
        raise ValueError(f"deadlock: stage {s} waits at {kind}{mb} chunk {chunk} for a "
                         "message that no stage sends before it waits too")
    end = max(clock)
    bubble = sum(1.0 - b / end for b in busy) / p if end > 0 else 0.0
    return Timeline(end, bubble, tuple(max_in_flight(tuple(ops)) for ops in schedule),
                    messages, spans)


def min_microbatches(p: int, target: float, v: int = 1) -> int:
    """The fewest micro-batches whose bubble ``(p - 1) / (v m + p - 1)`` is at most
    ``target`` (a fraction in (0, 1)): ``m >= (p - 1)(1 - target) / (v target)``."""
    _check(p, 1, v)
    if not 0 < target < 1:
        raise ValueError(f"target={target!r} must be a fraction strictly between 0 and 1")
    m = max(1, math.ceil((p - 1) * (1 - target) / (v * target) - 1e-12))
    while bubble_fraction(p, m, v) > target:  # guard the rounding
        m += 1
    return m


def bubble_from_trace(trace: Trace) -> float:
    """The idle share of a pipeline ``trace``'s compute streams from the first op to the last,
    averaged over its stages (ranks): the bubble as a Gantt chart shows it."""
    spans = [s for s in trace if s.stream == "compute"]
    if not spans:
        return 0.0
    start = min(s.start_s for s in spans)
    length = max(s.end_s for s in spans) - start
    stages = sorted({s.rank for s in spans})
    busy = {r: 0.0 for r in stages}
    for s in spans:
        busy[s.rank] += s.end_s - s.start_s
    return sum(1.0 - b / length for b in busy.values()) / len(stages) if length > 0 else 0.0


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step for uniform stages and free communication:
    ``(p - 1) / (v m + p - 1)`` (= bubble time ``(p - 1)(t_f + t_b) / v`` over the step)."""
    _check(p, m, v)
    return (p - 1) / (v * m + p - 1)


def pipeline_time(p: int, m: int, t_f: float, t_b: float, v: int = 1) -> float:
    """Closed-form step time of a pipeline: ``(m + (p - 1) / v) * (t_f + t_b)``, where t_f and
    t_b are one micro-batch's forward and backward time on one stage (all its chunks)."""
    _check(p, m, v)
    return (m + (p - 1) / v) * (t_f + t_b)


def in_flight_peak(name: str, p: int, m: int, v: int = 1) -> int:
    """``max_in_flight`` of stage 0 of ``make_schedule(name, p, m, v)`` without building it:
    GPipe holds all m; 1F1B min(p, m); interleaved 1F1B its warm-up plus one (all m v when
    m == p, Megatron-LM's rule)."""
    _check(p, m, v)
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p, m)
    total = m * v
    if m == p:
        return total
    warmup = min((p - 1) * 2 + (v - 1) * p, total)
    return warmup + 1 if warmup < total else total


@dataclass(frozen=True)
class AloneRun:
    """What ``alone_schedule`` computed: each stage's end, compute-busy seconds, the end of
    the last compute, every op's (start, end) per stage (flat list), and the other spans."""

    ends: list[float]
    busy: list[float]
    compute_end: float
    op_times: list[list[float]]
    spans: list[tuple]


def _contended(c: StepCosts) -> set[int]:
    """Pipes that two streams of work can load at once (``alone_schedule`` watches these)."""
    p = c.plan.pp
    users: dict[int, set[tuple]] = {}
    blocking = c.software.blocking_p2p
    for (a, b), pl in c.p2p.items():
        for x in pl.pipes:
            users.setdefault(x, set()).add(("compute" if blocking else "p2p", a, b))
    for g, (pl, _) in enumerate(c.buckets):
        for x in (pl.pipes if pl is not None else ()):
            users.setdefault(x, set()).add(("dp", g % p))
    for s_ in range(p):
        pl = c.param_gather[s_]
        for x in (pl.pipes if pl is not None else ()):
            users.setdefault(x, set()).add(("dp", s_))
        for g in range(s_, p * c.plan.virtual_stages, p):
            tp = c.chunks[g].tp
            for x in (tp.pipes if tp is not None else ()):
                users.setdefault(x, set()).add(("compute", s_))
    return {x for x, u in users.items() if len(u) > 1}


def alone_schedule(c: StepCosts, schedule: Schedule, check: bool = False,
                   trace: bool = True) -> AloneRun | None:
    """A step's ops in schedule order with every flow at its rate alone (no simpy): start at
    max(stage free, input arrival); buckets on a stream as backward produces them; then the
    optimizer and ZeRO-1/2's parameter all-gather.  Exactly what ``labsim.simulate_step``
    computes whenever no two flows move bytes on one pipe at the same time; with ``check``
    it returns None when some do (the caller then simulates the network).  ``trace=False``
    leaves ``spans`` empty (the closed form needs the times only)."""
    plan = c.plan
    p, m = plan.pp, plan.microbatches
    n_chunks = p * plan.virtual_stages
    zero2 = plan.zero_stage == 2
    h = c.software.tp_overlap_hidden if plan.tp_comm_overlap else 0.0
    blocking = c.software.blocking_p2p
    spans: list[tuple] = []
    record = spans.append
    watch = _contended(c) if check else set()
    moving: dict[int, list[tuple[float, float]]] = {x: [] for x in watch}
    overlap = plan.overlap_grad_reduce
    busy = [0.0] * p
    clock = [0.0] * p
    index = [0] * p
    # arrival[kind, chunk][mb]: when micro-batch mb's input of that op reaches its stage
    arrival = {(kind, g): [None] * m for kind in "FB" for g in range(n_chunks)}
    pending: list[list[tuple]] = [[] for _ in range(p)]  # buckets: (ready, bucket, k, g)
    bare = not (check or trace)
    stream_free = [0.0] * p  # with ``bare``, when each stage's bucket stream is free
    times: list[list[float]] = [[] for _ in range(p)]  # start, end of every op
    tables = [_op_table(c, s, arrival) for s in range(p)]
    last_b = [_last_backwards(ops, plan.virtual_stages) for ops in schedule]
    remaining = sum(len(o) for o in schedule)
    while remaining:
        advanced = False
        for s in range(p):
            ops, i, t, table = schedule[s], index[s], clock[s], tables[s]
            n = len(ops)
            if i == n:
                continue
            bucket_ok = overlap
            start_i = i
            times_s = times[s]
            while i < n:
                kind, mb, local = ops[i]
                fwd, g, inbox, work, tp, calls, outbox, send = table[kind, local]
                if inbox is not None:
                    a = inbox[mb]
                    if a is None:
                        break
                    if a > t:
                        t = a
                start = t
                if tp is None:
                    end = start + work
                    planned = work
                elif h:
                    alone = tp.alone_s * calls
                    end = start + max(work, h * alone) + (1 - h) * alone
                    planned = end - start
                else:
                    alone = tp.alone_s * calls
                    end = start + work + alone
                    planned = work + alone
                if bucket_ok and not fwd and (zero2 or last_b[s][local] == i):
                    bucket, n_buckets = c.buckets[g]
                    if bare and n_buckets:  # the stream's end only: run it now, in order
                        free, tau = stream_free[s], bucket.alone_s
                        for k in range(n_buckets):
                            ready = start + planned * (k + 1) / n_buckets
                            free = (free if free > ready else ready) + tau
                        stream_free[s] = free
                    else:
                        for k in range(n_buckets):
                            pending[s].append((start + planned * (k + 1) / n_buckets, bucket,
                                               k, g))
                times_s.append(start)
                times_s.append(end)
                t = end
                if outbox is not None:
                    if send is None:
                        outbox[mb] = end
                    else:
                        arrive = outbox[mb] = end + send.alone_s
                        if blocking:
                            t = arrive
                i += 1
            if i > start_i:
                remaining -= i - start_i
                advanced = True
            index[s], clock[s] = i, t
        if not advanced:
            raise ValueError("the schedule deadlocks: an op waits for a message never sent")
    for s in range(p):
        ts = times[s]
        busy[s] = sum(ts[1::2]) - sum(ts[0::2])
    compute_end = max(clock)
    ends = []
    for s in range(p):
        queue = pending[s]
        if not overlap:
            queue = [(clock[s], b, k, g)
                     for g in range(s, n_chunks, p) for b, n in [c.buckets[g]]
                     if b is not None for k in range(n * (m if zero2 else 1))]
        free = stream_free[s]
        if check or trace:
            for ready, bucket, k, g in queue:
                start = free if free > ready else ready  # max(ready, free)
                free = start + bucket.alone_s
                if check:
                    _mark(moving, bucket, start + bucket.latency_s, free)
                if trace:
                    record((s, "dp", "comm", start, free, f"bucket {k} chunk {g}",
                            bucket.nbytes))
        else:  # the stream's end only
            for ready, bucket, _, _ in queue:
                free = (free if free > ready else ready) + bucket.alone_s
        t = max(clock[s], free) + c.optimizer_s[s]
        if trace:
            record((s, "optimizer", "optimizer", t - c.optimizer_s[s], t, "optimizer step",
                    0.0))
        gather = c.param_gather[s]
        if gather is not None and not c.software.overlap_param_gather:
            if trace:
                record((s, "dp", "comm", t, t + gather.alone_s, "allgather parameters",
                        gather.nbytes))
            if check:
                _mark(moving, gather, t + gather.latency_s, t + gather.alone_s)
            t += gather.alone_s
        ends.append(t)
    if watch and _overlapping(c, schedule, times, moving):
        return None
    return AloneRun(ends, busy, compute_end, times, spans)


def _last_backwards(ops: tuple[Op, ...], v: int) -> dict[int, int]:
    """Index of the last backward of each local chunk in ``ops`` (searched from the end)."""
    last: dict[int, int] = {}
    for i in range(len(ops) - 1, -1, -1):
        kind, _, local = ops[i]
        if kind == "B" and local not in last:
            last[local] = i
            if len(last) == v:
                break
    return last


def _op_table(c: StepCosts, s: int, arrival: dict[tuple[str, int], list]
              ) -> dict[tuple[str, int], tuple]:
    """Stage ``s``'s ops by (kind, local chunk): whether a forward, the model chunk, where its
    input arrives (None: it needs none), compute seconds, its TP collective and their count,
    where its output goes (None: nowhere) and the send that carries it (None: same stage).
    An inbox or outbox is the list, by micro-batch, of one chunk's arrivals of one kind."""
    p = c.plan.pp
    n_chunks = p * c.plan.virtual_stages
    table = {}
    for kind in "FB":
        for local in range(c.plan.virtual_stages):
            g = local * p + s
            ch = c.chunks[g]
            fwd = kind == "F"
            work, calls = (ch.t_fwd, ch.tp_fwd) if fwd else (ch.t_rec + ch.t_bwd, ch.tp_bwd)
            tp = ch.tp if ch.tp is not None and calls and ch.tp.pipes else None
            nxt = g + 1 if fwd else g - 1
            out = 0 <= nxt < n_chunks
            need = g > 0 if fwd else g < n_chunks - 1
            table[kind, local] = (fwd, g, arrival[kind, g] if need else None, work, tp, calls,
                                  arrival[kind, nxt] if out else None,
                                  c.p2p.get((s, nxt % p)) if out else None)
    return table


def _overlapping(c: StepCosts, schedule: Schedule, times: list[list[float]],
                 moving: dict[int, list[tuple[float, float]]]) -> bool:
    """Whether two flows of a finished ``alone_schedule`` move bytes on one watched pipe (a
    key of ``moving``, which holds the stream's intervals) at the same time.  An op's flows
    are rebuilt from its (start, end) in ``times``, stage by stage and op kind by op kind, in
    numpy: a send from the op's end plus the send's latency to its arrival; a blocking TP
    collective from the compute's end plus its latencies to the op's end; an overlapped one
    as its hidden share from the start and the rest after the compute.  The arithmetic is the
    op loop's, so the intervals are bit for bit those it would have recorded."""
    plan = c.plan
    p = plan.pp
    h = c.software.tp_overlap_hidden if plan.tp_comm_overlap else 0.0
    starts: dict[int, list] = {x: [np.array([a for a, _ in lst])] for x, lst in moving.items()}
    stops: dict[int, list] = {x: [np.array([b for _, b in lst])] for x, lst in moving.items()}

    def add(pipes: tuple[int, ...], a: np.ndarray, b: np.ndarray) -> None:
        for x in pipes:
            if x in starts:
                starts[x].append(a)
                stops[x].append(b)

    for s in range(p):
        ops = schedule[s]
        tp_watch = 2 * s in moving or 2 * s + 1 in moving
        flat = np.array(times[s])
        begin, end = flat[0::2], flat[1::2]
        kinds = np.frombuffer("".join(map(itemgetter(0), ops)).encode("ascii"), np.uint8)
        forward = kinds == ord("F")
        local_of = (np.array(list(map(itemgetter(2), ops))) if plan.virtual_stages > 1
                    else None)
        for kind in "FB":
            for local in range(plan.virtual_stages):
                g = local * p + s
                ch = c.chunks[g]
                fwd = kind == "F"
                work, calls = (ch.t_fwd, ch.tp_fwd) if fwd else (ch.t_rec + ch.t_bwd,
                                                                 ch.tp_bwd)
                tp = ch.tp if ch.tp is not None and calls and ch.tp.pipes else None
                nxt = g + 1 if fwd else g - 1
                send = c.p2p.get((s, nxt % p)) if 0 <= nxt < p * plan.virtual_stages else None
                tp_pipes = tp.pipes if tp is not None and tp_watch else ()
                send_pipes = send.pipes if send is not None else ()
                if not any(x in moving for x in tp_pipes + send_pipes):
                    continue
                sel = forward if fwd else ~forward
                if local_of is not None:
                    sel = sel & (local_of == local)
                a, b = begin[sel], end[sel]
                if send_pipes:
                    add(send_pipes, b + send.latency_s, b + send.alone_s)
                if tp_pipes and h:
                    alone = tp.alone_s * calls
                    add(tp_pipes, a + h * calls * tp.latency_s, a + h * alone)
                    add(tp_pipes, a + max(work, h * alone) + (1 - h) * calls * tp.latency_s, b)
                elif tp_pipes:
                    add(tp_pipes, a + work + calls * tp.latency_s, b)
    for x in moving:
        a, b = np.concatenate(starts[x]), np.concatenate(stops[x])
        if len(a) > 1:
            order = np.lexsort((b, a))  # by start, then end: the order of sorted tuples
            a, b = a[order], b[order]
            e0 = b[:-1]
            if np.any(a[1:] < e0 - 1e-12 * np.maximum(1.0, e0)):
                return True
    return False


def _mark(moving: dict[int, list], placed: Placed, start: float, end: float) -> None:
    for x in placed.pipes:
        lst = moving.get(x)
        if lst is not None:
            lst.append((start, end))
