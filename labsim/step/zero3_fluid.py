"""A ZeRO-3 step replayed without events, its gather and reduce streams as two fluids.

``zero3_fluid`` runs a stage's ops as ``labsim.sim.step`` runs them: each unit's all-gather
waits its latency (and the profile's host seconds), then moves its bytes at its rate alone or
at its share while the reduce stream moves beside it -- exactly what the engine computes when
the step has no TP collectives (``zero3_tp_flows``: how many TP flows move beside them).
"""

from __future__ import annotations

from labsim.network import Placed, shared_fractions, shared_growth
from labsim.pipeline import Op
from labsim.step.alone import op_time
from labsim.step.costs import StepCosts


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
