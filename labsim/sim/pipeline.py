"""The pipeline engine: stages as simpy processes executing schedules given as data.

``run_pipeline`` executes the per-stage op lists of ``labsim.pipeline`` on ``p``
stages whose ops last what a ``ChunkCost`` says: an op waits for its input message (the
activation from the previous model chunk, or the gradient from the next), then computes, then
sends its output point to point; messages on one link direction go one at a time.  A message's
arrival time is known when it is sent, so a stage runs ahead on its own clock while its inputs
are known and blocks (a simpy event) only on a message not sent yet: the cost of a run is
O(ops) with few events.

``simulate_pipeline`` is the simulated face of ``pipeline_time`` (uniform stages).  A whole
training step runs in ``labsim.sim.step``, whose engine executes the same op lists with every
byte on the shared network; ``balanced_ends`` runs Llama 3 405B's published pipeline there,
the embedding and the loss counted as layers, beside the same pipeline split evenly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import simpy

from labsim.pipeline import Op, group_problems, in_flight_peak, make_schedule, max_in_flight
from labsim.published import runs
from labsim.sim.step import simulate_step
from labsim.trace import Span, Trace


@dataclass(slots=True)
class OpSpan:
    """A forward, backward, recompute, TP/ZeRO communication or send of one pipeline op:
    ``op`` ("F" or "B") of micro-batch ``microbatch`` on model chunk ``chunk``.  Built raw
    (no label) while simulating; ``to_span`` makes the ``Trace`` span when one is asked for."""

    rank: int
    stream: str
    kind: str
    start_s: float
    end_s: float
    op: str
    microbatch: int
    chunk: int

    def to_span(self, chunked: bool) -> Span:
        label = f"{self.op}{self.microbatch}" + (f" chunk {self.chunk}" if chunked else "")
        if self.kind == "send":
            label = f"send {label}"
        elif self.kind == "comm":
            label = f"{label} TP/ZeRO"
        return Span(self.rank, self.stream, self.kind, self.start_s, self.end_s, label)


@dataclass(slots=True)
class CommSpan:
    """A gradient-reduction, parameter-gather or optimizer span of a step (not tied to one
    pipeline op): ``label``, the payload ``nbytes`` and extra trace ``args``."""

    rank: int
    stream: str
    kind: str
    start_s: float
    end_s: float
    label: str
    nbytes: float = 0.0
    args: dict = field(default_factory=dict)

    def to_span(self, chunked: bool) -> Span:
        return Span(self.rank, self.stream, self.kind, self.start_s, self.end_s, self.label,
                    self.nbytes, dict(self.args))


RawSpan = OpSpan | CommSpan


@dataclass(slots=True)
class StageStats:
    """What one pipeline stage did in a run: compute-stream busy seconds, its first start and
    last end, the (start, end) of each model chunk's last backward (its gradients are final
    then) and the peak number of (micro-batch, chunk) activations it held."""

    busy_s: float = 0.0
    first_s: float = 0.0
    last_s: float = 0.0
    last_backward: dict[int, tuple[float, float]] = field(default_factory=dict)
    in_flight: int = 0


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


def run_pipeline(schedule_name: str, p: int, m: int, v: int, chunks: list[ChunkCost],
                 p2p: dict[tuple[int, int], float], spans: list[RawSpan]) -> list[StageStats]:
    """Execute the schedule with simpy, appending an ``OpSpan`` per op and message to
    ``spans``; ``p2p[(a, b)]`` is the seconds of one message from stage a to b."""
    n_chunks = p * v
    schedule = make_schedule(schedule_name, p, m, v)
    env = simpy.Environment()
    timeout, event = env.timeout, env.event
    arrivals: dict[tuple, simpy.Event] = {}
    link_free: dict[tuple[int, int], float] = {}
    record = spans.append
    stats = [StageStats() for _ in range(p)]

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
        record(OpSpan(src, "p2p", "send", start, end, *key))
        waiting = arrivals.get(key)
        if waiting is None:
            arrivals[key] = end
        else:  # the receiver is blocked on this message: wake it when it arrives
            timeout(end - env.now).callbacks.append(lambda _e, w=waiting: w.succeed())

    def stage(s: int, ops: tuple[Op, ...]):
        busy = 0.0
        t = 0.0  # this stage's clock: when it is free for its next op
        first = None
        last_bwd = stats[s].last_backward
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
                record(OpSpan(s, "compute", "forward", start, start + work, kind, mb, g))
            else:
                if c.t_rec > 0:
                    record(OpSpan(s, "compute", "recompute", start, start + c.t_rec, kind, mb, g))
                record(OpSpan(s, "compute", "backward", start + c.t_rec, start + work, kind, mb,
                              g))
                last_bwd[g] = (start, end)
            if comm > 0:
                record(OpSpan(s, "compute", "comm", start + work, end, kind, mb, g))
            if forward:
                if g < n_chunks - 1:
                    send(("F", mb, g + 1), s, (g + 1) % p, end)
            elif g > 0:
                send(("B", mb, g - 1), s, (g - 1) % p, end)
        st = stats[s]
        st.busy_s, st.first_s, st.last_s = busy, first or 0.0, t

    for s in range(p):
        env.process(stage(s, schedule[s]))
    env.run()
    for s in range(p):
        stats[s].in_flight = max_in_flight(schedule[s])
    return stats


def time_by_kind(spans: list[RawSpan], rank: int) -> dict[str, float]:
    """Seconds per span kind on ``rank`` (what ``Trace.time_by_kind`` gives, without the
    trace)."""
    totals: dict[str, float] = {}
    for sp in spans:
        if sp.rank == rank:
            totals[sp.kind] = totals.get(sp.kind, 0.0) + sp.end_s - sp.start_s
    return totals


def build_trace(spans: list[RawSpan], chunked: bool) -> Trace:
    """Turn the raw spans of a run into a ``Trace`` (built only when asked for)."""
    return Trace((sp.to_span(chunked) for sp in spans), detail="op", rank_label="pipeline stage")


@dataclass(frozen=True)
class PipelineResult:
    """Outcome of ``simulate_pipeline``: the simulated face of ``pipeline_time``."""

    step_time_s: float
    bubble_fraction: float
    in_flight: tuple[int, ...]  # peak (micro-batch, chunk) activations held, per stage
    spans: list[RawSpan] = field(repr=False, compare=False)

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
    spans: list[RawSpan] = []
    stats = run_pipeline(schedule, p, m, v, [chunk] * (p * v), links, spans)
    end = max(st.last_s for st in stats)
    bubble = sum(1.0 - st.busy_s / end for st in stats) / p
    return PipelineResult(end, bubble, tuple(st.in_flight for st in stats), spans)


@dataclass(frozen=True)
class EndsRow:
    """One way to place a model's layers on a pipeline's chunks, simulated: the layers of each
    model chunk, the busiest stage's compute for one micro-batch (forward and backward of its
    chunks), the step, its bubble, the model FLOPs of the step (all GPUs) and the first
    stage's memory."""

    label: str
    chunk_layers: tuple[int, ...]
    busiest_stage_s: float
    step_s: float
    bubble: float
    model_flops: float
    memory_bytes: float
    fits: bool


def balanced_ends(run_id: str = "meta2024_llama3_405b_8192gpu") -> tuple[float, EndsRow, EndsRow]:
    """Llama 3 405B's pipeline balancing (Llama Team 2024, section 3.3.2: "we reduce one
    Transformer layer each from the first and the last stages", so the first chunk holds only
    the embedding and the last only the output layer and loss): the published run of
    ``labsim.published`` as laid out (126 layers, the embedding and the loss counted as a
    layer each: 16 stages of 8 one-layer chunks) and the same pipeline with 128 layers split
    evenly, the output layer and loss on top of the last stage's 8.  Returns (the measured
    step in seconds, the published layout, the even split)."""
    run = next((r for r in runs() if r.id == run_id), None)
    if run is None or not run.plan.account_for_embedding_in_pipeline_split:
        raise ValueError(f"run_id={run_id!r}: choose a published run whose plan counts the "
                         "embedding as a layer, e.g. 'meta2024_llama3_405b_8192gpu'")
    model, cluster, plan = run.model, run.cluster, run.plan
    split = plan.chunk_layers(model.layers)
    layers = len(split) * max(split)  # the slots the split counts, each a layer
    even = (replace(model, layers=layers),
            replace(plan, account_for_embedding_in_pipeline_split=False,
                    account_for_loss_in_pipeline_split=False))
    rows = []
    for label, (m, p) in (("published: embedding, loss as layers", (model, plan)),
                          (f"{layers} layers split evenly", even)):
        r = simulate_step(m, cluster, p)
        c = r.costs
        busiest = max(sum(ch.t_fwd + ch.t_bwd + ch.t_rec for ch in c.chunks[s::p.pp])
                      for s in range(p.pp))
        rows.append(EndsRow(label, p.chunk_layers(m.layers), busiest, r.step_time_s,
                            r.bubble_fraction, c.flops[0], r.peak_memory_bytes, r.fits))
    return run.measured_step_s(), rows[0], rows[1]


@dataclass(frozen=True)
class GroupRow:
    """One micro-batch group of an interleaved run, simulated: the group N (the micro-batches
    a stage runs through one chunk in a row), the step, its bubble, the first stage's peak
    of (micro-batch, chunk) activations in layers' worth, and its memory."""

    group: int
    step_s: float
    bubble: float
    layers_in_flight: float
    memory_bytes: float
    fits: bool


def group_trade(run_id: str = "meta2024_llama3_405b_8192gpu") -> tuple[GroupRow, ...]:
    """Llama 3 405B's tunable schedule (Llama Team 2024, section 3.3.2: N micro-batches a
    stage runs through one chunk in a row, "a sweet spot between DFS and BFS for the best
    communication and memory efficiency"): the published run of ``labsim.published`` under
    every group Megatron-Core accepts (``Plan.microbatch_group``, p to m), smallest first."""
    run = next((r for r in runs() if r.id == run_id), None)
    if run is None or run.plan.schedule != "interleaved":
        raise ValueError(f"run_id={run_id!r}: choose a published run with an interleaved "
                         "schedule, e.g. 'meta2024_llama3_405b_8192gpu'")
    model, cluster, plan = run.model, run.cluster, run.plan
    p, m, v = plan.pp, plan.microbatches, plan.virtual_stages
    first = plan.chunk_layers(model.layers)[0::p]
    rows = []
    for n in range(p, m + 1):
        if group_problems(p, m, n):
            continue
        r = simulate_step(model, cluster, replace(plan, microbatch_group=n))
        rows.append(GroupRow(n, r.step_time_s, r.bubble_fraction,
                             in_flight_peak("interleaved", p, m, v, first, group=n),
                             r.peak_memory_bytes, r.fits))
    return tuple(rows)
