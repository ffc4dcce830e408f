"""A training step as values: what every op costs, where its bytes go, and the closed form.

``step_costs(model, cluster, plan)`` prices one step once, for both faces:

* **compute** per model chunk (``labsim.compute``: GEMMs, attention, memory-bound kernels, at
  the software profile's sustained fraction), forward, backward and recompute, each longer by
  what the collectives that run beside it cost it (``contended_chunks``);
* **communication**, each a ``Placed`` collective: NCCL's choice and cost
  (``labsim.collectives.nccl``) of the tensor-parallel collectives of a layer, the pipeline
  sends between stages, the data-parallel gradient buckets, ZeRO-1/2's parameter all-gather,
  ZeRO-3's per-layer (or per-tensor) all-gathers and gradient reduce-scatters, and the
  all-reduce of a tied embedding's gradient between the first and the last stage -- and the
  pipes of the **folded network** they load.

The folded network: the replicas of a plan are symmetric, so only one data-parallel replica
is simulated and each pipeline stage is represented by one GPU (tensor rank 0 of replica 0).
Its pipes are that GPU's port into its node's switch (tx, rx) and its NIC (tx, rx); a NIC's
load counts every GPU of the stage on that node that uses it at the same time (all replicas and
tensor ranks do the same thing at once), and stages whose GPUs share a node and NIC share that
NIC's pipes.  Tensor-parallel, pipeline and data-parallel traffic of a stage therefore meet on
the same pipes, in the closed form's accounting and in the simulation (``labsim.sim.step``).

``estimate_step`` (below) is the closed-form face;
``labsim.simulate_step`` the simulated one.  Rank layout (Megatron-LM): tensor-parallel
fastest, then data-parallel, then pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import NamedTuple

import numpy as np

from labsim import compute
from labsim.bands import ErrorBand, error_band
from labsim.cluster import Cluster
from labsim.collectives.group import Group, group_of, strided_group
from labsim.collectives.nccl import CollectiveCost, plan_collective
from labsim.hardware import GPU
from labsim.memory import MemoryBreakdown, stage_params, zero3_unit_params
from labsim.network import FoldedNetwork, Placed, shared_fractions, shared_growth
from labsim.plan import Plan
from labsim.software import SoftwareProfile, profile
from labsim.trace import Span, Trace
from labsim.uncontended import (
    alone_schedule,
    bucket_growth,
    op_time,
    zero3_fluid,
    zero3_tp_flows,
)
from labsim.workload import Transformer


class ChunkCost(NamedTuple):
    """One model chunk (a pipeline stage's layers of one virtual stage) on one GPU: compute
    seconds per micro-batch, FLOPs, parameters, and its tensor-parallel collectives (a
    tuple: a step builds one per chunk, 64 for a 64-stage plan, and tuples build fast)."""

    layers: int
    t_fwd: float  # every layer's forward (and the head's on the last chunk)
    t_bwd: float
    t_rec: float
    head_fwd: float  # the output layer and loss (last chunk only; included in t_fwd)
    head_bwd: float
    flops_hw: float
    flops_model: float
    params: float  # parameters on one GPU of this chunk (tensor-parallel shard)
    tp: Placed | None  # one TP collective (SP: reduce-scatter + all-gather counted as 2)
    tp_fwd: int  # TP collectives in a forward pass of the chunk
    tp_bwd: int  # in a backward pass (recompute included)


@dataclass(frozen=True)
class StepCosts:
    """Everything a step's two faces need (module doc); built by ``step_costs``."""

    model: Transformer
    cluster: Cluster
    plan: Plan
    software: SoftwareProfile
    sustained: float
    capacity: np.ndarray = field(repr=False)
    chunks: tuple[ChunkCost, ...]
    p2p: dict[tuple[int, int], Placed]
    buckets: tuple[tuple[Placed | None, int], ...]  # per model chunk: (one bucket, count)
    param_gather: tuple[Placed | None, ...]  # per stage (ZeRO-1/2 after the optimizer)
    optimizer_s: tuple[float, ...]  # per stage
    # per stage: the tied embedding's gradient all-reduce (first and last stage, pp > 1)
    embedding_allreduce: tuple[Placed | None, ...]
    zero3_gather: Placed | None  # one unit (layer or tensor) of ZeRO-3
    zero3_reduce: Placed | None
    zero3_units: int  # units per layer
    zero3_extra: tuple[Placed | None, Placed | None]  # embedding/head gather and reduce
    # seconds each ZeRO-3 gather costs besides its collective: (one unit, the embedding's);
    # the profile's host work per rank and extra HBM passes (``labsim.software``)
    zero3_gather_extra_s: tuple[float, float] = (0.0, 0.0)
    # per layer, the units gathered before its forward and before its backward (recomputed
    # forward included) in one micro-batch, after the profile's reuse (``zero3_gathers``)
    zero3_gathers: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    @property
    def stages(self) -> int:
        return self.plan.pp

    @property
    def tp_hidden(self) -> float:
        """Share of the TP collectives that runs under the GEMMs: the profile's with
        ``tp_comm_overlap``, and none when the TP group leaves a node.  Transformer Engine's
        userbuffers are CUDA multicast / IPC buffers inside one NVLink domain
        (``transformer_engine/pytorch/module/base.py`` ``initialize_ub``: NVLink domains by
        host name), so a TP group across nodes communicates without that overlap."""
        return _tp_hidden(self.plan, self.cluster, self.software)

    @cached_property
    def flops(self) -> tuple[float, float]:
        """(model FLOPs, hardware FLOPs) of the whole step on all GPUs."""
        p = self.plan
        scale = p.dp * p.microbatches * p.tp
        return (scale * sum(c.flops_model for c in self.chunks),
                scale * sum(c.flops_hw for c in self.chunks))


def _tp_hidden(plan: Plan, cluster: Cluster, soft: SoftwareProfile) -> float:
    if not plan.tp_comm_overlap or plan.tp > cluster.gpus_per_node:
        return 0.0
    return soft.tp_overlap_hidden


def _check(model: object, cluster: object, plan: object) -> None:
    if not isinstance(model, Transformer):
        raise ValueError(f"model must be a labsim.Transformer (e.g. Transformer.preset("
                         f"'gpt3-175b')), got {type(model).__name__}")
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a labsim.Cluster (e.g. labsim.dgx_a100(4)), got "
                         f"{type(cluster).__name__}")
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a labsim.Plan (e.g. Plan(dp=8)), got "
                         f"{type(plan).__name__}")
    plan.validate_for(model, cluster.world_size)


def step_costs(model: Transformer, cluster: Cluster, plan: Plan) -> StepCosts:
    """Price one step of ``model`` on ``cluster`` under ``plan`` (module doc)."""
    _check(model, cluster, plan)
    soft = profile(plan.software)
    gpu = cluster.gpu
    su = soft.sustained_for(gpu)
    net = FoldedNetwork(cluster, plan)
    tp_group = strided_group(cluster, plan.tp, 1)
    dp_group = strided_group(cluster, plan.dp, plan.tp)
    chunks = _chunks(model, plan, gpu, su, cluster, net, tp_group)
    p2p = _pipeline_sends(model, plan, cluster, net)
    precision = plan.numerics
    buckets, gathers, opt = [], [], []
    zero3 = plan.zero_stage == 3 and plan.dp > 1
    op = ("allreduce" if plan.zero_stage == 0
          or (plan.zero_stage == 1 and soft.zero1_grad_op == "allreduce") else "reduce_scatter")
    dp_place = _Placer(net, dp_group, soft.dp_nccl_algo)
    split: dict[float, tuple[int, int]] = {}  # a chunk's gradient: (bucket bytes, count)
    for g, ch in enumerate(chunks):
        if plan.dp > 1 and not zero3:
            if ch.params not in split:
                grad_bytes = ch.params * precision.grad_bytes
                count = max(1, math.ceil(grad_bytes / plan.bucket_bytes))
                split[ch.params] = (round(grad_bytes / count), count)
            nbytes, count = split[ch.params]
            buckets.append((dp_place(op, nbytes, g % plan.pp), count))
        else:
            buckets.append((None, 0))
    shard = plan.dp if plan.zero_stage >= 1 else 1
    stepped: dict[float, float] = {}  # the optimizer's seconds by a stage's parameters
    for s in range(plan.pp):
        params = sum([ch.params for ch in chunks[s::plan.pp]])
        gathers.append(dp_place("allgather", round(params * precision.weight_bytes), s)
                       if plan.zero_stage in (1, 2) and plan.dp > 1 else None)
        if params not in stepped:
            stepped[params] = compute.optimizer_time(params / shard, gpu, plan.optimizer, su)
        opt.append(stepped[params])
    z_gather = z_reduce = None
    z_extra: tuple[Placed | None, Placed | None] = (None, None)
    units = 1
    overhead = (0.0, 0.0)
    counts: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    if zero3:
        units = 4 if soft.zero3_unit == "tensor" else 1
        layer = model.params_per_layer / plan.tp
        w = precision.weight_bytes
        algo = soft.dp_nccl_algo
        z_gather = net.place(plan_collective("allgather", round(layer * w / units), dp_group,
                                             algo), 0)
        z_reduce = net.place(plan_collective(soft.zero3_grad_op, round(
            layer * precision.grad_bytes / units), dp_group, algo), 0)
        extra = sum(c.params for c in chunks) - model.layers * layer
        z_extra = (net.place(plan_collective("allgather", round(extra * w), dp_group, algo), 0),
                   net.place(plan_collective(soft.zero3_grad_op, round(
                       extra * precision.grad_bytes), dp_group, algo), 0))
        overhead = (_gather_overhead_s(soft, plan.dp, layer * w / units, gpu, su),
                    _gather_overhead_s(soft, plan.dp, extra * w, gpu, su))
        counts = zero3_gathers(model, plan, soft)
    chunks = contended_chunks(chunks, plan, cluster, soft, buckets, gathers,
                              (z_gather, z_reduce, units, counts))
    tied = _embedding_allreduce(model, plan, cluster, net, precision.grad_bytes)
    return StepCosts(model, cluster, plan, soft, su, net.capacity, tuple(chunks), p2p,
                     tuple(buckets), tuple(gathers), tuple(opt), tied, z_gather, z_reduce,
                     units, z_extra, overhead, counts)


def _embedding_allreduce(model: Transformer, plan: Plan, cluster: Cluster, net: FoldedNetwork,
                         grad_bytes: float) -> tuple[Placed | None, ...]:
    """A tied embedding lives on the first stage (the input) and the last (the output layer):
    after the last backward each GPU of the two all-reduces its gradient shard (``vocab x h /
    tp`` elements, in the gradients' precision) with its counterpart, before the optimizer
    (Megatron-LM ``_allreduce_embedding_grads``; DeepSpeed's pipeline engine
    ``_exec_reduce_tied_grads``, which reduces the fp32 ``_hp_grad`` under bf16).  Blocking:
    nothing overlaps it.  One entry per stage, None where a stage has none."""
    p = plan.pp
    if p == 1 or not model.tied_embeddings:
        return (None,) * p
    nbytes = round(model.vocab * model.hidden / plan.tp * grad_bytes)
    cost = plan_collective("allreduce", nbytes, group_of(cluster, [net.rep[0], net.rep[-1]]))
    return tuple(net.place(cost, s) if s in (0, p - 1) else None for s in range(p))


def contended_chunks(chunks: list[ChunkCost], plan: Plan, cluster: Cluster,
                     soft: SoftwareProfile, buckets: list, gathers: list,
                     zero3: tuple) -> list[ChunkCost]:
    """``chunks`` with each one's forward and backward longer by the collectives that run
    beside them on the same GPU (``labsim.compute.overlap_extra_s``: overlapped compute runs
    18.9 % slower, Lee et al. 2025): the hidden share of the tensor-parallel collectives
    (TP overlap), the gradient buckets reduced during backward (every micro-batch with
    ZeRO-2; once a step otherwise, spread over the step's micro-batches), ZeRO-1/2's
    parameter all-gather under the next forwards, and ZeRO-3's prefetched all-gathers and
    reduce-scatters, layer by layer.  Collectives that the software runs between compute
    (blocking ones, ZeRO-3 without prefetch) cost nothing here: they are on the step's
    critical path instead."""
    gpu, m, p = cluster.gpu, plan.microbatches, plan.pp
    h = _tp_hidden(plan, cluster, soft)
    z_gather, z_reduce, units, (gathers_f, gathers_b) = zero3
    k = compute.efficiency(gpu).overlap_slowdown

    def extra(compute_s: float, comm_s: float) -> float:
        return compute.overlap_extra_s(compute_s, comm_s, k)

    forwards = [m * sum(c.t_fwd for c in chunks[s::p]) for s in range(p)]
    params = [sum(c.params for c in chunks[s::p]) for s in range(p)]
    done: dict[tuple, ChunkCost] = {}  # chunks alike (one stage's middle chunks) priced once
    out = []
    for g, ch in enumerate(chunks):
        bucket, n = buckets[g]
        key = (id(ch.tp), ch.t_fwd, ch.t_bwd, ch.t_rec, ch.head_fwd, id(bucket), n, g % p)
        if key in done:
            out.append(done[key])
            continue
        fwd, bwd = ch.t_fwd, ch.t_bwd + ch.t_rec
        extra_f = extra_b = 0.0
        if ch.tp is not None and h:
            extra_f += extra(fwd, h * ch.tp.alone_s * ch.tp_fwd)
            extra_b += extra(bwd, h * ch.tp.alone_s * ch.tp_bwd)
        if bucket is not None and plan.overlap_grad_reduce:
            if plan.zero_stage == 2:
                extra_b += extra(bwd, n * bucket.alone_s)
            else:  # during the last micro-batch's backward
                extra_b += extra(bwd, n * bucket.alone_s) / m
        gather = gathers[g % p]
        if gather is not None and soft.overlap_param_gather:
            share = ch.params / params[g % p]
            extra_f += extra(forwards[g % p], share * gather.alone_s) * share / m
        if z_gather is not None and plan.zero3_prefetch > 0:
            layers = ch.layers
            per_f = (ch.t_fwd - ch.head_fwd) / layers
            per_b = (ch.t_bwd - ch.head_bwd + ch.t_rec) / layers
            reduce_s = units * z_reduce.alone_s
            extra_f += sum(extra(per_f, c * z_gather.alone_s) for c in gathers_f)
            extra_b += sum(extra(per_b, c * z_gather.alone_s + reduce_s) for c in gathers_b)
        done[key] = (ch._replace(t_fwd=ch.t_fwd + extra_f, t_bwd=ch.t_bwd + extra_b)
                     if extra_f or extra_b else ch)
        out.append(done[key])
    return out


def zero3_gathers(model: Transformer, plan: Plan,
                  soft: SoftwareProfile) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per layer, the ZeRO-3 units gathered before its forward and before its backward in one
    micro-batch.  The units are used in order (forward: layer by layer; backward: from the last
    layer, each one's recomputed forward, with full recomputation and a profile that fetches
    for it, then its backward in reverse); a unit is gathered at its first use and again at a
    later one unless the elements of the uses between (DeepSpeed's reuse distance: every
    module's parameters, once per use) stay under ``zero3_reuse_distance``.  Units: a layer,
    or its four weight tensors (QKV, output projection, MLP input, MLP output)."""
    sizes = zero3_unit_params(model, plan.tp, soft.zero3_unit)
    n, u = model.layers, len(sizes)
    again = soft.zero3_recompute_gather and plan.recompute == "full"
    if soft.zero3_reuse_distance <= 0:  # nothing kept: every use gathers
        return (u,) * n, ((2 if again else 1) * u,) * n
    uses = [(j, t, 0) for j in range(n) for t in range(u)]
    for j in reversed(range(n)):
        uses += [(j, t, 1) for t in range(u)] if again else []
        uses += [(j, t, 1) for t in reversed(range(u))]
    fwd, bwd = [0] * n, [0] * n
    last: dict[tuple[int, int], float] = {}  # unit -> elements used up to its last use
    used = 0.0
    for j, t, phase in uses:
        prev = last.get((j, t))
        if prev is None or used - prev >= soft.zero3_reuse_distance:
            (bwd if phase else fwd)[j] += 1
        used += sizes[t]
        last[(j, t)] = used
    return tuple(fwd), tuple(bwd)


def _gather_overhead_s(soft: SoftwareProfile, ranks: int, nbytes: float, gpu: GPU,
                       sustained: float) -> float:
    """Seconds one ZeRO-3 all-gather of ``nbytes`` over ``ranks`` costs besides NCCL: the
    profile's host work per rank (a list element, a copy launched, ``labsim.software``) and
    its extra passes of the gathered bytes through HBM."""
    hbm = (compute.memory_time(soft.zero3_gather_hbm_passes * nbytes, gpu, sustained)
           if soft.zero3_gather_hbm_passes else 0.0)
    return ranks * soft.zero3_host_s_per_rank + hbm


def _chunks(model: Transformer, plan: Plan, gpu: GPU, su: float, cluster: Cluster,
            net: FoldedNetwork, tp_group: Group) -> list[ChunkCost]:
    soft = profile(plan.software)
    lc = compute.layer_cost(model, plan.micro_batch, gpu, tp=plan.tp,
                            sequence_parallel=plan.sequence_parallel, recompute=plan.recompute,
                            attention=plan.attention, precision=plan.numerics, sustained=su,
                            flash_kernel=soft.flash_kernel,
                            recompute_early_stop=soft.recompute_early_stop)
    head_f, head_b = compute.logits_cost(model, plan.micro_batch, gpu, tp=plan.tp,
                                          precision=plan.numerics, sustained=su)
    n_chunks = plan.pp * plan.virtual_stages
    split = plan.chunk_layers(model.layers)
    # Megatron-LM: 2 all-reduces of the layer output per layer forward and 2 in backward; with
    # sequence parallelism each is a reduce-scatter + an all-gather of the same bytes.
    calls = 2 * (2 if plan.sequence_parallel else 1)
    tp_place = _Placer(net, tp_group)
    tp_op = "reduce_scatter" if plan.sequence_parallel else "allreduce"
    figures = {}  # a chunk's figures but its TP collective (they differ only at the ends)
    for end in {0, min(1, n_chunks - 1), n_chunks - 1}:  # first, middle, last
        f, b = (head_f, head_b) if end == n_chunks - 1 else (compute.PassCost(),
                                                              compute.PassCost())
        n = split[end]
        params = float(stage_params(model, tp=plan.tp, pp=n_chunks, stage=end, layers=n))
        # the profile's pass adding each micro-batch's gradient into the accumulated one (ZeRO-2
        # and ZeRO-3 reduce every micro-batch's gradient instead of accumulating it whole)
        accumulate = (compute.memory_time(soft.accumulate_bytes_per_param * params, gpu, su)
                      if plan.zero_stage <= 1 else 0.0)
        figures[end] = (
            n, n * lc.forward.time_s + f.time_s,
            n * lc.backward.time_s + b.time_s + accumulate, n * lc.recompute.time_s,
            f.time_s, b.time_s,
            n * (lc.forward.flops + lc.backward.flops + lc.recompute.flops)
            + f.flops + b.flops, n * lc.model_flops + f.flops + b.flops, params)
    tp_bytes = round(lc.tp_bytes)
    out = []
    for g in range(n_chunks):
        figure = figures[g if g in (0, n_chunks - 1) else 1]
        tp_fwd = calls * figure[0]
        rec = tp_fwd if plan.recompute == "full" else 0
        tp = tp_place(tp_op, tp_bytes, g % plan.pp) if plan.tp > 1 else None
        out.append(ChunkCost(*figure, tp, tp_fwd, tp_fwd + rec))
    return out


def _pipeline_sends(model: Transformer, plan: Plan, cluster: Cluster,
                    net: FoldedNetwork) -> dict[tuple[int, int], Placed]:
    """One activation (forward) or activation-gradient (backward) message per pair of
    neighbouring stages: ``b s h / tp`` elements per GPU (Megatron's scatter-gather)."""
    nbytes = round(plan.micro_batch * model.seq_len * model.hidden * plan.bytes_per_element
                   / plan.tp)
    out: dict[tuple[int, int], Placed] = {}
    # by the pair's shape: two nodes, or one node and one NIC or two (all ``group_of`` sees)
    costs: dict[tuple[bool, bool], CollectiveCost] = {}
    p = plan.pp
    nic = net.nic_index
    for g in range(min(p, p * plan.virtual_stages - 1)):  # chunk g + p pairs like chunk g
        for a, b in (((g % p), (g + 1) % p), ((g + 1) % p, g % p)):
            if (a, b) not in out and a != b:
                ra, rb = net.rep[a], net.rep[b]
                same = net.node[a] == net.node[b]
                shape = (same, same and nic[a] == nic[b])
                if shape not in costs:
                    costs[shape] = plan_collective("sendrecv", nbytes,
                                                   group_of(cluster, [ra, rb]))
                out[(a, b)] = net.place_send(costs[shape], a, b)
    return out


class _Placer:
    """``net.place(plan_collective(op, nbytes, group), stage)``, each distinct question asked
    once: a step asks the same one for every chunk of a stage and every stage alike."""

    def __init__(self, net: FoldedNetwork, group: Group, algorithm: str = "auto") -> None:
        self.net, self.group, self.algorithm = net, group, algorithm
        self._costs: dict[tuple[str, int], CollectiveCost] = {}
        self._placed: dict[tuple[str, int, int], Placed] = {}

    def __call__(self, op: str, nbytes: int, stage: int) -> Placed:
        key = (op, nbytes, stage)
        if key not in self._placed:
            if (op, nbytes) not in self._costs:
                self._costs[(op, nbytes)] = plan_collective(op, nbytes, self.group,
                                                            self.algorithm)
            self._placed[key] = self.net.place(self._costs[(op, nbytes)], stage)
        return self._placed[key]


@dataclass(frozen=True)
class StepResult:
    """Outcome of ``simulate_step`` or ``estimate_step``.

    step_time_s: one optimizer step (``band``: how far to trust it); tokens_per_s: global
        tokens per second;
    model_flops_per_gpu_s: model FLOP/s per GPU (no recomputation counted);
    mfu / hfu: model / hardware FLOPs utilisation against the dense peak;
    bubble_fraction: idle fraction of the stages' compute from the step's start to the last
        backward, averaged over stages;
    memory: ``MemoryBreakdown`` of the first stage's GPU (None when not asked for);
    fits: memory.total <= GPU memory; breakdown: seconds by kind on stage 0 (empty for the
        closed form); trace: every op, message, bucket and optimizer step (built on first use;
        empty for the closed form); costs: the ``StepCosts`` it was computed from.
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
    span_source: object = field(default=None, repr=False, compare=False)
    costs: StepCosts | None = field(default=None, repr=False, compare=False)

    @cached_property
    def spans(self) -> list:
        """Raw spans (stage, stream, kind, start, end, label, bytes), built on first use."""
        src = self.span_source
        return list(src() if callable(src) else (src or []))

    @cached_property
    def breakdown(self) -> dict[str, float]:
        """Seconds by span kind on stage 0 (empty for the closed form)."""
        out: dict[str, float] = {}
        for s, _, kind, a, b, _, _ in self.spans:
            if s == 0:
                out[kind] = out.get(kind, 0.0) + b - a
        return out

    @cached_property
    def trace(self) -> Trace:
        """The step's ``Trace`` (built from the raw spans on first access)."""
        chunked = self.plan.virtual_stages > 1
        return Trace((Span(s, stream, kind, a, b, label if isinstance(label, str) else
                           _label(label, chunked), nbytes)
                      for s, stream, kind, a, b, label, nbytes in self.spans), detail="op",
                     rank_label="pipeline stage")

    @property
    def band(self) -> ErrorBand:
        """How far to trust ``step_time_s``: the median and largest error of published runs
        of this software's stack predicted with that stack left out of the fit
        (``labsim.bands``)."""
        return error_band(self.plan.software)

    def __getstate__(self) -> dict:
        """Pickle the spans, not the engine that can build them (to send a result from a
        worker process)."""
        state = dict(self.__dict__)
        state["span_source"] = self.spans
        for built in ("spans", "trace"):
            state.pop(built, None)
        return state

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
            f"StepResult(step {self.step_time_s:.4g} s (typically ±{self.band.typical:.0%}), "
            f"{self.tokens_per_s:.4g} tokens/s, "
            f"{self.model_flops_per_gpu_s / 1e12:.4g} TFLOP/s/GPU, MFU {self.mfu:.1%}, "
            f"HFU {self.hfu:.1%}, bubble {self.bubble_fraction:.1%}, {mem})"
        )

    def _repr_html_(self) -> str:
        rows = [("step time", f"{self.step_time_s:.4g} s, {self.band.describe()}"),
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


def _label(raw: tuple, chunked: bool) -> str:
    """A raw op label (kind, micro-batch, chunk[, "send"]) as text: "F3", "B0 chunk 5"."""
    text = f"{raw[0]}{raw[1]}" + (f" chunk {raw[2]}" if chunked else "")
    return f"send {text}" if len(raw) > 3 else text


def result_from(costs: StepCosts, step_s: float, busy: list[float], compute_end: float,
                memory: MemoryBreakdown | None, spans: object) -> StepResult:
    """The ``StepResult`` of a step of ``step_s`` seconds whose stages computed ``busy``
    seconds each until ``compute_end``."""
    plan, model, gpu = costs.plan, costs.model, costs.cluster.gpu
    flops_model, flops_hw = costs.flops
    gpus = costs.cluster.world_size
    peak = gpu.peak(plan.numerics.peak_dtype(gpu)) * gpus
    bubble = sum(1.0 - b / compute_end for b in busy) / len(busy) if compute_end > 0 else 0.0
    return StepResult(
        step_time_s=step_s,
        tokens_per_s=plan.global_batch * model.seq_len / step_s,
        model_flops_per_gpu_s=flops_model / step_s / gpus,
        mfu=flops_model / step_s / peak,
        hfu=flops_hw / step_s / peak,
        bubble_fraction=max(0.0, bubble),
        memory=memory,
        fits=memory is None or memory.total <= gpu.memory_bytes,
        gpu_memory_bytes=gpu.memory_bytes,
        plan=plan,
        span_source=spans,
        costs=costs,
    )


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
    from its ops replayed with the two streams as fluids (``uncontended.zero3_fluid``), when
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
    gradient buckets, as two fluids, in ``labsim.uncontended.alone_schedule``; ZeRO-3's
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
    from labsim.memory import step_memory
    from labsim.pipeline import in_flight_peak, interleaved_warmup

    c = step_costs(model, cluster, plan)
    p, m, v = plan.pp, plan.microbatches, plan.virtual_stages
    mem = None
    if memory:
        mem = step_memory(model, plan, in_flight_peak(plan.schedule, p, m, v,
                                                      group=plan.microbatch_group)
                          if c.zero3_gather is None else 1,
                          extra_grad_bytes_per_param=c.software.extra_grad_bytes_per_param,
                          swiglu_fused=c.software.swiglu_fused,
                          zero3_unit=c.software.zero3_unit)
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
    (``g_tp``, ``g_b``: ``uncontended.bucket_growth``)."""
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
