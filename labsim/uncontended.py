"""A training step evaluated exactly without events, when nothing it moves contends.

``alone_schedule`` runs a step's op lists (``labsim.pipeline``) in schedule order with every
flow at its rate alone (``labsim.network.FoldedNetwork``): an op starts at max(stage free,
input arrival), gradient buckets stream as backward produces them, then the optimizer and
ZeRO-1/2's parameter all-gather.  That is exactly what the event engine
(``labsim.sim.step``) computes whenever no two flows move bytes on one pipe at the same time;
``check=True`` finds out and answers None when some do, so ``simulate_step`` runs the events
only for steps that need them, and ``estimate_step`` uses the same evaluation as its fast
path, with the one meeting it prices there (an op's TP bytes beside the gradient buckets
its stage is reducing, ``_beside_stream``) as two fluids.  ``zero3_fluid`` replays a ZeRO-3
step the same way, its gather and reduce streams as two fluids: exactly what the engine
computes when the step has no TP collectives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np

from labsim.network import shared_fractions, shared_growth
from labsim.pipeline import Op, Schedule

if TYPE_CHECKING:  # annotations only: labsim.step imports this module
    from labsim.network import Placed
    from labsim.step import StepCosts


def op_terms(work: float, tp: Placed | None, calls: int, hidden: float
             ) -> tuple[float, float]:
    """An op alone as the two spans the event engine runs in turn: its compute (beside the
    ``hidden`` share of its tensor-parallel collectives), then the rest of them."""
    if tp is None or not calls or not tp.pipes:
        return work, 0.0
    alone = tp.alone_s * calls
    return (max(work, hidden * alone), (1 - hidden) * alone) if hidden else (work, alone)


def op_time(work: float, tp: Placed | None, calls: int, hidden: float) -> float:
    """An op alone: compute plus its tensor-parallel collectives (blocking or overlapped)."""
    busy, tail = op_terms(work, tp, calls, hidden)
    return busy + tail


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
        for pl in (c.param_gather[s_], c.embedding_allreduce[s_]):
            for x in (pl.pipes if pl is not None else ()):
                users.setdefault(x, set()).add(("dp", s_))
        for g in range(s_, p * c.plan.virtual_stages, p):
            tp = c.chunks[g].tp
            for x in (tp.pipes if tp is not None else ()):
                users.setdefault(x, set()).add(("compute", s_))
    return {x for x, u in users.items() if len(u) > 1}


def bucket_growth(c: StepCosts, chunks: Iterable[int] | None = None
                  ) -> dict[int, tuple[float, float]]:
    """Chunk -> (TP growth, bucket growth): how much longer a backward op's TP collectives
    and its gradient buckets take while both move (``shared_growth``), for every chunk (of
    ``chunks``, default all) that has both on shared pipes; what ``alone_schedule``'s closed
    form prices them with."""
    # priced once per pair of costs: both collectives are on the chunk's stage, laid on its
    # pipes by their costs (``FoldedNetwork.place``); and once per kind of pair, the growth
    # being the two flows' loads and caps on which pipes they share (ports and NICs have
    # one capacity each)
    growth: dict[int, tuple[float, float]] = {}
    by_costs: dict[tuple[int, int], tuple[float, float]] = {}
    by_kind: dict[tuple, tuple[float, float]] = {}
    ports = 2 * c.plan.pp  # pipes below are ports
    for g in range(len(c.buckets)) if chunks is None else chunks:
        bucket, n_buckets = c.buckets[g]
        tp = c.chunks[g].tp
        if bucket is not None and n_buckets and tp is not None and tp.pipes:
            costs = id(tp.cost), id(bucket.cost)
            if costs not in by_costs:
                b_pipes = bucket.pipes
                kind = (tp.loads, tp.cap_Bps, bucket.loads, bucket.cap_Bps,
                        tuple(x < ports for x in tp.pipes + b_pipes),
                        tuple(b_pipes.index(x) if x in b_pipes else -1 for x in tp.pipes))
                if kind not in by_kind:
                    by_kind[kind] = shared_growth(tp, bucket, c.capacity)
                by_costs[costs] = by_kind[kind]
            if any(by_costs[costs]):
                growth[g] = by_costs[costs]
    return growth


def alone_schedule(c: StepCosts, schedule: Schedule, check: bool = False,
                   trace: bool = True, growth: dict[int, tuple[float, float]] | None = None,
                   scratch: dict | None = None) -> AloneRun | None:
    """A step's ops in schedule order with every flow at its rate alone (no simpy): start at
    max(stage free, input arrival); buckets on a stream as backward produces them; then the
    optimizer and ZeRO-1/2's parameter all-gather.  Exactly what ``labsim.simulate_step``
    computes whenever no two flows move bytes on one pipe at the same time; with ``check``
    it returns None when some do (the caller then simulates the network).  ``trace=False``
    leaves ``spans`` empty (the closed form needs the times only) and is the closed form's
    evaluation: there each stage's buckets are a stream carried from op to op (``_Stream``),
    and an op whose TP collectives share pipes with the buckets queued or moving (its own,
    or ones from before it) moves beside them as fluids would (``shared_growth``): its TP
    collectives (a hidden share from the op's start, the rest after its compute) at their
    shared rate while a bucket moves, and each bucket at its shared rate while they do, by
    ``growth`` (``bucket_growth(c)``, computed when not given).  ``scratch``: a dict the
    caller keeps between evaluations of one ``c``'s schedules, where the op tables and the
    meetings priced from an idle stream are built once and kept."""
    plan = c.plan
    p, m = plan.pp, plan.microbatches
    n_chunks = p * plan.virtual_stages
    zero2 = plan.zero_stage == 2
    h = c.tp_hidden
    blocking = c.software.blocking_p2p
    spans: list[tuple] = []
    record = spans.append
    watch = _contended(c) if check else set()
    moving: dict[int, list[tuple[float, float]]] = {x: [] for x in watch}
    overlap = plan.overlap_grad_reduce
    clock = [0.0] * p
    index = [0] * p
    # arrival[kind, chunk][mb]: when micro-batch mb's input of that op reaches its stage
    kept = scratch.get("arrival") if scratch is not None else None
    if kept is not None and len(kept["F", 0]) >= m:
        arrival, tables, beside = kept, scratch["tables"], scratch["beside"]
        nones = [None] * m
        for inbox in arrival.values():
            inbox[:m] = nones
    else:
        arrival = {(kind, g): [None] * m for kind in "FB" for g in range(n_chunks)}
        tables = _op_tables(c, arrival)
        # an op beside its buckets from an idle stream, from 0 (``_buckets_of_op``)
        beside: dict[tuple, tuple] = {}
        if scratch is not None:
            scratch.update(arrival=arrival, tables=tables, beside=beside)
    pending: list[list[tuple]] = [[] for _ in range(p)]  # buckets: (ready, bucket, k, g)
    bare = not (check or trace)
    streams = [_Stream() for _ in range(p)]  # with ``bare``, each stage's bucket stream
    fluid = bare and overlap  # buckets beside TP bytes as fluids
    times: list[list[float]] = [[] for _ in range(p)]  # start, end of every op
    if not (bare and overlap):
        growth = {}
    elif growth is None:
        growth = bucket_growth(c)
    last_b = [_last_backwards(ops, plan.virtual_stages) for ops in schedule]
    remaining = sum(len(o) for o in schedule)
    keep = check or trace  # every op's (start, end): the overlap check and the trace use them
    began_sum, ended_sum = [0.0] * p, [0.0] * p  # sums of the ops' starts and ends, by stage
    # stages visited up and down in turn: a forward's input comes from the stage before, a
    # backward's from the stage after (any order gives the same times)
    sweeps = (range(p), range(p - 1, -1, -1))
    sweep = 0
    while remaining:
        advanced = False
        sweep ^= 1
        for s in sweeps[sweep]:
            ops, i = schedule[s], index[s]
            n = len(ops)
            if i == n:
                continue
            t, table, times_s, last_s = clock[s], tables[s], times[s], last_b[s]
            stream = streams[s]
            start_i, began, ended = i, began_sum[s], ended_sum[s]
            while i < n:
                kind, mb, local = ops[i]
                fwd, g, inbox, work, tp, calls, busy_s, tail_s, outbox, send_s = table[kind][local]
                if inbox is not None:
                    a = inbox[mb]
                    if a is None:
                        break
                    if a > t:
                        t = a
                start = t
                end = start + busy_s + tail_s
                if not fwd and overlap and (zero2 or last_s[local] == i):
                    bucket, n_buckets = c.buckets[g]
                    planned = end - start if tp is not None and h else busy_s + tail_s
                    if not bare:
                        for k in range(n_buckets):
                            pending[s].append((start + planned * (k + 1) / n_buckets, bucket,
                                               k, g))
                    elif n_buckets:
                        shared = growth.get(g, (0.0, 0.0))
                        if stream.jobs or (shared[0] and tp is not None):
                            end = _buckets_of_op(stream, start, end, work, h, tp, calls,
                                                 bucket, n_buckets, planned, shared, beside)
                        else:  # no TP bytes meet these buckets: the stream's end only
                            free, tau = stream.free, bucket.alone_s
                            for k in range(n_buckets):
                                ready = start + planned * (k + 1) / n_buckets
                                free = (free if free > ready else ready) + tau
                            stream.free = free
                elif fluid and tp is not None and stream.jobs and stream.shares():
                    # the TP bytes of an op that reduces nothing meet buckets still queued or
                    # moving (ZeRO-2's from the micro-batch before, another chunk's), unless
                    # those are done before the TP bytes first move
                    tp_latency = tp.latency_s * calls
                    if stream.end() > start + (h * tp_latency if h else work + tp_latency):
                        end = _beside_stream(stream, start, work, h, tp_latency,
                                             (tp.alone_s - tp.latency_s) * calls)
                began += start
                ended += end
                if keep:
                    times_s.append(start)
                    times_s.append(end)
                t = end
                if outbox is not None:
                    if send_s is None:
                        outbox[mb] = end
                    else:
                        arrive = outbox[mb] = end + send_s
                        if blocking:
                            t = arrive
                i += 1
            if i > start_i:
                remaining -= i - start_i
                began_sum[s], ended_sum[s] = began, ended
                advanced = True
            index[s], clock[s] = i, t
        if not advanced:
            raise ValueError("the schedule deadlocks: an op waits for a message never sent")
    busy = [b - a for a, b in zip(began_sum, ended_sum)]
    compute_end = max(clock)
    ends = []
    for s in range(p):
        queue = pending[s]
        if not overlap:
            queue = [(clock[s], b, k, g)
                     for g in range(s, n_chunks, p) for b, n in [c.buckets[g]]
                     if b is not None for k in range(n * (m if zero2 else 1))]
        free = streams[s].end()
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
        t = max(clock[s], free)
        tied = c.embedding_allreduce[s]
        if tied is not None:
            if check:
                _mark(moving, tied, t + tied.latency_s, t + tied.alone_s)
            if trace:
                record((s, "dp", "comm", t, t + tied.alone_s, "allreduce tied embedding",
                        tied.nbytes))
            t += tied.alone_s
        t += c.optimizer_s[s]
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


class _Stream:
    """A stage's gradient buckets in the closed form, reduced in order: each from the later
    of its ready time and the end of the one before, then its latency, then its bytes.
    ``jobs``: the buckets not done, each (ready, latency, seconds alone, growth of the
    stage's TP bytes and of its own bytes while both move: ``shared_growth``); the first
    has begun once ``at`` (when its bytes start) is set, with ``left`` seconds of its bytes
    alone to go as of ``t``; ``free``: the end of the last one done."""

    __slots__ = ("t", "free", "jobs", "at", "left")

    def __init__(self) -> None:
        self.t = self.free = self.left = 0.0
        self.jobs: deque[tuple[float, float, float, float, float]] = deque()
        self.at: float | None = None

    def shares(self) -> bool:
        """Whether the stage's TP bytes slow a bucket queued (the first or the last)."""
        return bool(self.jobs[0][3] or self.jobs[-1][3])

    def begin(self) -> None:
        """The first job starts: its latency from the later of its ready time and ``free``."""
        ready, latency, tau, _, _ = self.jobs[0]
        self.at = (ready if ready > self.free else self.free) + latency
        self.left = tau - latency

    def end(self) -> float:
        """When the stream is done, every job left moving alone from ``t``."""
        free = self.free
        rest = iter(self.jobs)
        if self.at is not None:  # the first has begun
            next(rest)
            free = (self.at if self.at > self.t else self.t) + self.left
        for ready, _, tau, _, _ in rest:
            free = (free if free > ready else ready) + tau
        return free


def _beside_stream(st: _Stream, start: float, work: float, hidden: float, tp_latency: float,
                   tp_moving: float) -> float:
    """End of an op whose TP bytes share pipes with the stage's bucket stream ``st`` (which
    it advances to that end): the event engine's two flows as fluids.

    The op starts at ``start`` and computes ``work`` s; its TP collectives wait
    ``tp_latency`` s in all and move bytes for ``tp_moving`` s alone, a ``hidden`` share of
    each from the op's start and the rest after the compute (and after that share).  Each
    bucket starts at the later of its ready time and the end of the one before, waits its
    latency, then moves its bytes.  While both move, each takes ``1 + g`` times as long
    (the bucket's growths)."""
    h, jobs, inf = hidden, st.jobs, float("inf")
    seg_at, seg_left = ((start + h * tp_latency, h * tp_moving) if h
                        else (start + work + tp_latency, tp_moving))
    first = bool(h)  # moving the hidden share
    if jobs and st.at is None:
        st.begin()
    t, at, left = st.t, st.at, st.left
    tp_shared = b_shared = 1.0  # the head bucket's rates while both move
    if jobs:
        tp_shared, b_shared = 1 / (1 + jobs[0][3]), 1 / (1 + jobs[0][4])
    while True:
        b_on = bool(jobs) and t >= at
        tp_on = t >= seg_at
        tp_rate, b_rate = (tp_shared, b_shared) if tp_on and b_on else (1.0, 1.0)
        t_tp = t + seg_left / tp_rate if tp_on else seg_at
        t_b = (t + left / b_rate if b_on else at) if jobs else inf
        t_next = min(t_tp, t_b)
        if tp_on:
            seg_left = 0.0 if t_next == t_tp else seg_left - (t_next - t) * tp_rate
        if b_on:
            left = 0.0 if t_next == t_b else left - (t_next - t) * b_rate
        t = t_next
        if b_on and t == t_b:  # a bucket done: the next one starts
            st.free = t
            jobs.popleft()
            if jobs:
                st.begin()
                at, left = st.at, st.left
                tp_shared, b_shared = 1 / (1 + jobs[0][3]), 1 / (1 + jobs[0][4])
        if tp_on and t == t_tp:
            if not first:
                break
            first = False
            seg_at = max(start + work, t) + (1 - h) * tp_latency
            seg_left = (1 - h) * tp_moving
    st.t = t
    st.at, st.left = (at, left) if jobs else (None, 0.0)
    return t


def _buckets_of_op(st: _Stream, start: float, end: float, work: float, hidden: float,
                   tp: Placed | None, calls: int, bucket: Placed, n_buckets: int,
                   planned: float, growth: tuple[float, float], beside: dict) -> float:
    """A backward op that reduces ``n_buckets`` gradient buckets, ready evenly over its
    ``planned`` seconds: they join the stage's stream ``st`` (which has buckets queued, or
    whose buckets the stage's TP bytes slow: ``growth``), and the op's end (``end`` alone)
    is priced beside the stream when its TP bytes share pipes with the buckets.  An op that
    finds the stream idle by its first bucket meets it alike whenever it starts: that
    meeting is priced once from 0 (``beside``, by the op's inputs) and shifted."""
    jobs = st.jobs
    if not jobs and tp is not None:
        key = (id(tp.cost), calls, work, planned, id(bucket.cost), n_buckets)
        known = beside.get(key)
        if known is None:  # the same op at 0, its buckets ready at the same offsets
            spec = bucket.latency_s, bucket.alone_s, *growth
            offsets = [planned * (k + 1) / n_buckets for k in range(n_buckets)]
            origin = _Stream()
            origin.jobs.extend([(x, *spec) for x in offsets])
            after = _beside_stream(origin, 0.0, work, hidden, tp.latency_s * calls,
                                   (tp.alone_s - tp.latency_s) * calls)
            known = beside[key] = (offsets[0], after, origin.free, origin.at, origin.left,
                                   [(x, *spec) for x in offsets[n_buckets - len(origin.jobs):]],
                                   n_buckets > len(origin.jobs))
        first, after, free, at, left, rest, done = known  # the op's end and the stream, from 0
        if st.free <= start + first:  # idle by the op's first bucket: shifted
            jobs.extend([(start + x, *job) for x, *job in rest])
            st.t = start + after
            if done:
                st.free = start + free
            st.at, st.left = (None, 0.0) if at is None else (start + at, left)
            return st.t
    spec = bucket.latency_s, bucket.alone_s, *growth
    jobs.extend([(start + planned * (k + 1) / n_buckets, *spec) for k in range(n_buckets)])
    if tp is None or not st.shares():
        return end
    return _beside_stream(st, start, work, hidden, tp.latency_s * calls,
                          (tp.alone_s - tp.latency_s) * calls)


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


def _op_tables(c: StepCosts, arrival: dict[tuple[str, int], list]
               ) -> list[dict[str, list[tuple]]]:
    """Each stage's ops by kind, then local chunk: whether a forward, the model chunk, where its
    input arrives (None: it needs none), compute seconds, its TP collective and their count,
    its seconds alone as the two terms the event engine adds (compute, or compute beside the
    hidden share of the TP collectives; then the rest of them), where its output
    goes (None: nowhere) and the seconds alone of the send that carries it (None: same
    stage).
    An inbox or outbox is the list, by micro-batch, of one chunk's arrivals of one kind."""

    p, v, h = c.plan.pp, c.plan.virtual_stages, c.tp_hidden
    n_chunks = p * v
    tables = []
    for s in range(p):
        table: dict[str, list[tuple]] = {}
        for kind in "FB":
            table[kind] = by_chunk = []
            fwd = kind == "F"
            for local in range(v):
                g = local * p + s
                ch = c.chunks[g]
                work, calls = (ch.t_fwd, ch.tp_fwd) if fwd else (ch.t_rec + ch.t_bwd,
                                                                 ch.tp_bwd)
                tp = ch.tp if ch.tp is not None and calls and ch.tp.pipes else None
                busy_s, tail_s = op_terms(work, tp, calls, h)
                nxt = g + 1 if fwd else g - 1
                out = 0 <= nxt < n_chunks
                send = c.p2p.get((s, nxt % p)) if out else None
                need = g > 0 if fwd else g < n_chunks - 1
                by_chunk.append((fwd, g, arrival[kind, g] if need else None, work, tp, calls,
                                 busy_s, tail_s, arrival[kind, nxt] if out else None,
                                 send.alone_s if out and send is not None else None))
        tables.append(table)
    return tables


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
    h = c.tp_hidden
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


def zero3_tp_flows(c: StepCosts) -> int:
    """TP flows a micro-batch of ZeRO-3 moves beside its gather and reduce streams in
    ``zero3_fluid`` (each layer's TP collectives, forward and backward: one flow blocking,
    two overlapped), or 0 where they share no pipe with the streams and are priced alone."""
    tp, layers = c.chunks[0].tp, c.chunks[0].layers
    if c.zero3_gather is None or tp is None or not set(tp.pipes) & {
            x for z in (c.zero3_gather, c.zero3_reduce) for x in z.pipes}:
        return 0
    segments = 2 if c.tp_hidden else 1
    return layers * segments * (bool(c.chunks[0].tp_fwd) + bool(c.chunks[0].tp_bwd))


def zero3_fluid(c: StepCosts, ops: tuple[Op, ...], memo: dict | None = None
                ) -> tuple[float, float, list[float]]:
    """A ZeRO-3 stage's ``ops`` (pp = 1) replayed as ``labsim.sim.step`` runs them, with the
    gather stream's and the reduce stream's bytes as two fluids: each unit waits its latency
    (and the profile's host seconds) and then moves its bytes at its rate alone, or at its
    shared rate (``shared_growth``) while a unit of the other stream moves.  Per op: the
    gathers of every layer queue on the gather stream (layer j's not before layer
    j - prefetch - 1 is done), each layer's compute waits for its gather, a backward layer's
    reduce queues on the reduce stream when it is done; a profile's gathers that synchronise
    (``zero3_gather_syncs``) wait until the reduce stream is idle.  A layer's TP collectives
    are a third fluid where they share pipes with the streams, as the engine runs them:
    blocking, after the compute and their latencies; overlapped, a hidden share beside the
    compute and the rest after it.  A backward that starts with nothing moving or queued
    runs as every such backward does, shifted, and so does the k-th backward straight after
    it (each starts with what the one before left on the reduce stream, and its own gathers
    queue only when it starts); forwards alike where TP bytes make them events: the first
    of each is replayed and kept (in ``memo``, which a caller may share between replays of
    one ``c``), the others are taken from it, with the reduce stream as it was at its end.
    Returns (end of both streams, end of the last compute, each op's end)."""

    plan = c.plan
    ch = c.chunks[0]
    layers, k = ch.layers, plan.zero3_prefetch
    counts_f, counts_b = c.zero3_gathers
    extra_g, extra_r = c.zero3_extra
    per_layer_s, embed_s = c.zero3_gather_extra_s
    inf = float("inf")
    syncs = c.software.zero3_gather_syncs

    def job(layer: int, gate: int, count: int, placed: Placed | None,
            extra_s: float = 0.0) -> tuple:
        """(layer or -1, layer of the gate or -1, units, latency, bytes' time alone,
        collective) of one job on a stream; with its op in front, a queued job."""
        if placed is None or not count:
            return layer, gate, 0, 0.0, 0.0, None
        return (layer, gate, count, extra_s + placed.latency_s,
                placed.alone_s - placed.latency_s, placed)

    tp, hidden = ch.tp, c.tp_hidden
    compute = {"F": (ch.t_fwd - ch.head_fwd) / layers,  # a layer's, without its TP
               "B": (ch.t_bwd - ch.head_bwd + ch.t_rec) / layers}
    calls = {"F": ch.tp_fwd // layers, "B": ch.tp_bwd // layers}
    work = {kind: op_time(compute[kind], tp, calls[kind], hidden) for kind in "FB"}
    # the backward's first layer computes the head's backward too, before or beside its TP
    head_b = op_time(compute["B"] + ch.head_bwd, tp, calls["B"], hidden)
    # TP collectives that share pipes with the streams: after their latencies
    # (``tp_wait``), their bytes (``tp_bytes``, s alone) as a fluid
    tp_fluid = zero3_tp_flows(c) > 0
    if tp_fluid:
        tp_wait = {kind: tp.latency_s * n for kind, n in calls.items()}
        tp_bytes = {kind: (tp.alone_s - tp.latency_s) * n for kind, n in calls.items()}
        shares: dict[tuple, tuple[float, ...]] = {}  # moving flows -> shared / alone rate
    # a layer's stage (0 none; 1 its compute, beside its hidden TP share; 2 the rest's
    # latency; 3 its bytes) and its TP flow (phase 1 latency until ``tp_until``, 2 moving
    # ``tp_left`` s of bytes alone)
    stage = tp_phase = 0
    tp_until = tp_left = 0.0
    gathered = [[inf] * layers for _ in ops]
    finished = [[inf] * layers for _ in ops]
    growth: dict[tuple[int, int], tuple[float, float]] = {}
    # stream 0 gathers, 1 reduces: FIFO jobs; the current job, its units to go; phase 0
    # idle, 1 waiting out a latency until ``until``, 2 moving ``left`` s of bytes alone
    jobs: tuple[list, list] = ([], [])
    head, units = [0, 0], [0, 0]
    current: list = [None, None]
    phase, until, left = [0, 0], [0.0, 0.0], [0.0, 0.0]
    op_ends: list[float] = []
    kinds = [o[0] for o in ops]
    n_ops = len(ops)

    # an op's gathers, in order: the embedding's (forward), then every layer's
    gathers = {"F": [job(-1, -1, 1, extra_g, embed_s)], "B": []}
    for kind, counts in (("F", counts_f), ("B", counts_b[::-1])):
        gathers[kind] += [job(j, j - k - 1, counts[j], c.zero3_gather, per_layer_s)
                          for j in range(layers)]

    def start_op(i: int) -> None:
        jobs[0].extend([(i, *x) for x in gathers[kinds[i]]])

    def finish_forward(t: float, i: int, layer: int, end: float) -> float:
        """End of forward op ``i`` whose gathers not yet taken are the gather stream's queue,
        the stream idle at ``t`` and no reduction queued or moving; its compute has finished
        up to ``layer`` (exclusive) by ``end`` (<= t, or later: that layer's end).  What the
        loop below computes for the rest of the op, without its events: no reduction comes
        while a forward runs, so each gather goes in one go, after the previous one and its
        gate, and each layer computes after its gather and the previous layer."""
        fin, got = finished[i], gathered[i]
        free, queue = t, jobs[0]
        for n in range(head[0], len(queue)):
            _, j, gate, count, latency, moving, _ = queue[n]
            while layer <= gate:
                end = fin[layer] = (end if end > got[layer] else got[layer]) + work["F"]
                layer += 1
            if gate >= 0 and fin[gate] > free:
                free = fin[gate]
            free = free + count * (latency + moving)
            if j >= 0:
                got[j] = free
        head[0] = len(queue)
        while layer < layers:
            end = fin[layer] = (end if end > got[layer] else got[layer]) + work["F"]
            layer += 1
        return end + ch.head_fwd if ch.head_fwd else end

    t, op, layer = 0.0, 0, 0
    busy_until = inf  # the current layer's (or the head's) compute ends
    computing = False
    started = -1  # the last op whose gathers are queued
    reduce_job = (0, *job(-1, -1, c.zero3_units, c.zero3_reduce))
    # ops of one kind in a row from one that started with nothing moving or queued (a
    # forward only where TP bytes make it events): (kind, the current op's place in the row,
    # the row's start); what the k-th did, by ``memo``[kind, k]: (its end, and the reduce
    # stream then: phase, latency's end, bytes left, units left, current job, jobs queued;
    # times from the row's start)
    kept = memo if memo is not None else {}
    row: tuple[str, int, float] | None = None
    while True:
        changed = True
        while changed:  # every transition due at time t
            changed = False
            while op < n_ops:  # the compute: every layer that can start and end at t
                kind = kinds[op]
                if started < op:  # the op starts
                    if (kind == "F" and not tp_fluid) or computing or stage or tp_phase or \
                            phase[0] or current[0] is not None or head[0] < len(jobs[0]):
                        row = None
                    elif not phase[1] and current[1] is None and head[1] == len(jobs[1]):
                        row = (kind, 0, t)  # nothing moving or queued
                    elif row is not None and row[0] == kind == kinds[op - 1]:
                        row = (kind, row[1] + 1, row[2])
                    else:
                        row = None
                    known = kept.get(row[:2]) if row is not None else None
                    if known is not None:  # as the one kept, shifted
                        end, phase[1], until_s, left[1], units[1], current[1], rest = known
                        until[1] = row[2] + until_s
                        head[1] = len(jobs[1])
                        jobs[1].extend(rest)
                        t = row[2] + end
                        started, changed = op, True
                        op_ends.append(t)
                        op, layer = op + 1, 0
                        continue
                    start_op(op)
                    started = op
                if kind == "F" and phase[0] == phase[1] == 0 and head[1] == len(jobs[1]) \
                        and layer < layers and not tp_fluid:
                    # no reduction about: nothing else moves before the forward ends
                    if computing:
                        end, layer = busy_until, layer + 1
                        finished[op][layer - 1] = end
                    else:
                        end = t
                    t = finish_forward(t, op, layer, end)
                    computing = False
                    op_ends.append(t)
                    op, layer = op + 1, 0
                    continue
                if tp_fluid and layer < layers:  # a layer in stages, its TP bytes a fluid
                    if not stage:  # it starts
                        if gathered[op][layer] > t:
                            break
                        w = compute[kind] + (ch.head_bwd if kind == "B" and not layer else 0.0)
                        computing, stage = True, 1
                        if hidden:  # compute beside the hidden share, then the rest
                            busy_until, tp_phase, tp_until = t + w, 1, t + tp_wait[kind] * hidden
                        else:  # compute as the TP collectives' first latency, then bytes
                            busy_until = t + (w + tp_wait[kind])
                    if stage == 1:
                        if computing and busy_until <= t:
                            computing = False
                        if tp_phase == 1 and tp_until <= t:
                            tp_phase, tp_left = 2, tp_bytes[kind] * hidden
                        if tp_phase == 2 and tp_left <= 0.0:
                            tp_phase = 0
                        if computing or tp_phase:
                            break
                        if hidden:
                            stage, tp_phase, tp_until = 2, 1, t + tp_wait[kind] * (1 - hidden)
                        else:
                            stage, tp_phase, tp_left = 3, 2, tp_bytes[kind]
                    if stage == 2:
                        if tp_until > t:
                            break
                        stage, tp_phase, tp_left = 3, 2, tp_bytes[kind] * (1 - hidden)
                    if tp_left > 0.0:
                        break
                    stage = tp_phase = 0  # the layer's TP bytes are done
                else:
                    if not computing and layer < layers and gathered[op][layer] <= t:
                        busy_until = t + (head_b if kind == "B" and not layer
                                          else work[kind])
                        computing = True
                    if not computing or busy_until > t:
                        break
                    computing = False
                if layer < layers:
                    finished[op][layer] = t
                    if kind == "B":
                        jobs[1].append(reduce_job)
                    layer += 1
                    if layer == layers and kind == "F" and ch.head_fwd:
                        busy_until, computing = t + ch.head_fwd, True
                if not computing and layer == layers:
                    if kind == "B":
                        jobs[1].append((op, *job(-1, -1, 1, extra_r)))
                    if row is not None and not phase[0] and current[0] is None and \
                            head[0] == len(jobs[0]):
                        kept[row[:2]] = (t - row[2], phase[1], until[1] - row[2], left[1],
                                         units[1], current[1], jobs[1][head[1]:])
                    op_ends.append(t)
                    op, layer = op + 1, 0
            # the streams; another pass only for what a transition at t reads: a reduce
            # taken or done (the gathers' conditions), a gather done (the compute), a
            # stream with no latency or no bytes left (its own next step); the compute's
            # changes the streams read below, in this pass
            for s in (0, 1):
                if phase[s] == 0:
                    queue = jobs[s]
                    if head[s] == len(queue):
                        continue
                    nxt = queue[head[s]]
                    if nxt[2] >= 0 and finished[nxt[0]][nxt[2]] > t:
                        continue  # gated
                    if s == 0 and syncs and nxt[3] and (current[1] is not None
                                                        or head[1] < len(jobs[1])):
                        continue  # a gather waits for the reduces in flight
                    head[s] += 1
                    current[s], units[s] = nxt, nxt[3]
                    if s == 0 and kinds[nxt[0]] == "F" and phase[1] == 0 and \
                            head[1] == len(jobs[1]) and not tp_fluid:
                        # a forward's gathers with no reduction about: alone, in one go
                        units[0], phase[0] = 0, 1
                        until[0], left[0] = t + nxt[3] * (nxt[4] + nxt[5]), 0.0
                    changed = changed or s == 1
                elif phase[s] == 1 and until[s] <= t:
                    phase[s] = 2
                    changed = changed or left[s] <= 0.0
                elif phase[s] == 2 and left[s] <= 0.0:
                    phase[s] = 0
                if phase[s] == 0 and current[s] is not None:
                    if units[s]:  # the job's next unit
                        units[s] -= 1
                        phase[s], until[s], left[s] = 1, t + current[s][4], current[s][5]
                    else:  # the job is done
                        done, current[s], changed = current[s], None, True
                        if s == 0 and done[1] >= 0:
                            gathered[done[0]][done[1]] = t
                if phase[s] == 1 and until[s] <= t:
                    changed = True
        r_tp = 1.0
        if tp_phase == 2 and (phase[0] == 2 or phase[1] == 2):  # TP beside stream bytes
            moving = (current[0][6] if phase[0] == 2 else None,
                      current[1][6] if phase[1] == 2 else None)
            key = id(moving[0]), id(moving[1])
            if key not in shares:
                fraction = iter(shared_fractions([f for f in (*moving, tp) if f is not None],
                                                 c.capacity))
                shares[key] = tuple(next(fraction) if f is not None else 1.0
                                    for f in (*moving, tp))
            r0, r1, r_tp = shares[key]
        elif phase[0] == 2 and phase[1] == 2:
            pair = id(current[0][6]), id(current[1][6])
            if pair not in growth:
                growth[pair] = shared_growth(current[0][6], current[1][6], c.capacity)
            g0, g1 = growth[pair]
            r0, r1 = 1 / (1 + g0), 1 / (1 + g1)
        else:
            r0 = r1 = 1.0
        d0 = until[0] if phase[0] == 1 else t + left[0] / r0 if phase[0] == 2 else inf
        d1 = until[1] if phase[1] == 1 else t + left[1] / r1 if phase[1] == 2 else inf
        d_tp = tp_until if tp_phase == 1 else t + tp_left / r_tp if tp_phase == 2 else inf
        t_next = min(d0, d1, d_tp, busy_until if computing else inf)
        if t_next == inf:
            if op < n_ops:
                raise ValueError("the ZeRO-3 replay deadlocks: a layer waits for a gather "
                                 "gated on a layer after it")
            break
        if phase[0] == 2:
            left[0] = 0.0 if d0 == t_next else left[0] - (t_next - t) * r0
        if phase[1] == 2:
            left[1] = 0.0 if d1 == t_next else left[1] - (t_next - t) * r1
        if tp_phase == 2:
            tp_left = 0.0 if d_tp == t_next else tp_left - (t_next - t) * r_tp
        t = t_next
    return t, op_ends[-1], op_ends
