"""The closed-form face of a step: ``estimate_step``.

The same ``StepCosts`` as ``labsim.simulate_step``, evaluated without events: a schedule that
costs at most ``SCHEDULE_OPS`` ops op by op (``labsim.step.alone``), a ZeRO-3 step that moves
at most ``ZERO3_FLOWS`` collectives replayed as fluids (``labsim.step.zero3_fluid``), and
longer ones by the formulas below, each with what justifies it in ``docs/step.md``.
"""

from __future__ import annotations

from itertools import accumulate

from labsim.cluster import Cluster
from labsim.network import Placed, shared_fractions, shared_growth
from labsim.plan import Plan
from labsim.step.alone import alone_schedule, bucket_growth, op_time
from labsim.step.costs import ChunkCost, StepCosts, stage_memory, step_costs
from labsim.step.result import StepResult, result_from
from labsim.step.zero3_fluid import zero3_fluid, zero3_tp_flows
from labsim.workload import Transformer

SCHEDULE_OPS = 768  # the closed form evaluates schedules of up to this many ops op by op
ZERO3_FLOWS = 170  # and replays ZeRO-3 steps that move up to this many collectives by events
# ... or this many where TP collectives move beside the streams: then a forward's gathers
# are events too (they meet the TP bytes), not one pass in a row
ZERO3_TP_FLOWS = 230
BUBBLE_WEIGHT = 0.3  # interleaved bubble: 0 the average stage's pace, 1 the slowest stage's


def _evaluated_schedule(c: StepCosts) -> tuple[list[float], list[float], float] | None:
    """Each stage's end, its compute-busy seconds and the last compute's end, from the
    step's schedule evaluated op by op at the rates alone (``alone_schedule``), when that
    costs at most ``SCHEDULE_OPS`` ops; None when it would cost more.

    A longer one whose ``p`` and ``2 p`` micro-batches (with a micro-batch group N, one and
    two groups, each with the rest ``m % N``) fit that budget together is extended from short
    runs: with fixed op times a pipeline's makespan grows by the same amount per micro-batch
    once it is past its fill (a max-plus linear system settles into a periodic regime).
    Where the slowest stage sets that pace (``_stage_paces``) the first run is extended at
    it; elsewhere the two runs give the fill and the pace, whether a stage or a pipe sets
    it, extended in a straight line."""
    from labsim.pipeline import make_schedule

    plan = c.plan
    p, m, v, group = plan.pp, plan.microbatches, plan.virtual_stages, plan.microbatch_group
    if 2 * p * v * m <= SCHEDULE_OPS:
        run = alone_schedule(c, make_schedule(plan.schedule, p, m, v, group), trace=False)
        return run.ends, run.busy, run.compute_end
    # Megatron-Core's groups of N: one and two full groups, each with the last group's rest
    m1, m2 = (p, 2 * p) if group is None else (group + m % group, 2 * group + m % group)
    if 2 * p * v * (m1 + m2) > SCHEDULE_OPS:
        return None
    growth = bucket_growth(c) if plan.overlap_grad_reduce else {}
    paces = _stage_paces(c)
    if paces is not None:  # the slowest stage sets the pace: one run, then that pace
        run = alone_schedule(c, make_schedule(plan.schedule, p, m1, v, group), trace=False,
                             growth=growth)
        pace, own = max(paces[0]), paces[1]
        return ([end + (m - m1) * pace for end in run.ends],
                [b + (m - m1) * w for b, w in zip(run.busy, own)],
                run.compute_end + (m - m1) * pace)
    scratch: dict = {}  # the longer run first: the shorter one reuses its tables
    b, a = (alone_schedule(c, make_schedule(plan.schedule, p, n, v, group), trace=False,
                           growth=growth, scratch=scratch) for n in (m2, m1))
    return ([_line(x, y, m1, m2, m) for x, y in zip(a.ends, b.ends)],
            [_line(x, y, m1, m2, m) for x, y in zip(a.busy, b.busy)],
            _line(a.compute_end, b.compute_end, m1, m2, m))


def _stage_paces(c: StepCosts) -> tuple[list[float], list[float]] | None:
    """Each stage's seconds per micro-batch in a 1F1B or interleaved schedule's steady state,
    with and without its blocking sends (its ops alone, ``op_time``), where the slowest
    stage sets the pipeline's pace: no send longer than the shortest op (a longer one can
    make a micro-batch's round trip through the stages the pace) and no gradient buckets
    every micro-batch (ZeRO-2's stream can set it too).  None otherwise, and for GPipe (all
    forwards, then all backwards: the slowest forward plus the slowest backward).  On 900
    sampled long interleaved plans, one run at this pace came within 2 % of
    ``simulate_step`` as often as two runs in a line or more often (docs/step.md section 2)."""
    plan = c.plan
    if plan.schedule == "gpipe" or plan.zero_stage == 2:
        return None
    p = plan.pp
    op_f, op_b, send_f, send_b = _chunk_times(c)
    if any(send.alone_s > min(op_f + op_b) for send in c.p2p.values()):
        return None
    own, sends = [0.0] * p, [0.0] * p
    for g in range(len(op_f)):  # stage s holds chunks s, s + p, ...
        own[g % p] += op_f[g]
        own[g % p] += op_b[g]
        sends[g % p] += send_f[g]
        sends[g % p] += send_b[g]
    if not c.software.blocking_p2p:
        sends = [0.0] * p
    return [a + b for a, b in zip(own, sends)], own


def _chunk_times(c: StepCosts) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per model chunk: its forward and its backward alone (``op_time``), and the sends that
    carry their outputs to the next chunk and back to the one before, alone (0: none)."""
    p, h = c.plan.pp, c.tp_hidden
    n_chunks = len(c.chunks)
    op_f, op_b, send_f, send_b = [], [], [], []
    for g, ch in enumerate(c.chunks):
        sf = c.p2p.get((g % p, (g + 1) % p)) if g < n_chunks - 1 else None
        sb = c.p2p.get((g % p, (g - 1) % p)) if g > 0 else None
        send_f.append(sf.alone_s if sf is not None else 0.0)
        send_b.append(sb.alone_s if sb is not None else 0.0)
        op_f.append(op_time(ch.t_fwd, ch.tp, ch.tp_fwd, h))
        op_b.append(op_time(ch.t_rec + ch.t_bwd, ch.tp, ch.tp_bwd, h))
    return op_f, op_b, send_f, send_b


def _line(x1: float, x2: float, m1: int, m2: int, m: int) -> float:
    """At ``m`` micro-batches, the straight line through ``x1`` at ``m1`` and ``x2`` at
    ``m2``."""
    return x2 + (m - m2) / (m2 - m1) * (x2 - x1)


def _evaluated_zero3(c: StepCosts) -> tuple[float, float] | None:
    """End of a ZeRO-3 step's communication and of its last compute (before the optimizer),
    from its ops replayed with the two streams as fluids (``labsim.step.zero3_fluid``), when
    the replay moves at most ``ZERO3_FLOWS`` collectives event by event (``ZERO3_TP_FLOWS``
    where TP bytes move beside the streams); None when it would move more.
    1F1B (forward, backward, forward, ...) is replayed for two micro-batches and extended in
    a line: from the second on, each forward meets the previous backward's last reductions
    alike, so every further micro-batch adds what the second did.  GPipe (every forward,
    then every backward) is replayed for four and two micro-batches and extended in the
    line through them: a further micro-batch adds a forward and a backward inside their
    phases, though not always the same time (the reductions' backlog beside the gathers
    alternates; the line through two micro-batches apart stays within 1 % of the full
    replay on the plans measured, docs/step.md).  What the replay moves event by event:
    every op but those taken from one before (``zero3_fluid``'s memo: 1F1B's second
    backward, GPipe's forwards after the first and the two micro-batches' backwards after
    the four's); a forward goes in one go unless TP bytes move beside the streams."""
    from labsim.pipeline import make_schedule

    plan = c.plan
    m, layers = plan.microbatches, c.chunks[0].layers
    gathers_f, gathers_b = c.zero3_gathers
    tp_flows = zero3_tp_flows(c)  # forward and backward alike
    backward = sum(gathers_b) + layers * c.zero3_units + 1 + tp_flows / 2
    forward = sum(gathers_f) + 1 + tp_flows / 2 if tp_flows else 0.0
    gpipe_line = plan.schedule == "gpipe" and m > 4
    # GPipe's backwards in a row: with TP bytes beside the streams, each after the first
    # moves three flows at once throughout (the one before's reductions, its gathers, its TP
    # bytes), its events costlier: 1.25 each
    in_row = 1.25 if tp_flows else 1.0
    replayed_b = 1 + in_row * (min(m, 4) - 1) if plan.schedule == "gpipe" else 1
    replayed_f = 1 if plan.schedule == "gpipe" else min(m, 2)
    if replayed_b * backward + replayed_f * forward > (ZERO3_TP_FLOWS if tp_flows
                                                       else ZERO3_FLOWS):
        return None
    if plan.schedule == "1f1b" and m > 2:
        end, compute_end, op_ends = zero3_fluid(c, make_schedule("1f1b", 1, 2)[0])
        shift = (m - 2) * (op_ends[3] - op_ends[1])
        return end + shift, compute_end + shift
    if gpipe_line:
        memo: dict = {}  # four first: two micro-batches' backwards are its first two
        (e4, c4, _), (e2, c2, _) = (zero3_fluid(c, make_schedule("gpipe", 1, n)[0], memo)
                                    for n in (4, 2))
        return _line(e2, e4, 2, 4, m), _line(c2, c4, 2, 4, m)
    end, compute_end, _ = zero3_fluid(c, make_schedule(plan.schedule, 1, m)[0])
    return end, compute_end


def _bucket_finish(free: float, t0: float, d: float, n: int, tau: float) -> float:
    """End of ``n`` buckets of ``tau`` s on a stream free at ``free``, bucket k ready at
    ``t0 + k d / n``: the later of the backlog and the two ends of the ready line."""
    return max(free + n * tau, t0 + d / n + n * tau, t0 + d + tau)


def estimate_step(model: Transformer, cluster: Cluster, plan: Plan, *,
                  memory: bool = True) -> StepResult:
    """The closed-form face of ``labsim.simulate_step``: the same ``StepResult`` (no trace)
    from the same ``step_costs``, every collective at its rate alone except where two
    streams meet on a pipe in the ways it prices (a backward op's TP collectives beside its
    gradient buckets, as two fluids, in ``labsim.step.alone.alone_schedule``; ZeRO-3's
    gather stream beside its reduce stream); other meetings are not priced.

    A pipeline whose schedule costs at most ``SCHEDULE_OPS`` ops to evaluate, directly or as
    two short runs (``_evaluated_schedule``: one extended at the slowest stage's pace, or both
    in a line), is evaluated op by op at the
    rates alone; a longer one (many stages) takes the formulas.  Pipeline makespan for
    per-micro-batch stage work ``W_s`` (forward + backward of its chunks,
    with blocking sends included): ``(m - 1/v) max W_s + sum W_s / v`` plus the pipeline
    sends' fill and drain, a send at every chunk boundary each way (interleaved, each of the
    fill's v rounds waits for its p sends, less what a micro-batch group's N - p more
    chunk-ops hide; a group longer than p runs the first group's forwards and the last
    group's backwards of every chunk but the last at the slowest stage's pace for that chunk)
    (1F1B, interleaved: uniform stages give Narayanan
    et al.'s ``(m + (p-1)/v)(t_f + t_b)``); GPipe: forward and backward phases each
    ``sum + (m-1) max``.  Gradient buckets: the later of the stream's backlog and the ready
    line (``_bucket_finish``); a stage's last chunk's buckets slow its last backward ops
    beside their TP bytes, a delay the drain carries down (``_buckets_beside_tp``).
    ZeRO-3: replayed as the engine runs it, with the two streams' bytes as fluids
    (``_evaluated_zero3``), when it moves at most ``ZERO3_FLOWS`` collectives by events
    (``ZERO3_TP_FLOWS`` with TP bytes beside the streams); otherwise per layer the slower of
    compute and the gather (plus the reduce in backward, the two moving together on shared
    pipes: ``_together``; without prefetch each layer's gathers beside the previous layer's
    reduce: ``_gathers_beside``) on the data-parallel links, and no faster than the layer's
    TP bytes and the streams' moving together where they share pipes (in backward at the
    fair shares of all three, after the first latency to pass); where gathers synchronise, a
    layer that gathers nothing slows the reduces in flight by its TP bytes.
    """
    from labsim.pipeline import in_flight_peak, interleaved_warmup

    c = step_costs(model, cluster, plan)
    p, m, v = plan.pp, plan.microbatches, plan.virtual_stages
    mem = None
    if memory:
        mem = stage_memory(c, in_flight_peak(plan.schedule, p, m, v,
                                             group=plan.microbatch_group)
                           if c.zero3_gather is None else 1)
    if c.zero3_gather is None:
        run = _evaluated_schedule(c)
        if run is not None:
            ends, busy, compute_end = run
            return result_from(c, max(ends), busy, compute_end, mem, None)
    n_chunks = p * v
    h = c.tp_hidden
    blocking = c.software.blocking_p2p
    if c.zero3_gather is not None:
        run = _evaluated_zero3(c)
        if run is not None:
            end, compute_end = run
            return result_from(c, end + c.optimizer_s[0], [compute_end], compute_end, mem,
                               None)
        step = _zero3_estimate(c, h) + c.optimizer_s[0]
        per_mb = (step - c.optimizer_s[0]) / m
        return result_from(c, step, [per_mb * m], step - c.optimizer_s[0], mem, None)
    op_f, op_b, send_f, send_b = _chunk_times(c)
    fwd = [t + (x if blocking else 0) for t, x in zip(op_f, send_f)]
    bwd = [t + (x if blocking else 0) for t, x in zip(op_b, send_b)]
    stage_f = [sum(fwd[s::p]) for s in range(p)]  # stage s holds chunks s, s + p, ...
    stage_b = [sum(bwd[s::p]) for s in range(p)]
    comm = 0.0 if blocking else sum(send_f[:n_chunks - 1]) + sum(send_b[1:n_chunks])
    # Megatron-LM's rounds of p micro-batches; Megatron-Core's groups of N, the last group the
    # rest (N or m % N): the last round of backwards, p or last_round ops of each chunk
    group = plan.microbatch_group
    last_round = p if group is None else m % group or group
    if group is not None and v > 1 and not blocking:
        # a group of N > p micro-batches hides a round's sends behind N - p more chunk-ops: in
        # the fill, stage 0 runs N forwards of chunk j while micro-batch 0 crosses the p
        # stages (p forwards, p sends) to come back for chunk j + 1; in the drain, the last
        # stage runs the last group's backwards of chunk j while the gradient crosses back
        for j in range(v - 1):
            comm -= min(sum(send_f[j * p:(j + 1) * p]), (group - p) * fwd[j * p])
            k = v - 1 - j  # the last stage's local chunk, from the last
            comm -= min(sum(send_b[k * p:(k + 1) * p]),
                        (last_round - p) * bwd[k * p + p - 1])
    if plan.schedule == "gpipe":
        pipe = (sum(stage_f) + (m - 1) * max(stage_f) + sum(stage_b)
                + (m - 1) * max(stage_b) + comm)
    else:
        work = [a + b for a, b in zip(stage_f, stage_b)]
        if v == 1:
            pipe = (m - 1) * max(work) + sum(work) + comm
        else:  # interleaved: a bubble of p - 1 chunk-ops, between the average stage's pace and
            # the bottleneck's (uniform stages: both give Narayanan et al.'s (p - 1) / v; the
            # weight is what matches simulate_step on heterogeneous stages)
            w = BUBBLE_WEIGHT
            bubble = ((1 - w) * (sum(work) - max(work)) + w * (p - 1) * max(work)) / v
            pipe = m * max(work) + bubble + comm
            if group is not None:
                # a group longer than p runs each chunk's forwards, then its backwards, in
                # runs longer than the pipeline is deep: the first group's forwards of every
                # chunk but the last go at the slowest stage's forward, and the last group's
                # backwards of those chunks at the slowest stage's backward, where the
                # formula above has the bottleneck stage's
                star = work.index(max(work))
                for j in range(v - 1):
                    f_j, b_j = fwd[j * p:(j + 1) * p], bwd[j * p:(j + 1) * p]
                    pipe += ((group - p) * (max(f_j) - f_j[star])
                             + (last_round - p) * (max(b_j) - b_j[star]))
    busy = [m * (a + b) for a, b in zip(stage_f, stage_b)]
    drain = 0.0
    # whether stage 0 runs every forward first (Megatron-LM's order when m = p; Megatron-Core's
    # groups of N when its warm-up, 2 (p - 1) + (v - 1) N forwards, takes them all)
    every_forward_first = v > 1 and interleaved_warmup(p, m, v, 0, group) == m * v
    zero2 = plan.zero_stage == 2
    stages = []
    growth = None  # chunk -> growths of TP and buckets beside each other, when first needed
    for s in range(p):
        last_end = pipe - drain  # stage s's last backward ends when its gradient has left
        drain += bwd[s] + (0.0 if blocking else send_b[s] if s > 0 else 0.0)
        stream = late = 0.0
        # the backwards visit a stage's chunks from its last (local v - 1) to its first, in
        # rounds of p ops of one chunk (``last_round``): chunk j's last backward ends a round
        # of each chunk before it (j - 1 ... 0) ahead of the stage's last, and its buckets go
        # in that order
        before = list(accumulate((last_round * bwd[s + j * p] for j in range(v - 1)),
                                 initial=0.0))
        for j in reversed(range(v)):
            g = s + j * p
            bucket, n = c.buckets[g]
            if bucket is None:
                continue
            if not plan.overlap_grad_reduce:
                stream = max(stream, last_end) + n * (m if zero2 else 1) * bucket.alone_s
                continue
            d = bwd[g]
            t0 = last_end - before[j] - d
            if zero2:  # buckets after every backward: the backlog of m of them
                first = t0 - (m - 1) * (stage_f[s] + stage_b[s])
                stream = max(_bucket_finish(stream, t0, d, n, bucket.alone_s),
                             first + m * n * bucket.alone_s)
            else:
                start = max(stream, t0 + d / n)
                stream = _bucket_finish(stream, t0, d, n, bucket.alone_s)
                if j == 0 or every_forward_first:  # beside the stage's last backward ops
                    if growth is None:  # the chunks priced so: each stage's last, or all
                        growth = bucket_growth(c, range(n_chunks) if every_forward_first
                                               else range(p))
                    if g in growth:
                        op_late, bucket_late = _buckets_beside_tp(
                            c.chunks[g], bucket, n, d, last_end - start, *growth[g])
                        late += op_late
                        stream += bucket_late
        stages.append((last_end, stream, late))
    # a stage's last backward ops, slowed by the TP bytes beside its last chunk's buckets,
    # delay every stage the drain reaches after it, down to stage 0; so do every chunk's when
    # all forwards run first (m = p), the backward then one chain through the stages for each
    # chunk (with a steady phase, an earlier chunk's delays meet slack: not priced)
    ends, behind = [0.0] * p, 0.0
    for s in reversed(range(p)):
        free, stream, late = stages[s]
        behind += late
        tied = c.embedding_allreduce[s]
        t = max(free, stream) + behind + (tied.alone_s if tied else 0.0) + c.optimizer_s[s]
        gather = c.param_gather[s]
        if gather is not None and not c.software.overlap_param_gather:
            t += gather.alone_s
        ends[s] = t
    return result_from(c, max(ends), busy, pipe + behind, mem, None)


def _buckets_beside_tp(ch: ChunkCost, bucket: Placed, n: int, op_s: float, window_s: float,
                       g_tp: float, g_b: float) -> tuple[float, float]:
    """Seconds a stage's backward ops and its bucket stream each lose where ``n`` buckets of
    a chunk move beside the TP bytes of the backward ops after it (one every ``op_s``, their
    TP bytes ``rho`` of each) for at most ``window_s``: the TP bytes move ``rho`` of the
    buckets' time, each flow slower by its growth beside the other while both move
    (``g_tp``, ``g_b``: ``labsim.step.alone.bucket_growth``)."""
    tp = ch.tp
    if tp is None or not ch.tp_bwd or window_s <= 0 or op_s <= 0:
        return 0.0, 0.0
    rho = min(1.0, (tp.alone_s - tp.latency_s) * ch.tp_bwd / op_s)
    share = rho * (1 + g_tp) / (1 + rho * g_tp)  # of the buckets' time TP moves bytes in
    moving = n * (bucket.alone_s - bucket.latency_s)
    life = min(moving / (1 - share * g_b / (1 + g_b)), window_s)
    return g_tp * rho * life / (1 + rho * g_tp), life - moving if life > moving else 0.0


def _zero3_estimate(c: StepCosts, h: float) -> float:
    """Seconds of the ZeRO-3 micro-batches of ``c`` (pp = 1; module ``estimate_step`` doc)."""

    plan = c.plan
    ch = c.chunks[0]
    layers, units, k = ch.layers, c.zero3_units, plan.zero3_prefetch
    one = c.zero3_gather.alone_s + c.zero3_gather_extra_s[0]
    fwd, bwd = c.zero3_gathers
    r = units * c.zero3_reduce.alone_s
    c_f = op_time((ch.t_fwd - ch.head_fwd) / layers, ch.tp, ch.tp_fwd // layers, h)
    c_b = op_time((ch.t_bwd - ch.head_bwd + ch.t_rec) / layers, ch.tp, ch.tp_bwd // layers, h)

    g_gather, g_reduce = shared_growth(c.zero3_gather, c.zero3_reduce, c.capacity)
    moving_g = c.zero3_gather.alone_s - c.zero3_gather.latency_s
    moving_r = units * (c.zero3_reduce.alone_s - c.zero3_reduce.latency_s)
    # a layer's TP bytes (s alone), where they share pipes with the streams, and the growths
    # of TP beside a stream and of a stream beside TP
    tp_bytes = (0.0, 0.0)
    if zero3_tp_flows(c):
        tp_bytes = tuple((ch.tp.alone_s - ch.tp.latency_s) * (n // layers)
                         for n in (ch.tp_fwd, ch.tp_bwd))
        if k == 0 and c.software.zero3_gather_syncs:  # TP beside the reduce stream
            g_tp_r, g_r_tp = shared_growth(ch.tp, c.zero3_reduce, c.capacity)
        elif k:
            g_tp, g_stream = shared_growth(ch.tp, c.zero3_gather, c.capacity)
            # beside both streams at once: TP's growth, and the streams' (their rates
            # together beside TP against their rates together alone)
            f_tp, f_g, f_r = shared_fractions([ch.tp, c.zero3_gather, c.zero3_reduce],
                                              c.capacity)
            f_g2, f_r2 = shared_fractions([c.zero3_gather, c.zero3_reduce], c.capacity)
            g_tp3, g_stream3 = 1 / f_tp - 1, (f_g2 + f_r2) / (f_g + f_r) - 1

    def phase(counts: tuple[int, ...], compute: float, reduce: float, tp_s: float,
              tp_calls: int) -> float:
        if k == 0 and reduce and c.software.zero3_gather_syncs:
            # a layer's gathers wait for the reduces in flight; a layer that gathers nothing
            # computes beside them, its TP bytes (at its end) moving together with the reduce
            # stream left, whose bytes fill ``rho`` of its time: the stream slower by its
            # growth in its bytes, TP by its own while the stream moves bytes
            t = free = 0.0
            rho = moving_r / reduce
            if tp_s:
                g_stream_r = 1 / (1 - rho * g_r_tp / (1 + g_r_tp)) - 1
                g_tp_stream = g_tp_r * rho * (1 + g_r_tp) / (rho * (1 + g_r_tp) + 1 - rho)
            for n in reversed(counts):
                t = (max(t, free) + n * one if n else t) + compute
                if tp_s and not n and free > t - tp_s:
                    at, left = t - tp_s, free - t + tp_s
                    t = at + _first_done(tp_s, left, g_tp_stream, g_stream_r)
                    free = at + _first_done(left, tp_s, g_stream_r, g_tp_stream)
                free = max(free, t) + reduce
            return free
        if k == 0 and reduce:  # each layer's gathers move beside the last layer's reduce
            first, *rest = reversed(counts)
            return (first * one + layers * compute + reduce + sum(
                _gathers_beside(n, one - moving_g, moving_g, c.zero3_reduce.latency_s,
                                moving_r, g_gather, g_reduce) for n in rest))
        if k == 0:
            return sum(counts) * one + layers * compute + reduce
        gather = one * sum(counts) / layers  # prefetching profiles gather every layer alike
        comm = gather + reduce
        streams = moved = moving_g * sum(counts) / layers  # the streams' bytes, s
        if reduce:  # the next layer's gather moves beside this one's reduce, sharing pipes,
            # each one's latency and host work beside the other's bytes
            streams = _together(moved, moving_r, g_gather, g_reduce)
            comm = (max(gather - moved, reduce - moving_r) + streams if k < 2 else
                    # two or more gathers ahead: the gather stream runs ahead of the reduce
                    # stream, each one's latency passing while the other moves bytes
                    max(gather, reduce, streams))
        layer = max(compute, comm)
        if tp_s:  # and the layer's TP bytes share the pipes with the streams' bytes, the
            # first to start (after a stream's latency, or the hidden TP share's, or the
            # compute with blocking TP) moving alone until the other starts, and, where TP
            # ends last, after the latency of the TP share left to the layer's end
            g_a, g_b = (g_tp3, g_stream3) if reduce else (g_tp, g_stream)
            at_s = min(gather - moved, reduce - moving_r) if reduce else gather - moved
            tp_lat = tp_calls * ch.tp.latency_s
            at_tp = h * tp_lat if h else compute - tp_s
            if at_tp <= at_s:
                tp_left, streams_left = max(0.0, tp_s - (at_s - at_tp)), streams
            else:
                tp_left, streams_left = tp_s, max(0.0, streams - (at_tp - at_s))
            both = max(at_s, at_tp) + _together(tp_left, streams_left, g_a, g_b)
            if h and _first_done(streams_left, tp_left, g_b, g_a) < _first_done(
                    tp_left, streams_left, g_a, g_b):
                both += (1 - h) * tp_lat
            layer = max(layer, both)
        return gather + (layers - 1) * layer + compute + reduce

    extra_g = (c.zero3_extra[0].alone_s + c.zero3_gather_extra_s[1]
               if c.zero3_extra[0] is not None else 0.0)
    extra_r = c.zero3_extra[1].alone_s if c.zero3_extra[1] is not None else 0.0
    per_mb = (extra_g + phase(fwd, c_f, 0.0, tp_bytes[0], ch.tp_fwd // layers) + ch.head_fwd
              + phase(bwd, c_b, r, tp_bytes[1], ch.tp_bwd // layers) + ch.head_bwd + extra_r)
    return plan.microbatches * per_mb


def _gathers_beside(n: int, before_s: float, moving_s: float, reduce_wait_s: float,
                    reduce_s: float, growth_g: float, growth_r: float) -> float:
    """Seconds of ``n`` gathers in a row (each ``before_s`` of latency and host work, then
    ``moving_s`` of bytes alone) started together with a reduce (``reduce_wait_s`` of latency,
    then ``reduce_s`` of bytes alone): the bytes of both move as fluids on shared pipes,
    each ``growth_*`` longer while the other moves (``labsim.network.shared_growth``)."""
    t, left = 0.0, reduce_s
    for _ in range(n):
        if left > 0:  # the reduce moves alone while the gather waits
            left = max(0.0, left - max(0.0, t + before_s - max(t, reduce_wait_s)))
        t += before_s
        if left > 0 and t >= reduce_wait_s:
            step = _first_done(moving_s, left, growth_g, growth_r)
            left = max(0.0, left - step / (1 + growth_r))
            t += step
        else:
            t += moving_s
    return t


def _first_done(a_s: float, b_s: float, growth_a: float, growth_b: float) -> float:
    """Seconds until flow ``a`` is done when it starts together with ``b`` (``_together``'s
    terms): shared while both move, alone once ``b`` is done."""
    if a_s * (1 + growth_a) <= b_s * (1 + growth_b):
        return a_s * (1 + growth_a)
    return b_s * (1 + growth_b) + a_s - b_s * (1 + growth_b) / (1 + growth_a)


def _together(a_s: float, b_s: float, growth_a: float, growth_b: float) -> float:
    """Seconds until two flows that start together are both done, ``a_s`` and ``b_s`` their
    bandwidth seconds alone and ``growth_*`` how much longer each takes beside the other
    (``labsim.network.shared_growth``): shared until the first ends, then the other
    alone.  Work-conserving sharing (growths 1, 1 on one pipe) gives ``a_s + b_s``."""
    return max(_first_done(a_s, b_s, growth_a, growth_b),
               _first_done(b_s, a_s, growth_b, growth_a))
