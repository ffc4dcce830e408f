"""A training step evaluated exactly without events, when nothing it moves contends.

``alone_schedule`` runs a step's op lists (``labsim.pipeline``) in schedule order with every
flow at its rate alone (``labsim.network.FoldedNetwork``): an op starts at max(stage free,
input arrival), gradient buckets stream as backward produces them, then the optimizer and
ZeRO-1/2's parameter all-gather.  That is exactly what the event engine
(``labsim.sim.step``) computes whenever no two flows move bytes on one pipe at the same time;
``check=True`` finds out and answers None when some do, so ``simulate_step`` runs the events
only for steps that need them, and ``estimate_step`` uses the same evaluation as its fast
path, with the one meeting it prices there (an op's TP bytes beside the gradient buckets
its stage is reducing, ``beside_stream``) as two fluids.  ``zero3_fluid`` replays a ZeRO-3
step the same way, its gather and reduce streams as two fluids: exactly what the engine
computes when the step has no TP collectives.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from operator import itemgetter

import numpy as np

from labsim.network import Placed, shared_growth
from labsim.pipeline import Op, Schedule
from labsim.step.beside import BucketStream, beside_stream, buckets_of_op
from labsim.step.costs import StepCosts
from labsim.step.inline import flows as inline_flows


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
            ch = c.chunks[g]  # TP collectives, the inline ones (EP, CP)
            for pl in (ch.tp, *(x.placed for x in ch.inline)):
                for x in (pl.pipes if pl is not None else ()):
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
    evaluation: there each stage's buckets are a stream carried from op to op (``BucketStream``),
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
        # an op beside its buckets from an idle stream, from 0 (``buckets_of_op``)
        beside: dict[tuple, tuple] = {}
        if scratch is not None:
            scratch.update(arrival=arrival, tables=tables, beside=beside)
    pending: list[list[tuple]] = [[] for _ in range(p)]  # buckets: (ready, bucket, k, g)
    bare = not (check or trace)
    streams = [BucketStream() for _ in range(p)]  # with ``bare``, each stage's bucket stream
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
                            end = buckets_of_op(stream, start, end, work, h, tp, calls,
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
                        end = beside_stream(stream, start, work, h, tp_latency,
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
                flows = inline_flows(ch.inline, fwd)
                inline_pipes = tuple(x for pl, _ in flows for x in pl.pipes)
                if not any(x in moving for x in tp_pipes + send_pipes + inline_pipes):
                    continue
                sel = forward if fwd else ~forward
                if local_of is not None:
                    sel = sel & (local_of == local)
                a, b = begin[sel], end[sel]
                if send_pipes:
                    add(send_pipes, b + send.latency_s, b + send.alone_s)
                if flows:  # after the compute, inside the op's work (``_op`` of the engine)
                    t = a + (work - sum([pl.alone_s * n for pl, n in flows]))
                    for pl, n in flows:
                        add(pl.pipes, t + n * pl.latency_s, t + pl.alone_s * n)
                        t = t + pl.alone_s * n
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

