"""Simulate one training step: pipeline schedule, TP/DP/ZeRO communication, recompute, memory.

``simulate_step(model, cluster, plan)`` runs one data-parallel replica (replicas are identical,
so the cost of simulating does not grow with ``dp``) as a simpy process per pipeline stage.
Each stage executes its op list from ``labsim.parallel.pipeline``:

* a forward or backward op lasts its chunk's compute (``labsim.compute``) plus the blocking
  tensor-parallel collectives of its layers (Megatron-LM: two all-reduces per layer forward and
  two backward, or reduce-scatter + all-gather with sequence parallelism; repeated by full
  recomputation), plus ZeRO-3's parameter all-gathers where prefetching cannot hide them;
* it starts when its input has arrived: activations from the previous stage (forward) or
  gradients from the next (backward), sent point to point over the link between the two
  stages' nodes, one message at a time per direction, ``b s h / tp`` bytes per GPU (Megatron's
  scatter-gather over the TP ranks' NICs).

After a stage's last backward of a model chunk its gradients are final (gradient accumulation):
they are reduced over the data-parallel group in ``bucket_bytes`` buckets on a communication
stream, overlapped with the rest of backward when ``overlap_grad_reduce`` (buckets complete as
backward walks the layers in reverse), otherwise after the stage's last backward.  ZeRO-1/2
reduce-scatter the gradients and all-gather the updated parameters after the optimizer step.

Simplifications (stated so the numbers can be judged): collectives of different groups do not
contend for links; the optimizer step and the all-gather after it are not overlapped; the
embedding-gradient all-reduce between first and last stage and the loss all-reduce are ignored.

Trace: ``rank`` is the pipeline stage (TP rank 0 of replica 0); streams ``compute`` (forward,
backward, recompute, and ``comm`` spans for TP and ZeRO-3 collectives), ``p2p`` (``send``) and
``dp`` (gradient reduction, ``comm``), and ``optimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import simpy

from labsim import compute
from labsim.cluster import Cluster
from labsim.collectives import collective_time
from labsim.hardware import GPU, Link
from labsim.hardware import gpu as lookup_gpu
from labsim.memory import MemoryBreakdown, stage_params, training_memory
from labsim.parallel.pipeline import Op, make_schedule, max_in_flight
from labsim.plan import Plan
from labsim.trace import Trace
from labsim.workload import Transformer

_WIRE_FACTOR = {"allreduce": 2.0, "reduce_scatter": 1.0, "allgather": 1.0}


def _collective_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """Closed-form ring collective time (``labsim.collectives``); zero for a group of one."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return collective_time(op, int(round(nbytes)), n, link)


def _wire_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes each GPU sends in a ring collective of an ``nbytes`` buffer over ``n`` GPUs."""
    return _WIRE_FACTOR[op] * (n - 1) / n * nbytes if n > 1 else 0.0


def _node_link(cluster: Cluster) -> Link:
    """The inter-node link as one GPU sees it: its share of the node's NICs."""
    share = min(1.0, cluster.nics_per_node / cluster.gpus_per_node)
    lk = cluster.inter_node
    return replace(lk, bandwidth_Bps=lk.bandwidth_Bps * share) if share < 1 else lk


def _group_link(cluster: Cluster, size: int, stride: int) -> Link:
    """The link a ring over ``size`` GPUs whose ranks are ``stride`` apart runs at.

    Inside one node: the intra-node link.  Across nodes: NCCL runs one ring channel per NIC
    the group's GPUs in a node use, so the inter-node bandwidth is that many NICs (capped by
    the intra-node link).  Equals ``labsim.collectives.collective_time_on`` on the group's
    ranks for ring collectives (tested) at O(1) cost, so the cost of simulating a step does
    not grow with dp.
    """
    g = cluster.gpus_per_node
    if (size - 1) * stride + 1 <= g:
        return cluster.intra_node
    local = list(range(0, g, stride))[:size] if stride < g else [0]
    nics = len({i * cluster.nics_per_node // g for i in local})
    inter = cluster.inter_node
    cap = cluster.intra_node.achieved_Bps / inter.nccl_efficiency
    return replace(inter, bandwidth_Bps=min(nics * inter.bandwidth_Bps, cap))


@dataclass(frozen=True)
class StepResult:
    """Outcome of ``simulate_step``.

    step_time_s: one optimizer step; tokens_per_s: global tokens per second;
    model_flops_per_gpu_s: model FLOP/s per GPU (no recomputation counted);
    mfu / hfu: model / hardware FLOPs utilisation against the dense peak;
    bubble_fraction: idle fraction of the stages' compute stream from the step's start to
        the last backward, averaged over stages;
    memory: ``MemoryBreakdown`` of the first stage's GPU;
    fits: memory.total <= GPU memory; breakdown: seconds by kind on stage 0;
    trace: a ``Trace`` of every op, message, bucket and optimizer step (built lazily, since
        a large pipeline has hundreds of thousands of spans).
    """

    step_time_s: float
    tokens_per_s: float
    model_flops_per_gpu_s: float
    mfu: float
    hfu: float
    bubble_fraction: float
    memory: MemoryBreakdown | None
    fits: bool
    gpu_memory_bytes: float
    plan: Plan = field(repr=False)
    breakdown: dict = field(default_factory=dict, repr=False)
    spans: list = field(default_factory=list, repr=False, compare=False)

    @cached_property
    def trace(self) -> Trace:
        """The step's ``Trace`` (built from the raw spans on first access)."""
        return _build_trace(self.spans, self.plan.virtual_stages > 1)

    @property
    def peak_memory_bytes(self) -> float:
        """Peak bytes per GPU (first pipeline stage)."""
        return float(self.memory.total)

    def __repr__(self) -> str:
        fit = "fits" if self.fits else "DOES NOT FIT"
        return (
            f"StepResult(step {self.step_time_s:.4g} s, {self.tokens_per_s:.4g} tokens/s, "
            f"{self.model_flops_per_gpu_s / 1e12:.4g} TFLOP/s/GPU, MFU {self.mfu:.1%}, "
            f"HFU {self.hfu:.1%}, bubble {self.bubble_fraction:.1%}, memory "
            f"{self.peak_memory_bytes / 1e9:.4g} GB of {self.gpu_memory_bytes / 1e9:.4g} GB: "
            f"{fit})"
        )


@dataclass(frozen=True)
class _Chunk:
    """Per-op durations and FLOPs of one model chunk (global index) on one GPU."""

    t_fwd: float
    t_bwd: float
    t_rec: float
    comm_fwd: float  # blocking TP / ZeRO-3 communication inside a forward op
    comm_bwd: float
    flops_hw: float  # forward + recompute + backward FLOPs executed
    flops_model: float
    grad_bytes: float  # gradient bytes of this chunk on one GPU
    param_bytes: float


def _chunk_costs(model: Transformer, plan: Plan, gpu: GPU, cluster: Cluster) -> list[_Chunk]:
    dtype = "fp32" if plan.precision == "fp32" else plan.precision
    lc = compute.layer_cost(model, plan.micro_batch, gpu, tp=plan.tp,
                            sequence_parallel=plan.sequence_parallel, recompute=plan.recompute,
                            attention=plan.attention, dtype=dtype)
    e = plan.bytes_per_element
    n_chunks = plan.pp * plan.virtual_stages
    per_chunk = int(model.layers) // n_chunks
    tp_link = _group_link(cluster, plan.tp, 1)
    if plan.sequence_parallel:  # reduce-scatter + all-gather of the same volume
        one = (_collective_time("reduce_scatter", lc.tp_bytes, plan.tp, tp_link)
               + _collective_time("allgather", lc.tp_bytes, plan.tp, tp_link))
    else:
        one = _collective_time("allreduce", lc.tp_bytes, plan.tp, tp_link)
    tp_fwd = lc.tp_collectives * one
    tp_rec = tp_fwd if plan.recompute == "full" else 0.0
    lp = model.params_per_layer / plan.tp  # (norms and row-parallel biases: a rounding)
    # ZeRO-3: all-gather each layer's parameters before its forward and its backward, and
    # reduce-scatter its gradients after backward, on a stream that prefetches one layer ahead:
    # only what exceeds the layer's compute, and the first layer's gather, is exposed.  The
    # embedding / output layer of the first and last chunk is gathered without prefetch.
    dp_link = _group_link(cluster, plan.dp, plan.tp)
    zero3 = plan.zero_stage == 3 and plan.dp > 1

    def z3(nbytes: float, op: str) -> float:
        return _collective_time(op, nbytes, plan.dp, dp_link) if zero3 else 0.0

    ag, rs = z3(lp * e, "allgather"), z3(lp * e, "reduce_scatter")
    z3_f = ag + max(0.0, ag - lc.forward.time_s) * (per_chunk - 1)
    z3_b = ag + max(0.0, ag + rs - lc.backward.time_s - lc.recompute.time_s) * (
        per_chunk - 1) + rs
    head_f, head_b = compute.logits_cost(model, plan.micro_batch, gpu, tp=plan.tp, dtype=dtype)
    chunks = []
    for g in range(n_chunks):
        extra_f = head_f if g == n_chunks - 1 else compute.PassCost()
        extra_b = head_b if g == n_chunks - 1 else compute.PassCost()
        params = stage_params(model, tp=plan.tp, pp=n_chunks, stage=g)
        extra = max(0.0, params - per_chunk * lp) * e  # embedding, output layer, final norm
        z3_extra_f = z3(extra, "allgather")
        z3_extra_b = z3_extra_f + z3(extra, "reduce_scatter")
        chunks.append(_Chunk(
            t_fwd=per_chunk * lc.forward.time_s + extra_f.time_s,
            t_bwd=per_chunk * lc.backward.time_s + extra_b.time_s,
            t_rec=per_chunk * lc.recompute.time_s,
            comm_fwd=per_chunk * tp_fwd + z3_f + z3_extra_f,
            comm_bwd=per_chunk * (tp_fwd + tp_rec) + z3_b + z3_extra_b,
            flops_hw=per_chunk * (lc.forward.flops + lc.backward.flops + lc.recompute.flops)
            + extra_f.flops + extra_b.flops,
            flops_model=per_chunk * lc.model_flops + extra_f.flops + extra_b.flops,
            grad_bytes=params * e,
            param_bytes=params * e,
        ))
    return chunks


def _p2p_time(cluster: Cluster, plan: Plan, model: Transformer, src: int, dst: int) -> float:
    """One activation (or activation-gradient) message from stage ``src`` to ``dst``."""
    e = plan.bytes_per_element
    nbytes = plan.micro_batch * int(model.seq_len) * int(model.hidden) * e / plan.tp
    stride = plan.tp * plan.dp  # Megatron rank order: tp fastest, then dp, then pp
    same_node = (src * stride) // cluster.gpus_per_node == (dst * stride) // cluster.gpus_per_node
    lk = cluster.intra_node if same_node else _node_link(cluster)
    return lk.latency_s + nbytes / lk.achieved_Bps


def _run_pipeline(schedule_name: str, p: int, m: int, v: int, chunks: list[_Chunk], p2p: dict,
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
    # when the receiver asked first, the event it waits on.
    def send(key: tuple, src: int, dst: int, now: float) -> None:
        start = max(now, link_free.get((src, dst), 0.0))
        end = start + p2p[(src, dst)]
        link_free[(src, dst)] = end
        record((src, "p2p", "send", start, end, key))
        waiting = arrivals.get(key)
        if waiting is None:
            arrivals[key] = end
        else:  # the receiver is already blocked on this message
            timeout(end - now).callbacks.append(lambda _e, w=waiting: w.succeed())

    def stage(s: int, ops: tuple[Op, ...]):
        busy = 0.0
        first = None
        last_bwd = stats[s]["last_bwd"]
        for kind, mb, chunk in ops:
            g = chunk * p + s
            c = chunks[g]
            forward = kind == "F"
            now = env.now
            ready = now
            if (g > 0) if forward else (g < n_chunks - 1):
                key = (kind, mb, g)
                arrival = arrivals.pop(key, None)
                if arrival is None:  # not sent yet: wait for it
                    arrivals[key] = ev = event()
                    yield ev
                    now = ready = env.now
                elif arrival > now:
                    ready = arrival
            if forward:
                work, comm = c.t_fwd, c.comm_fwd
            else:
                work, comm = c.t_rec + c.t_bwd, c.comm_bwd
            start = ready
            end = start + work + comm
            yield timeout(end - now)  # wait for the message (if in flight) and compute
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
        stats[s].update(busy=busy, first=first, last=env.now)

    for s in range(p):
        env.process(stage(s, schedule[s]))
    env.run()
    for s in range(p):
        stats[s]["in_flight"] = max_in_flight(schedule[s])
    return stats


def _time_by_kind(spans: list, rank: int) -> dict[str, float]:
    """Seconds per span kind on ``rank`` (what ``Trace.time_by_kind`` gives, without the
    trace)."""
    totals: dict[str, float] = {}
    for r, _stream, kind, start, end, _what in spans:
        if r == rank:
            totals[kind] = totals.get(kind, 0.0) + end - start
    return totals


def _build_trace(spans: list, chunked: bool) -> Trace:
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
        return _build_trace(self.spans, False)


def simulate_pipeline(p: int, m: int, t_f: float, t_b: float, *, schedule: str = "1f1b",
                      v: int = 1, p2p_s: float = 0.0) -> PipelineResult:
    """Run a pipeline schedule on ``p`` uniform stages: each stage's forward of one micro-batch
    takes ``t_f`` and its backward ``t_b`` (split evenly over ``v`` chunks when interleaved),
    every point-to-point message ``p2p_s``.  With ``p2p_s = 0`` GPipe and 1F1B take
    ``pipeline_time(p, m, t_f, t_b)``."""
    chunk = _Chunk(t_f / v, t_b / v, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    links = {(a, b): p2p_s for a in range(p) for b in range(p)}
    spans: list = []
    stats = _run_pipeline(schedule, p, m, v, [chunk] * (p * v), links, spans)
    end = max(st["last"] for st in stats)
    bubble = sum(1.0 - st["busy"] / end for st in stats) / p
    return PipelineResult(end, bubble, tuple(st["in_flight"] for st in stats), spans)


def _reduce_gradients(plan: Plan, cluster: Cluster, chunks: list[_Chunk], stats: list[dict],
                      gpu: GPU, spans: list) -> list[float]:
    """Data-parallel gradient reduction and optimizer step per stage; return each stage's end.

    Buckets of a chunk become ready as its last backward walks the layers in reverse (overlap)
    or all at the stage's last backward (no overlap); one communication stream per stage runs
    them in order.  ZeRO-1/2 reduce-scatter instead of all-reduce and all-gather the updated
    parameters after the optimizer; ZeRO-3 reduced its gradients inside backward already.
    """
    p, dp = plan.pp, plan.dp
    link = _group_link(cluster, dp, plan.tp)
    op = "allreduce" if plan.zero_stage == 0 else "reduce_scatter"
    shard = dp if plan.zero_stage >= 1 else 1
    ends = []
    for s in range(p):
        st = stats[s]
        free = st["last"]
        comm_free = 0.0
        params = 0.0
        for g, (b_start, b_end) in sorted(st["last_bwd"].items(), key=lambda kv: kv[1]):
            c = chunks[g]
            params += c.param_bytes / plan.bytes_per_element
            if plan.zero_stage == 3 or dp == 1:
                continue
            n_buckets = max(1, int(-(-c.grad_bytes // plan.bucket_bytes)))
            size = c.grad_bytes / n_buckets
            t_bucket = _collective_time(op, size, dp, link)
            for k in range(n_buckets):
                if plan.overlap_grad_reduce:
                    ready = b_start + (b_end - b_start) * (k + 1) / n_buckets
                else:
                    ready = st["last"]
                start = max(ready, comm_free)
                comm_free = start + t_bucket
                spans.append((s, "dp", "comm", start, comm_free, [
                    f"{op} bucket {k} chunk {g}", size,
                    {"wire_bytes": _wire_bytes(op, size, dp), "op": op}]))
        t0 = max(free, comm_free)
        t_opt = compute.optimizer_time(params / shard, gpu, plan.optimizer)
        spans.append((s, "optimizer", "optimizer", t0, t0 + t_opt, ["optimizer step", 0.0, {}]))
        end = t0 + t_opt
        if plan.zero_stage in (1, 2) and dp > 1:
            nbytes = params * plan.bytes_per_element
            t_ag = _collective_time("allgather", nbytes, dp, link)
            spans.append((s, "dp", "comm", end, end + t_ag, [
                "allgather parameters", nbytes,
                {"wire_bytes": _wire_bytes("allgather", nbytes, dp), "op": "allgather"}]))
            end += t_ag
        ends.append(end)
    return ends


def _zero3_trace(plan: Plan, chunks: list[_Chunk], spans: list) -> None:
    """Record ZeRO-3's per-micro-batch traffic (all-gather before forward and before backward,
    reduce-scatter after backward) as zero-length accounting spans on stage 0's dp stream."""
    if plan.zero_stage != 3 or plan.dp == 1:
        return
    nbytes = sum(c.param_bytes for c in chunks)
    for i in range(plan.microbatches):
        for op in ("allgather", "allgather", "reduce_scatter"):
            spans.append((0, "dp", "comm", 0.0, 0.0, [
                f"ZeRO-3 {op} mb {i}", nbytes,
                {"wire_bytes": _wire_bytes(op, nbytes, plan.dp), "op": op}]))


def _memory(model: Transformer, plan: Plan, in_flight: int) -> MemoryBreakdown:
    """Memory of the first stage's GPU: its model-state shard (``training_memory``) and its
    peak activations (``activation_memory``, Korthikanti et al. 2022), rescaled from 1F1B's
    in-flight count to what this schedule holds (GPipe: all m micro-batches)."""
    v = plan.virtual_stages
    # FlashAttention keeps no s x s scores for backward (only O(s) softmax statistics): the
    # 5as/h term of Korthikanti's Table 2 vanishes, as with selective recomputation.
    recompute = plan.recompute
    if plan.attention == "flash" and recompute == "none":
        recompute = "selective"
    mem = training_memory(
        model, precision="fp32" if plan.precision == "fp32" else "mixed",
        optimizer=plan.optimizer, zero_stage=plan.zero_stage, dp=plan.dp,
        micro_batch=plan.micro_batch, tp=plan.tp, pp=plan.pp,
        sequence_parallel=plan.sequence_parallel, recompute=recompute, virtual_stages=v)
    # 1F1B holds p micro-batches of one chunk on stage 0; interleaved 1F1B holds
    # 2(p - 1) + (v - 1) p + 1 (micro-batch, chunk) pairs = the 1 + (p - 1)/(p v) factor.
    expected = (plan.pp - 1) * 2 + (v - 1) * plan.pp + 1 if v > 1 else plan.pp
    return replace(mem, activations=mem.activations * in_flight / expected)


def simulate_step(model: Transformer, cluster: Cluster, plan: Plan, *,
                  memory: bool = True) -> StepResult:
    """Simulate one optimizer step of ``model`` (a ``labsim.Transformer``) on ``cluster``
    (a ``labsim.Cluster``) under ``plan``; see the module docstring for what is modelled.
    ``memory=False`` skips the memory estimate (``StepResult.memory`` is then None)."""
    gpus = int(cluster.nodes) * int(cluster.gpus_per_node)
    plan.validate_for(model, gpus)
    gpu = lookup_gpu(cluster.gpu)
    chunks = _chunk_costs(model, plan, gpu, cluster)
    p = plan.pp
    p2p = {}
    for g in range(p * plan.virtual_stages - 1):
        a, b = g % p, (g + 1) % p
        p2p[(a, b)] = _p2p_time(cluster, plan, model, a, b)
        p2p[(b, a)] = _p2p_time(cluster, plan, model, b, a)
    spans: list = []
    stats = _run_pipeline(plan.schedule, p, plan.microbatches, plan.virtual_stages, chunks, p2p,
                          spans)
    pipeline_end = max(st["last"] for st in stats)
    ends = _reduce_gradients(plan, cluster, chunks, stats, gpu, spans)
    _zero3_trace(plan, chunks, spans)
    step = max(ends)

    m = plan.microbatches
    flops_model = plan.dp * m * plan.tp * sum(c.flops_model for c in chunks)
    flops_hw = plan.dp * m * plan.tp * sum(c.flops_hw for c in chunks)
    dtype = "tf32" if plan.precision == "fp32" and "tf32" in gpu.peak_flops else plan.precision
    peak = gpu.peak(dtype) * gpus
    bubble = sum(1.0 - st["busy"] / pipeline_end for st in stats) / p
    mem = _memory(model, plan, stats[0]["in_flight"]) if memory else None
    fits = mem is None or mem.total <= gpu.memory_bytes
    return StepResult(
        step_time_s=step,
        tokens_per_s=plan.global_batch * int(model.seq_len) / step,
        model_flops_per_gpu_s=flops_model / step / gpus,
        mfu=flops_model / step / peak,
        hfu=flops_hw / step / peak,
        bubble_fraction=bubble,
        memory=mem,
        fits=fits,
        gpu_memory_bytes=gpu.memory_bytes,
        plan=plan,
        breakdown=_time_by_kind(spans, 0),
        spans=spans,
    )
