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
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

import numpy as np

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


def interleaved_one_f_one_b(p: int, m: int, v: int, group: int | None = None) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Fig. 4 bottom; Megatron-LM's
    ``forward_backward_pipelining_with_interleaving``): each stage holds ``v`` model chunks and
    runs micro-batches in groups of ``p`` through one chunk before moving to the next, which
    shrinks the bubble by ``v`` at the cost of ``v`` times more point-to-point messages.
    Needs ``m`` to be a multiple of ``p`` (Megatron-LM's condition); with ``m == p`` every
    forward goes first.

    ``group`` N: Megatron-Core's tunable schedule (``microbatch_group_size_per_vp_stage``,
    its default p; Llama 3's N, Llama Team 2024, section 3.3.2): groups of N micro-batches
    (the last group the rest, ``get_schedule_table``), stage s warming up with
    ``2 (p - s - 1) + (v - 1) N`` forwards (``get_pp_rank_microbatches``) and no ``m == p``
    case; N from p to m, and m % N either 0 or at least p (``group_problems``).  With N = p
    and more than p micro-batches it is the order above."""
    _check(p, m, v)
    total = m * v
    warmups = [interleaved_warmup(p, m, v, s, group) for s in range(p)]
    if group is not None:
        _check_group("interleaved", p, m, group)
        table = _group_table(m, v, group)
        return _warmup_steady_cooldown(p, [Op("F", mb, c) for mb, c in table],
                                       [Op("B", mb, v - 1 - c) for mb, c in table], warmups)
    if m % p:
        raise ValueError(f"interleaved 1F1B needs m={m} to be a multiple of p={p}")

    def forward_op(k: int) -> Op:  # k-th forward of a stage: chunk advances every p ops
        return Op("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward_op(k: int) -> Op:  # backwards visit the chunks in reverse order
        return Op("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    return _warmup_steady_cooldown(p, [forward_op(k) for k in range(total)],
                                   [backward_op(k) for k in range(total)], warmups)


def interleaved_warmup(p: int, m: int, v: int, stage: int, group: int | None = None) -> int:
    """Forwards stage ``stage`` of the interleaved schedule runs before its first backward:
    ``2 (p - s - 1) + (v - 1) N``, at most all m v (N = p in Megatron-LM's order, where with
    m == p every forward goes first; Megatron-Core's tunable schedule, November 2024,
    ``get_pp_rank_microbatches``, and PyTorch's ScheduleInterleaved1F1B dropped that case, so
    their later stages start 1F1B sooner)."""
    total = m * v
    if group is None and m == p:
        return total
    return min((p - stage - 1) * 2 + (v - 1) * (p if group is None else group), total)


def _check_group(name: str, p: int, m: int, group: object) -> None:
    """ValueError naming what is wrong with ``group`` for schedule ``name`` (see
    ``group_problems``; a schedule other than the interleaved one has no group)."""
    problem = (group_problems(p, m, group) if name == "interleaved" else
               f"group={group!r} is the interleaved schedule's micro-batch group; {name!r} "
               "has none: leave it None")
    if problem:
        raise ValueError(problem)


def group_problems(p: int, m: int, group: object) -> str:
    """What is wrong with ``group`` as Megatron-Core's micro-batch group (the micro-batches a
    stage runs through one chunk in a row) for p stages and m micro-batches; "" if nothing.
    Megatron-Core refuses a group outside [p, m], and a last group of fewer than p
    micro-batches ("it introduces dependency bubbles")."""
    if isinstance(group, bool) or not isinstance(group, int):
        return f"microbatch_group={group!r}: must be a whole number of micro-batches"
    if not p <= group <= m:
        return (f"microbatch_group={group} must lie between p={p} and m={m} (Megatron-Core's "
                "range for microbatch_group_size_per_vp_stage); choose one in it or more "
                "micro-batches")
    rest = m % group
    if 0 < rest < p:
        return (f"m={m} micro-batches in groups of {group} leave a last group of {rest}, fewer "
                f"than p={p} (Megatron-Core refuses it: the pipeline would wait on its "
                "dependencies); choose a group that divides m or leaves at least p")
    return ""


def _group_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, local chunk) of a stage's forwards in order, in groups of ``group``
    micro-batches, the last group the rest (Megatron-Core's ``get_schedule_table``)."""
    table = []
    for first in range(0, m, group):
        last = m if first + group >= m else first + group
        table.extend((mb, c) for c in range(v) for mb in range(first, last))
    return table


def make_schedule(name: str, p: int, m: int, v: int = 1, group: int | None = None
                  ) -> Schedule:
    """The schedule called ``name`` ("gpipe", "1f1b", "interleaved") for p stages, m
    micro-batches and v chunks per stage; ``group``: the interleaved schedule's micro-batch
    group (``interleaved_one_f_one_b``).  A schedule is immutable data, so a short one
    (at most ``KEPT_OPS`` ops) asked for again is the one built before (``_built``, forgotten
    by ``clear_cache``): a planner evaluates the same few short shapes for many plans
    (``labsim.estimate_step`` evaluates at most 768 ops), while long ones would hold memory."""
    if (type(name) is str and type(p) is int and type(m) is int and type(v) is int
            and (group is None or type(group) is int) and 2 * p * m * v <= KEPT_OPS):
        return _built(name, p, m, v, group)
    return _build(name, p, m, v, group)  # its errors name what is wrong


def clear_cache() -> None:
    """Forget the schedules ``make_schedule`` built, as a fresh process would."""
    _built.cache_clear()


def _build(name: str, p: int, m: int, v: int, group: int | None) -> Schedule:
    if group is not None and name != "interleaved":
        _check_group(name, p, m, group)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_one_f_one_b(p, m, v, group)
    raise ValueError(f"unknown schedule {name!r}; choose 'gpipe', '1f1b' or 'interleaved'")


KEPT_OPS = 1024  # the longest schedule make_schedule keeps (128 of them: at most ~11 MB)
_built = lru_cache(maxsize=128)(_build)


def max_in_flight(ops: tuple[Op, ...], weights: Sequence[float] | None = None) -> float:
    """Most (micro-batch, chunk) activations held at once by a stage running ``ops``: forwards
    done whose backward has not run yet (with a split backward, whose weight-gradient pass W
    has not: W still reads the layer inputs).  With ``weights`` (one per local chunk, e.g.
    its layers) each activation counts its chunk's weight: the peak of their sum."""
    deferred = {(op.microbatch, op.chunk) for op in ops if op.kind == "W"}
    held = peak = 0
    for op in ops:
        w = 1 if weights is None else weights[op.chunk]
        if op.kind == "F":
            held += w
        elif op.kind == "W" or (op.kind == "B" and (op.microbatch, op.chunk) not in deferred):
            held -= w
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


def in_flight_peak(name: str, p: int, m: int, v: int = 1,
                   weights: Sequence[float] | None = None, group: int | None = None) -> float:
    """``max_in_flight`` of stage 0 of ``make_schedule(name, p, m, v, group)`` without
    building it: GPipe holds all m; 1F1B min(p, m); interleaved 1F1B its warm-up plus one
    (all m v when m == p, Megatron-LM's rule: stage 0 holds the same under Megatron-Core's
    and PyTorch's; with a micro-batch ``group`` N the warm-up is 2 (p - 1) + (v - 1) N).
    With ``weights`` (one per local chunk of stage 0) the peak of their sum, stage 0's
    interleaved order walked without building its ops."""
    _check(p, m, v)
    if group is not None:
        _check_group(name, p, m, group)
    if weights is not None and (name != "interleaved" or len(set(weights)) == 1):
        return weights[0] * in_flight_peak(name, p, m, v, group=group)  # one weight counts
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p, m)
    total = m * v
    warmup = interleaved_warmup(p, m, v, 0, group)
    if weights is None:
        return warmup + 1 if warmup < total else total
    # interleaved_one_f_one_b's stage 0: forward k runs chunk (k // p) % v (in groups of N:
    # ``_group_table``), backward k chunk v - 1 minus that; the warm-up's forwards, then one
    # forward and one backward in turn
    w = np.asarray(weights, dtype=float)
    rounds = ((np.arange(total) // p) % v if group is None
              else np.array([c for _, c in _group_table(m, v, group)]))
    added, freed = w[rounds], w[v - 1 - rounds]
    steady = np.empty(2 * (total - warmup))
    steady[0::2], steady[1::2] = added[warmup:], -freed[:total - warmup]
    return float(np.cumsum(np.concatenate((added[:warmup], steady))).max())
