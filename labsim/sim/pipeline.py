"""The pipeline engine: stages as simpy processes executing schedules given as data.

``run_pipeline`` executes the per-stage op lists of ``labsim.pipeline`` on ``p``
stages whose ops last what a ``ChunkCost`` says: an op waits for its input message (the
activation from the previous model chunk, or the gradient from the next), then computes, then
sends its output point to point; messages on one link direction go one at a time.  A message's
arrival time is known when it is sent, so a stage runs ahead on its own clock while its inputs
are known and blocks (a simpy event) only on a message not sent yet: the cost of a run is
O(ops) with few events.

``simulate_pipeline`` is the simulated face of ``pipeline_time`` (uniform stages);
``labsim.sim.step`` uses ``run_pipeline`` for a whole training step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import simpy

from labsim.pipeline import Op, make_schedule, max_in_flight
from labsim.trace import Trace


@dataclass(frozen=True)
class ChunkCost:
    """Per-op durations and FLOPs of one model chunk on one GPU (times in s, sizes in bytes)."""

    t_fwd: float
    t_bwd: float
    t_rec: float
    comm_fwd: float  # blocking TP / ZeRO-3 communication inside a forward op
    comm_bwd: float
    flops_hw: float  # forward + recompute + backward FLOPs executed
    flops_model: float
    grad_bytes: float  # gradient bytes of this chunk on one GPU
    param_bytes: float


def run_pipeline(schedule_name: str, p: int, m: int, v: int, chunks: list[ChunkCost], p2p: dict,
                  spans: list) -> list[dict]:
    """Execute the schedule with simpy; append raw span tuples to ``spans``; return per stage
    its busy time, first start, last end, each chunk's last backward and the in-flight peak.
    """
    n_chunks = p * v
    schedule = make_schedule(schedule_name, p, m, v)
    env = simpy.Environment()
    timeout, event = env.timeout, env.event
    arrivals: dict[tuple, simpy.Event] = {}
    link_free: dict[tuple[int, int], float] = {}
    record = spans.append
    stats = [{"busy": 0.0, "first": 0.0, "last": 0.0, "last_bwd": {}} for _ in range(p)]

    # A message's arrival time is known when it is sent; ``arrivals`` holds that time, or,
    # when the receiver asked first, the event it waits on.  Each stage keeps its own clock
    # ``t`` (when it is next free) and runs ahead of ``env.now`` as long as its inputs are
    # already known; it yields to simpy only to wait for a message not sent yet.  Timing is
    # the same as yielding once per op (every op starts at max(stage free, input arrival)),
    # at a fraction of the events.
    def send(key: tuple, src: int, dst: int, ready: float) -> None:
        start = max(ready, link_free.get((src, dst), 0.0))
        end = start + p2p[(src, dst)]
        link_free[(src, dst)] = end
        record((src, "p2p", "send", start, end, key))
        waiting = arrivals.get(key)
        if waiting is None:
            arrivals[key] = end
        else:  # the receiver is blocked on this message: wake it when it arrives
            timeout(end - env.now).callbacks.append(lambda _e, w=waiting: w.succeed())

    def stage(s: int, ops: tuple[Op, ...]):
        busy = 0.0
        t = 0.0  # this stage's clock: when it is free for its next op
        first = None
        last_bwd = stats[s]["last_bwd"]
        for kind, mb, chunk in ops:
            g = chunk * p + s
            c = chunks[g]
            forward = kind == "F"
            start = t
            if (g > 0) if forward else (g < n_chunks - 1):
                key = (kind, mb, g)
                arrival = arrivals.pop(key, None)
                if arrival is None:  # not sent yet: wait until it arrives
                    arrivals[key] = ev = event()
                    yield ev
                    arrival = env.now
                if arrival > start:
                    start = arrival
            if forward:
                work, comm = c.t_fwd, c.comm_fwd
            else:
                work, comm = c.t_rec + c.t_bwd, c.comm_bwd
            t = end = start + work + comm
            busy += end - start
            if first is None:
                first = start
            if forward:
                record((s, "compute", "forward", start, start + work, (kind, mb, g)))
            else:
                if c.t_rec > 0:
                    record((s, "compute", "recompute", start, start + c.t_rec, (kind, mb, g)))
                record((s, "compute", "backward", start + c.t_rec, start + work, (kind, mb, g)))
                last_bwd[g] = (start, end)
            if comm > 0:
                record((s, "compute", "comm", start + work, end, (kind, mb, g)))
            if forward:
                if g < n_chunks - 1:
                    send(("F", mb, g + 1), s, (g + 1) % p, end)
            elif g > 0:
                send(("B", mb, g - 1), s, (g - 1) % p, end)
        stats[s].update(busy=busy, first=first, last=t)

    for s in range(p):
        env.process(stage(s, schedule[s]))
    env.run()
    for s in range(p):
        stats[s]["in_flight"] = max_in_flight(schedule[s])
    return stats


def time_by_kind(spans: list, rank: int) -> dict[str, float]:
    """Seconds per span kind on ``rank`` (what ``Trace.time_by_kind`` gives, without the
    trace)."""
    totals: dict[str, float] = {}
    for r, _stream, kind, start, end, _what in spans:
        if r == rank:
            totals[kind] = totals.get(kind, 0.0) + end - start
    return totals


def build_trace(spans: list, chunked: bool) -> Trace:
    """Turn the raw spans of a run into a ``Trace`` (built only when asked for).  A raw span
    ends with ``(op, microbatch, chunk)`` for pipeline work or ``[label, nbytes, args]``."""
    trace = Trace(detail="op")
    for rank, stream, kind, start, end, what in spans:
        if isinstance(what, tuple):
            op, mb, g = what
            label = f"{op}{mb}" + (f" chunk {g}" if chunked else "")
            if kind == "send":
                label = f"send {label}"
            elif kind == "comm":
                label = f"{label} TP/ZeRO"
            trace.add(rank, stream, kind, start, end, label)
        else:
            label, nbytes, args = what
            trace.add(rank, stream, kind, start, end, label, nbytes=nbytes, **args)
    return trace


@dataclass(frozen=True)
class PipelineResult:
    """Outcome of ``simulate_pipeline``: the simulated face of ``pipeline_time``."""

    step_time_s: float
    bubble_fraction: float
    in_flight: tuple[int, ...]  # peak (micro-batch, chunk) activations held, per stage
    spans: list = field(repr=False, compare=False)

    @cached_property
    def trace(self) -> Trace:
        return build_trace(self.spans, False)


def simulate_pipeline(p: int, m: int, t_f: float, t_b: float, *, schedule: str = "1f1b",
                      v: int = 1, p2p_s: float = 0.0) -> PipelineResult:
    """Run a pipeline schedule on ``p`` uniform stages: each stage's forward of one micro-batch
    takes ``t_f`` and its backward ``t_b`` (split evenly over ``v`` chunks when interleaved),
    every point-to-point message ``p2p_s``.  With ``p2p_s = 0`` GPipe and 1F1B take
    ``pipeline_time(p, m, t_f, t_b)``."""
    chunk = ChunkCost(t_f / v, t_b / v, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    links = {(a, b): p2p_s for a in range(p) for b in range(p)}
    spans: list = []
    stats = run_pipeline(schedule, p, m, v, [chunk] * (p * v), links, spans)
    end = max(st["last"] for st in stats)
    bubble = sum(1.0 - st["busy"] / end for st in stats) / p
    return PipelineResult(end, bubble, tuple(st["in_flight"] for st in stats), spans)


