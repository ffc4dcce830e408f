"""Simulate one training step: pipeline schedule, TP/DP/ZeRO communication, recompute, memory.

``simulate_step(model, cluster, plan)`` runs one data-parallel replica (replicas are identical,
so the cost of simulating does not grow with ``dp``) as a simpy process per pipeline stage
(``labsim.sim.pipeline``).  Each stage executes its op list from ``labsim.pipeline``:

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
reduce-scatter the gradients and all-gather the updated parameters after the optimizer step
(``reduce_gradients``).

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

from labsim import compute
from labsim.cluster import Cluster
from labsim.collectives.cost import collective_s, group_link, wire_bytes
from labsim.hardware import GPU
from labsim.memory import MemoryBreakdown, stage_params, training_memory
from labsim.plan import Plan
from labsim.sim.pipeline import (
    ChunkCost,
    CommSpan,
    RawSpan,
    StageStats,
    build_trace,
    run_pipeline,
    time_by_kind,
)
from labsim.trace import Trace
from labsim.workload import Transformer


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
    spans: list[RawSpan] = field(default_factory=list, repr=False, compare=False)

    @cached_property
    def trace(self) -> Trace:
        """The step's ``Trace`` (built from the raw spans on first access)."""
        return build_trace(self.spans, self.plan.virtual_stages > 1)

    @property
    def peak_memory_bytes(self) -> float:
        """Peak bytes per GPU (first pipeline stage)."""
        return float(self.memory.total)

    def __repr__(self) -> str:
        if self.memory is None:
            mem = "memory not estimated"
        else:
            mem = (f"memory {self.peak_memory_bytes / 1e9:.4g} GB of "
                   f"{self.gpu_memory_bytes / 1e9:.4g} GB: "
                   + ("fits" if self.fits else "DOES NOT FIT"))
        return (
            f"StepResult(step {self.step_time_s:.4g} s, {self.tokens_per_s:.4g} tokens/s, "
            f"{self.model_flops_per_gpu_s / 1e12:.4g} TFLOP/s/GPU, MFU {self.mfu:.1%}, "
            f"HFU {self.hfu:.1%}, bubble {self.bubble_fraction:.1%}, {mem})"
        )

    def _repr_html_(self) -> str:
        rows = [("step time", f"{self.step_time_s:.4g} s"),
                ("tokens/s", f"{self.tokens_per_s:,.0f}"),
                ("model TFLOP/s per GPU", f"{self.model_flops_per_gpu_s / 1e12:.1f}"),
                ("MFU / HFU", f"{self.mfu:.1%} / {self.hfu:.1%}"),
                ("pipeline bubble", f"{self.bubble_fraction:.1%}")]
        if self.memory is not None:
            m = self.memory
            rows.append(("memory per GPU (first stage)",
                         f"{m.total / 1e9:.3g} GB of {self.gpu_memory_bytes / 1e9:.3g} GB "
                         f"({'fits' if self.fits else '<b>does not fit</b>'}): params "
                         f"{m.params / 1e9:.3g}, grads {m.grads / 1e9:.3g}, optimizer "
                         f"{m.optimizer / 1e9:.3g}, activations {m.activations / 1e9:.3g} GB"))
        rows += [(f"stage 0: {k}", f"{v:.4g} s") for k, v in
                 sorted(self.breakdown.items(), key=lambda kv: -kv[1])]
        body = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
        return f"<table><caption>training step</caption>{body}</table>"


def _chunk_costs(model: Transformer, plan: Plan, gpu: GPU, cluster: Cluster) -> list[ChunkCost]:
    lc = compute.layer_cost(model, plan.micro_batch, gpu, tp=plan.tp,
                            sequence_parallel=plan.sequence_parallel, recompute=plan.recompute,
                            attention=plan.attention, precision=plan.numerics)
    e = plan.bytes_per_element
    n_chunks = plan.pp * plan.virtual_stages
    per_chunk = int(model.layers) // n_chunks
    tp_link = group_link(cluster, plan.tp, 1)
    if plan.sequence_parallel:  # reduce-scatter + all-gather of the same volume
        one = (collective_s("reduce_scatter", lc.tp_bytes, plan.tp, tp_link)
               + collective_s("allgather", lc.tp_bytes, plan.tp, tp_link))
    else:
        one = collective_s("allreduce", lc.tp_bytes, plan.tp, tp_link)
    tp_fwd = lc.tp_collectives * one
    tp_rec = tp_fwd if plan.recompute == "full" else 0.0
    lp = model.params_per_layer / plan.tp  # (norms and row-parallel biases: a rounding)
    # ZeRO-3: all-gather each layer's parameters before its forward and its backward, and
    # reduce-scatter its gradients after backward, on a stream that prefetches one layer ahead:
    # only what exceeds the layer's compute, and the first layer's gather, is exposed.  The
    # embedding / output layer of the first and last chunk is gathered without prefetch.
    dp_link = group_link(cluster, plan.dp, plan.tp)
    zero3 = plan.zero_stage == 3 and plan.dp > 1

    def z3(nbytes: float, op: str) -> float:
        return collective_s(op, nbytes, plan.dp, dp_link) if zero3 else 0.0

    ag, rs = z3(lp * e, "allgather"), z3(lp * e, "reduce_scatter")
    z3_f = ag + max(0.0, ag - lc.forward.time_s) * (per_chunk - 1)
    z3_b = ag + max(0.0, ag + rs - lc.backward.time_s - lc.recompute.time_s) * (
        per_chunk - 1) + rs
    head_f, head_b = compute.logits_cost(model, plan.micro_batch, gpu, tp=plan.tp,
                                          precision=plan.numerics)
    chunks = []
    for g in range(n_chunks):
        extra_f = head_f if g == n_chunks - 1 else compute.PassCost()
        extra_b = head_b if g == n_chunks - 1 else compute.PassCost()
        params = stage_params(model, tp=plan.tp, pp=n_chunks, stage=g)
        extra = max(0.0, params - per_chunk * lp) * e  # embedding, output layer, final norm
        z3_extra_f = z3(extra, "allgather")
        z3_extra_b = z3_extra_f + z3(extra, "reduce_scatter")
        chunks.append(ChunkCost(
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
    same = cluster.same_node_ranks(src * stride, dst * stride)
    lk = cluster.intra_node if same else cluster.nic_link_per_gpu
    return lk.latency_s + nbytes / lk.achieved_Bps


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
        model, precision=plan.numerics,
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
    gpus = cluster.world_size
    plan.validate_for(model, gpus)
    gpu = cluster.gpu
    chunks = _chunk_costs(model, plan, gpu, cluster)
    p = plan.pp
    p2p = {}
    for g in range(p * plan.virtual_stages - 1):
        a, b = g % p, (g + 1) % p
        p2p[(a, b)] = _p2p_time(cluster, plan, model, a, b)
        p2p[(b, a)] = _p2p_time(cluster, plan, model, b, a)
    spans: list[RawSpan] = []
    stats = run_pipeline(plan.schedule, p, plan.microbatches, plan.virtual_stages, chunks, p2p,
                         spans)
    pipeline_end = max(st.last_s for st in stats)
    ends = reduce_gradients(plan, cluster, chunks, stats, gpu, spans)
    zero3_traffic(plan, chunks, spans)
    step = max(ends)

    m = plan.microbatches
    flops_model = plan.dp * m * plan.tp * sum(c.flops_model for c in chunks)
    flops_hw = plan.dp * m * plan.tp * sum(c.flops_hw for c in chunks)
    peak = gpu.peak(plan.numerics.peak_dtype(gpu)) * gpus
    bubble = sum(1.0 - st.busy_s / pipeline_end for st in stats) / p
    mem = _memory(model, plan, stats[0].in_flight) if memory else None
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
        breakdown=time_by_kind(spans, 0),
        spans=spans,
    )


def reduce_gradients(plan: Plan, cluster: Cluster, chunks: list[ChunkCost],
                     stats: list[StageStats], gpu: GPU, spans: list[RawSpan]) -> list[float]:
    """Data-parallel gradient reduction and optimizer step per stage; return each stage's end.

    Buckets of a chunk become ready as its last backward walks the layers in reverse (overlap)
    or all at the stage's last backward (no overlap); one communication stream per stage runs
    them in order.  ZeRO-1/2 reduce-scatter instead of all-reduce and all-gather the updated
    parameters after the optimizer; ZeRO-3 reduced its gradients inside backward already.
    """
    p, dp = plan.pp, plan.dp
    link = group_link(cluster, dp, plan.tp)
    op = "allreduce" if plan.zero_stage == 0 else "reduce_scatter"
    shard = dp if plan.zero_stage >= 1 else 1
    ends = []
    for s in range(p):
        st = stats[s]
        free = st.last_s
        comm_free = 0.0
        params = 0.0
        for g, (b_start, b_end) in sorted(st.last_backward.items(), key=lambda kv: kv[1]):
            c = chunks[g]
            params += c.param_bytes / plan.bytes_per_element
            if plan.zero_stage == 3 or dp == 1:
                continue
            n_buckets = max(1, int(-(-c.grad_bytes // plan.bucket_bytes)))
            size = c.grad_bytes / n_buckets
            t_bucket = collective_s(op, size, dp, link)
            for k in range(n_buckets):
                if plan.overlap_grad_reduce:
                    ready = b_start + (b_end - b_start) * (k + 1) / n_buckets
                else:
                    ready = st.last_s
                start = max(ready, comm_free)
                comm_free = start + t_bucket
                spans.append(CommSpan(s, "dp", "comm", start, comm_free,
                                      f"{op} bucket {k} chunk {g}", size,
                                      {"wire_bytes": wire_bytes(op, size, dp), "op": op}))
        t0 = max(free, comm_free)
        t_opt = compute.optimizer_time(params / shard, gpu, plan.optimizer)
        spans.append(CommSpan(s, "optimizer", "optimizer", t0, t0 + t_opt, "optimizer step"))
        end = t0 + t_opt
        if plan.zero_stage in (1, 2) and dp > 1:
            nbytes = params * plan.bytes_per_element
            t_ag = collective_s("allgather", nbytes, dp, link)
            spans.append(CommSpan(
                s, "dp", "comm", end, end + t_ag, "allgather parameters", nbytes,
                {"wire_bytes": wire_bytes("allgather", nbytes, dp), "op": "allgather"}))
            end += t_ag
        ends.append(end)
    return ends


def zero3_traffic(plan: Plan, chunks: list[ChunkCost], spans: list[RawSpan]) -> None:
    """Record ZeRO-3's per-micro-batch traffic (all-gather before forward and before backward,
    reduce-scatter after backward) as zero-length accounting spans on stage 0's dp stream."""
    if plan.zero_stage != 3 or plan.dp == 1:
        return
    nbytes = sum(c.param_bytes for c in chunks)
    for i in range(plan.microbatches):
        for op in ("allgather", "allgather", "reduce_scatter"):
            spans.append(CommSpan(0, "dp", "comm", 0.0, 0.0, f"ZeRO-3 {op} mb {i}", nbytes,
                                  {"wire_bytes": wire_bytes(op, nbytes, plan.dp), "op": op}))


