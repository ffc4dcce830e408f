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

from typing import NamedTuple


class Op(NamedTuple):
    """One pass on one stage: ``kind`` "F" (forward) or "B" (backward) of ``microbatch``
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
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        ops = [Op("F", i) for i in range(warmup)]  # warm-up: fill the pipeline
        for i in range(m - warmup):  # steady state: one forward, one backward
            ops.append(Op("F", warmup + i))
            ops.append(Op("B", i))
        ops.extend(Op("B", i) for i in range(m - warmup, m))  # cool-down: drain it
        schedule.append(tuple(ops))
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

    schedule = []
    for s in range(p):
        if m == p:  # Megatron-LM: with m == p every forward goes first (no steady state)
            warmup = total
        else:
            warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
        ops = [forward_op(k) for k in range(warmup)]  # warm-up
        for k in range(total - warmup):  # steady state: one forward, one backward
            ops.append(forward_op(warmup + k))
            ops.append(backward_op(k))
        ops.extend(backward_op(k) for k in range(total - warmup, total))  # cool-down
        schedule.append(tuple(ops))
    return tuple(schedule)


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
    done whose backward has not run yet."""
    held = peak = 0
    for op in ops:
        held += 1 if op.kind == "F" else -1
        peak = max(peak, held)
    return peak


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
