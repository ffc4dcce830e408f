"""Simulate one training step: every op on its stage, every byte through one network.

``simulate_step(model, cluster, plan)`` prices the step (``labsim.step.step_costs``) and runs
it in simpy: one process per pipeline stage executes its op list (``labsim.pipeline``), and
every communication is a flow on one ``labsim.sim.network.Network`` of the folded pipes
(``labsim.network.FoldedNetwork``), so tensor-parallel, pipeline, data-parallel and ZeRO
traffic slow each other wherever they share a GPU port or a NIC.

* An op waits for its input (the activation from the previous chunk, or the gradient from the
  next), then computes; its tensor-parallel collectives (2 per layer forward, 2 backward, 2
  more for full recomputation; reduce-scatter + all-gather with sequence parallelism) are one
  flow of their bytes after the compute and their latencies (blocking, Megatron-LM 2021), or,
  with ``tp_comm_overlap``, the hidden share runs beside the compute and the rest after it.
* Its output is sent as a flow to the next stage (``b s h / tp`` bytes per GPU).
* Gradient buckets (``bucket_bytes``) are reduced over the data-parallel group on a stream of
  their own as backward produces them (the last backward of each chunk for ZeRO-0/1; every
  backward for ZeRO-2), or after the last backward without overlap; then the optimizer, then
  ZeRO-1/2's parameter all-gather (hidden under the next step's forward when the software
  profile overlaps it).
* ZeRO-3 (pp = 1): every layer's parameters are all-gathered before its forward and again
  before its backward, in the profile's units (a layer, or each weight tensor), up to
  ``zero3_prefetch`` layers ahead on a gather stream, each gather longer by the profile's
  work around it (host work per rank, extra HBM passes: ``StepCosts.zero3_gather_extra_s``);
  each layer's gradients are reduce-scattered (or all-reduced) after its backward on a
  reduce stream -- every micro-batch, so accumulation does not amortise them.  Where the
  profile's gathers synchronise the device (``zero3_gather_syncs``), a gather starts only once
  that stream is idle.

A bucket's ready time is its share of the backward op as planned alone (the op may end later
when links are shared).  A tied embedding's gradient is all-reduced between the first and
the last stage after their gradient reduction, before the optimizer.  The loss and grad-norm
all-reduces, and the receiver-side all-gather of Megatron's scatter-gather sends are not
simulated.  The trace: ``rank`` = pipeline stage (its representative GPU);
streams ``compute``, ``p2p``, ``dp``, ``optimizer``.
"""

from __future__ import annotations

from collections.abc import Generator
from functools import partial

import simpy

from labsim.cluster import Cluster
from labsim.network import Placed
from labsim.pipeline import make_schedule, max_in_flight
from labsim.plan import Plan
from labsim.sim.network import Network
from labsim.step import StepCosts, StepResult, result_from, stage_memory, step_costs
from labsim.step.alone import alone_schedule, op_time
from labsim.step.inline import flows as inline_flows
from labsim.workload import Transformer

MAX_OPS = 2_000_000  # pipeline ops (2 pp m v): beyond, a simulation takes minutes
MAX_FLOWS = 4_000_000  # ZeRO-3 units and gradient buckets together


def simulate_step(model: Transformer, cluster: Cluster, plan: Plan, *,
                  memory: bool = True, events: bool = False) -> StepResult:
    """Simulate one optimizer step of ``model`` on ``cluster`` under ``plan`` (module doc).
    ``memory=False`` skips the memory estimate (``StepResult.memory`` is then None).

    Where no two flows move bytes on one pipe at the same time (checked), the step is
    computed without simpy events at the flows' rates alone -- the same answer, faster;
    ``events=True`` always runs the event simulation (tests compare the two)."""
    costs = step_costs(model, cluster, plan)
    p, m, v = plan.pp, plan.microbatches, plan.virtual_stages
    if 2 * p * m * v > MAX_OPS:
        raise ValueError(f"{2 * p * m * v:,} pipeline ops (2 x pp {p} x micro-batches {m} x "
                         f"v {v}) is more than the {MAX_OPS:,} simulated here; use "
                         "labsim.estimate_step, or fewer micro-batches")
    flows = sum(n for _, n in costs.buckets) * (m if plan.zero_stage == 2 else 1)
    flows += 3 * model.layers * m * costs.zero3_units if costs.zero3_gather else 0
    if flows > MAX_FLOWS:
        raise ValueError(f"{flows:,} communication flows (gradient buckets or ZeRO-3 units "
                         f"over {m} micro-batches) is more than the {MAX_FLOWS:,} simulated "
                         "here; use larger buckets or labsim.estimate_step")
    engine = _Engine(costs)
    ends = engine.run(fast=not events)
    in_flight = max_in_flight(engine.schedule[0]) if not costs.zero3_gather else 1
    mem = stage_memory(costs, in_flight) if memory else None
    return result_from(costs, max(ends), engine.busy, engine.compute_end, mem, engine.all_spans)


class _Engine:
    """The processes of one step (module doc); ``spans`` are raw tuples for the trace:
    (stage, stream, kind, start, end, label, nbytes)."""

    def __init__(self, costs: StepCosts) -> None:
        self.c = costs
        self.plan = plan = costs.plan
        self.env = simpy.Environment()
        self.net = Network(self.env, costs.capacity, track_bytes=False)
        self.schedule = make_schedule(plan.schedule, plan.pp, plan.microbatches,
                                      plan.virtual_stages, plan.microbatch_group)
        self.spans: list[tuple] = []
        self.busy = [0.0] * plan.pp
        self.compute_end = 0.0
        self.arrivals: dict[tuple, simpy.Event] = {}
        self.stream_tail: list[simpy.Event | None] = [None] * plan.pp
        self.hidden = costs.tp_hidden

    def run(self, fast: bool = True) -> list[float]:
        env, p = self.env, self.plan.pp
        ends = [0.0] * p
        if fast and self.c.zero3_gather is None:
            alone = alone_schedule(self.c, self.schedule, check=True)
            if alone is not None:
                self.busy, self.compute_end, self.op_times = alone.busy, alone.compute_end, \
                    alone.op_times
                self.spans.extend(alone.spans)
                return alone.ends
        if self.c.zero3_gather is not None:
            env.process(self._zero3_stage(ends))
        else:
            for s in range(p):
                env.process(self._stage(s, ends))
        env.run()
        return ends

    def all_spans(self) -> list[tuple]:
        """Every span of the run (the fast path's op spans are rebuilt from its times)."""
        times = getattr(self, "op_times", None)
        if times is None:
            return self.spans
        c, p = self.c, self.plan.pp
        n_chunks = p * self.plan.virtual_stages
        out = []
        for s in range(p):
            ts = times[s]
            for j, (kind, mb, local) in enumerate(self.schedule[s]):
                g = local * p + s
                start, end = ts[2 * j], ts[2 * j + 1]
                out.extend(self._op_spans(s, kind, mb, g, start, end))
                nxt = g + 1 if kind == "F" else g - 1
                send = c.p2p.get((s, nxt % p)) if 0 <= nxt < n_chunks else None
                if send is not None:
                    out.append((s, "p2p", "send", end, end + send.alone_s,
                                (kind, mb, g, "send"), send.nbytes))
        return out + self.spans

    def _op_spans(self, s: int, kind: str, mb: int, g: int, start: float,
                  end: float) -> list[tuple]:
        """A forward span, or a backward one preceded by its recompute."""
        if kind == "F":
            return [(s, "compute", "forward", start, end, (kind, mb, g), 0.0)]
        rec = self.c.chunks[g].t_rec
        if rec <= 0:
            return [(s, "compute", "backward", start, end, (kind, mb, g), 0.0)]
        return [(s, "compute", "recompute", start, start + rec, (kind, mb, g), 0.0),
                (s, "compute", "backward", start + rec, end, (kind, mb, g), 0.0)]

    # -- flows ---------------------------------------------------------------------------
    def _flow(self, placed: Placed | None, count: int = 1, latency: float = 0.0,
              share: float = 1.0) -> simpy.Event:
        """``count`` copies of ``placed`` in a row (``share`` of each) after ``latency``."""
        if placed is None or not placed.pipes or count == 0 or share == 0:
            return self.env.timeout(latency)
        return self.net.flow(placed.nbytes * count * share, placed.pipes, placed.loads,
                             placed.cap_Bps, latency + placed.latency_s * count * share)

    def _op(self, work: float, tp: Placed | None, calls: int, inline: tuple = (),
            forward: bool = True) -> Generator:
        """Compute of one op and its tensor-parallel collectives (blocking or overlapped);
        ``work`` holds the seconds alone of its ``inline`` collectives
        (``labsim.step.inline``: EP's all-to-alls, CP's exposed sends), which move on the
        network after the compute, in order."""
        busy: simpy.Event | None = None
        moving = inline_flows(inline, forward)
        if moving:
            compute = work - sum([pl.alone_s * n for pl, n in moving])

            def body() -> Generator:
                yield self.env.timeout(compute)
                for pl, n in moving:
                    yield self._flow(pl, n)
            busy = self.env.process(body())
        if self.hidden and tp is not None and calls:
            yield self.env.all_of([busy or self.env.timeout(work),
                                   self._flow(tp, calls, share=self.hidden)])
            yield self._flow(tp, calls, share=1 - self.hidden)
        elif busy is not None:
            yield busy
            yield self._flow(tp, calls)
        else:
            yield self._flow(tp, calls, latency=work)

    def _stream(self, s: int, placed: Placed | None, ready: float, label: str) -> None:
        """Queue one collective on stage ``s``'s data-parallel stream, not before ``ready``."""
        prev = self.stream_tail[s]
        done = self.env.event()
        self.stream_tail[s] = done
        self.env.process(self._queued(s, placed, ready, prev, done, label))

    def _queued(self, s: int, placed: Placed | None, ready: float,
                prev: simpy.Event | None, done: simpy.Event, label: str) -> Generator:
        if prev is not None:
            yield prev
        if ready > self.env.now:
            yield self.env.timeout(ready - self.env.now)
        start = self.env.now
        yield self._flow(placed)
        self.spans.append((s, "dp", "comm", start, self.env.now, label,
                           placed.nbytes if placed else 0.0))
        done.succeed()

    # -- pipeline stages -----------------------------------------------------------------
    def _stage(self, s: int, ends: list[float]) -> Generator:
        c, plan, env = self.c, self.plan, self.env
        p, m = plan.pp, plan.microbatches
        n_chunks = p * plan.virtual_stages
        ops = self.schedule[s]
        last_b = {}
        for i, (kind, _, chunk) in enumerate(ops):
            if kind == "B":
                last_b[chunk] = i
        zero2 = plan.zero_stage == 2
        busy = 0.0
        for i, (kind, mb, local) in enumerate(ops):
            g = local * p + s
            ch = c.chunks[g]
            forward = kind == "F"
            if (g > 0) if forward else (g < n_chunks - 1):
                key = (kind, mb, g)
                ev = self.arrivals.get(key)
                if ev is None:
                    ev = self.arrivals[key] = env.event()
                yield ev
            start = env.now
            if forward:
                work, calls = ch.t_fwd, ch.tp_fwd
            else:
                work, calls = ch.t_rec + ch.t_bwd, ch.tp_bwd
            planned = op_time(work, ch.tp, calls, self.hidden)
            bucket, n_buckets = c.buckets[g]
            if (not forward and bucket is not None and plan.overlap_grad_reduce
                    and (zero2 or last_b[local] == i)):
                for k in range(n_buckets):  # ready as backward walks the layers
                    self._stream(s, bucket, start + planned * (k + 1) / n_buckets,
                                 f"bucket {k} chunk {g}")
            yield from self._op(work, ch.tp, calls, ch.inline, forward)
            end = env.now
            busy += end - start
            self.spans.extend(self._op_spans(s, kind, mb, g, start, end))
            sent = None
            if forward and g < n_chunks - 1:
                sent = self._send(("F", mb, g + 1), s, (g + 1) % p)
            elif not forward and g > 0:
                sent = self._send(("B", mb, g - 1), s, (g - 1) % p)
            if sent is not None and self.c.software.blocking_p2p:
                yield sent
        if not plan.overlap_grad_reduce:
            for g in range(s, n_chunks, p):
                bucket, n_buckets = c.buckets[g]
                for k in range(n_buckets * (m if zero2 else 1) if bucket is not None else 0):
                    self._stream(s, bucket, env.now, f"bucket {k} chunk {g}")
        self.busy[s] = busy
        self.compute_end = max(self.compute_end, env.now)
        if self.stream_tail[s] is not None:
            yield self.stream_tail[s]
        tied = c.embedding_allreduce[s]
        if tied is not None:
            start = env.now
            yield self._flow(tied)
            self.spans.append((s, "dp", "comm", start, env.now, "allreduce tied embedding",
                               tied.nbytes))
        yield from self._optimizer(s)
        ends[s] = env.now

    def _send(self, key: tuple, src: int, dst: int) -> simpy.Event:
        ev = self.arrivals.get(key)
        if ev is None:
            ev = self.arrivals[key] = self.env.event()
        placed = self.c.p2p.get((src, dst))
        done = self._flow(placed)
        done.callbacks.append(partial(self._arrived, ev, key, src, self.env.now, placed))
        return ev

    def _arrived(self, ev: simpy.Event, key: tuple, src: int, start: float,
                 placed: Placed | None, _done: simpy.Event) -> None:
        self.spans.append((src, "p2p", "send", start, self.env.now,
                           (key[0], key[1], key[2] + (1 if key[0] == "B" else -1), "send"),
                           placed.nbytes if placed else 0.0))
        ev.succeed()

    def _optimizer(self, s: int) -> Generator:
        start = self.env.now
        yield self.env.timeout(self.c.optimizer_s[s])
        self.spans.append((s, "optimizer", "optimizer", start, self.env.now, "optimizer step",
                           0.0))
        gather = self.c.param_gather[s]
        if gather is not None and not self.c.software.overlap_param_gather:
            start = self.env.now
            yield self._flow(gather)
            self.spans.append((s, "dp", "comm", start, self.env.now, "allgather parameters",
                               gather.nbytes))

    # -- ZeRO-3 --------------------------------------------------------------------------
    def _chain(self, tail: list, placed: Placed | None, units: int, ready: simpy.Event | None,
               label: str, extra_s: float = 0.0, after: list | None = None) -> simpy.Event:
        """Queue ``units`` flows of ``placed`` on a stream whose last event is ``tail[0]``,
        after ``ready`` and then, if given, after the last event of the stream ``after``
        (as it is then), each ``extra_s`` longer (work besides the collective); return the
        event of their end."""
        prev, done = tail[0], self.env.event()
        tail[0] = done

        def body() -> Generator:
            if prev is not None:
                yield prev
            if ready is not None:
                yield ready
            while after is not None and units and after[0] is not None \
                    and not after[0].processed:
                yield after[0]  # a gather that synchronises waits for the reduces in flight
            start = self.env.now
            for _ in range(units):
                yield self._flow(placed, latency=extra_s if placed is not None else 0.0)
            self.spans.append((0, "dp", "comm", start, self.env.now, label,
                               (placed.nbytes if placed else 0.0) * units))
            done.succeed()

        self.env.process(body())
        return done

    def _zero3_stage(self, ends: list[float]) -> Generator:
        c, plan, env = self.c, self.plan, self.env
        ch = c.chunks[0]
        layers, units, k = ch.layers, c.zero3_units, plan.zero3_prefetch
        per_f = (ch.t_fwd - ch.head_fwd) / layers
        per_b = (ch.t_bwd - ch.head_bwd + ch.t_rec) / layers
        calls_f, calls_b = ch.tp_fwd // layers, ch.tp_bwd // layers
        counts_f, counts_b = c.zero3_gathers
        gather_tail: list = [None]
        reduce_tail: list = [None]
        busy = 0.0
        extra_g, extra_r = c.zero3_extra
        syncs = reduce_tail if c.software.zero3_gather_syncs else None
        for kind, mb, _ in self.schedule[0]:
            forward = kind == "F"
            gathered: list[simpy.Event] = []
            finished = [env.event() for _ in range(layers)]
            if forward:
                self._chain(gather_tail, extra_g, 1, None, f"F{mb} gather embedding",
                            c.zero3_gather_extra_s[1], syncs)
            for j in range(layers):  # layer j's gather may start once layer j - k - 1 is done
                gate = finished[j - k - 1] if j - k - 1 >= 0 else None
                gathered.append(self._chain(gather_tail, c.zero3_gather,
                                            counts_f[j] if forward else
                                            counts_b[layers - 1 - j], gate,
                                            f"{kind}{mb} gather layer {j}",
                                            c.zero3_gather_extra_s[0], syncs))
            t0 = env.now
            for j in range(layers):
                yield gathered[j]
                work = per_f if forward else per_b
                if not forward and j == 0:
                    work += ch.head_bwd
                yield from self._op(work, ch.tp, calls_f if forward else calls_b)
                finished[j].succeed()
                if not forward:
                    self._chain(reduce_tail, c.zero3_reduce, units, None,
                                f"B{mb} reduce layer {layers - 1 - j}")
            if forward:
                yield env.timeout(ch.head_fwd)
            else:
                self._chain(reduce_tail, extra_r, 1, None, f"B{mb} reduce embedding")
            busy += env.now - t0
            self.spans.append((0, "compute", "forward" if forward else "backward", t0, env.now,
                               f"{kind}{mb}", 0.0))
        self.busy[0] = busy
        self.compute_end = env.now
        for tail in (gather_tail, reduce_tail):
            if tail[0] is not None:
                yield tail[0]
        yield from self._optimizer(0)
        ends[0] = env.now
