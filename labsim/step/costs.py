"""A training step priced once: what every op costs and where its bytes go.

``step_costs(model, cluster, plan)`` prices one step once, for both faces:

* **compute** per model chunk (``labsim.compute``: GEMMs, attention, memory-bound kernels, at
  the software profile's sustained fraction), forward, backward and recompute, each longer by
  what the collectives that run beside it cost it (``contended_chunks``);
* **communication**, each a ``Placed`` collective: NCCL's choice and cost
  (``labsim.collectives.nccl``) of the tensor-parallel collectives of a layer, the pipeline
  sends between stages, the data-parallel gradient buckets, ZeRO-1/2's parameter all-gather,
  ZeRO-3's per-layer (or per-tensor) all-gathers and gradient reduce-scatters, and the
  all-reduce of a tied embedding's gradient between the first and the last stage, the
  expert-parallel dispatch and combine all-to-alls of MoE layers (``labsim.expert_parallel``)
  -- and the pipes of the **folded network** they load.

The folded network: the replicas of a plan are symmetric, so only one data-parallel replica
is simulated and each pipeline stage is represented by one GPU (tensor rank 0 of replica 0).
Its pipes are that GPU's port into its node's switch (tx, rx) and its NIC (tx, rx); a NIC's
load counts every GPU of the stage on that node that uses it at the same time (all replicas and
tensor ranks do the same thing at once), and stages whose GPUs share a node and NIC share that
NIC's pipes.  Tensor-parallel, pipeline and data-parallel traffic of a stage therefore meet on
the same pipes, in the closed form's accounting and in the simulation (``labsim.sim.step``).

``labsim.step.alone`` and ``labsim.step.closed_form`` evaluate it without events,
``labsim.simulate_step`` with them.  Rank layout (Megatron-LM): tensor-parallel
fastest, then data-parallel, then pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from labsim import compute
from labsim.cluster import Cluster
from labsim.collectives.group import Group, group_of, strided_group
from labsim.collectives.nccl import CollectiveCost, plan_collective
from labsim.context_parallel import local_model
from labsim.expert_parallel import routed_expert_params
from labsim.hardware import GPU
from labsim.memory import MemoryBreakdown, stage_params, step_memory, zero3_unit_params
from labsim.moe import moe_layers_of
from labsim.network import FoldedNetwork, Placed
from labsim.plan import Plan
from labsim.software import SoftwareProfile, profile
from labsim.step.inline import Inline, of_chunk, per_layer, with_inline
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
    # collectives that block the chunk's compute besides TP's: expert parallelism's
    # all-to-alls, context parallelism's exposed ring sends, all-gathers or all-to-alls
    inline: tuple[Inline, ...] = ()

    def inline_s(self, forward: bool) -> float:
        """Seconds alone of the inline collectives of one forward (or backward, recompute
        included) pass of the chunk: part of its work (``labsim.step.inline``)."""
        return sum([x.seconds(forward) for x in self.inline])


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
        scale = p.dp * p.microbatches * p.tp * p.cp
        return (scale * sum(c.flops_model for c in self.chunks),
                scale * sum(c.flops_hw for c in self.chunks))


def stage_memory(c: StepCosts, in_flight: int) -> MemoryBreakdown:
    """The first stage's memory (``labsim.memory.step_memory``) with ``in_flight`` chunk
    activations held at the peak, under the software profile's mechanisms: a second gradient,
    a fused SwiGLU, the ZeRO-3 unit and the loss kernel."""
    soft = c.software
    return step_memory(c.model, c.plan, in_flight,
                       extra_grad_bytes_per_param=soft.extra_grad_bytes_per_param,
                       swiglu_fused=soft.swiglu_fused, zero3_unit=soft.zero3_unit,
                       cross_entropy=soft.cross_entropy)


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
    dp_group = strided_group(cluster, plan.gradient_ranks, plan.tp)  # with CP's ranks
    chunks = _chunks(model, plan, gpu, su, cluster, net, tp_group)
    p2p = _pipeline_sends(model, plan, cluster, net)
    precision = plan.numerics
    buckets, gathers, opt = [], [], []
    zero3 = plan.zero_stage == 3 and plan.gradient_ranks > 1
    op = ("allreduce" if plan.zero_stage == 0
          or (plan.zero_stage == 1 and soft.zero1_grad_op == "allreduce") else "reduce_scatter")
    dp_place = _Placer(net, dp_group, soft.dp_nccl_algo)
    reduced = _reduced_params(model, plan, cluster, chunks, op, soft.dp_nccl_algo)
    split: dict[float, tuple[int, int]] = {}  # a chunk's gradient: (bucket bytes, count)
    for g, carried in enumerate(reduced):
        if plan.gradient_ranks > 1 and not zero3:
            if carried not in split:
                grad_bytes = carried * precision.grad_bytes
                count = max(1, math.ceil(grad_bytes / plan.bucket_bytes))
                split[carried] = (round(grad_bytes / count), count)
            nbytes, count = split[carried]
            buckets.append((dp_place(op, nbytes, g % plan.pp), count))
        else:
            buckets.append((None, 0))
    shard = plan.gradient_ranks if plan.zero_stage >= 1 else 1
    stepped: dict[float, float] = {}  # the optimizer's seconds by a stage's parameters
    for s in range(plan.pp):
        params = sum([ch.params for ch in chunks[s::plan.pp]])
        gathered = sum(reduced[s::plan.pp])
        gathers.append(dp_place("allgather", round(gathered * precision.weight_bytes), s)
                       if plan.zero_stage in (1, 2) and plan.gradient_ranks > 1 else None)
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
        overhead = (_gather_overhead_s(soft, plan.gradient_ranks, layer * w / units, gpu, su),
                    _gather_overhead_s(soft, plan.gradient_ranks, extra * w, gpu, su))
        counts = zero3_gathers(model, plan, soft)
    chunks = contended_chunks(chunks, plan, cluster, soft, buckets, gathers,
                              (z_gather, z_reduce, units, counts))
    tied = _embedding_allreduce(model, plan, cluster, net, precision.grad_bytes)
    return StepCosts(model, cluster, plan, soft, su, net.capacity, tuple(chunks), p2p,
                     tuple(buckets), tuple(gathers), tuple(opt), tied, z_gather, z_reduce,
                     units, z_extra, overhead, counts)


def _reduced_params(model: Transformer, plan: Plan, cluster: Cluster, chunks: list[ChunkCost],
                    op: str, algorithm: str) -> list[float]:
    """Per chunk, the parameters whose gradients its data-parallel buckets (and ZeRO-1/2's
    parameter all-gather) carry, in the dp group's terms.  With expert parallelism a rank
    holds ``experts / ep`` of each MoE layer's routed experts, and Megatron-Core reduces their
    gradients over the ``tp cp dp / (ep etp)`` expert-data-parallel ranks (``expert_data_parallel``
    groups of ``parallel_state``): those enter at what a bucket costs there against the dp
    group (NCCL's model, one bucket on each), nothing where the group is one rank; every
    other parameter as it is.  The optimizer steps the same share of the experts either way
    (``experts / (tp cp dp)`` per rank), so it keeps ``ChunkCost.params``."""
    if plan.ep == 1 or not model.experts:
        return [ch.params for ch in chunks]
    edp = plan.expert_data_ranks
    ratio = 0.0
    if edp > 1:
        nbytes = round(plan.bucket_bytes)
        dense = plan_collective(op, nbytes, strided_group(cluster, plan.gradient_ranks,
                                                          plan.tp), algorithm)
        expert = plan_collective(op, nbytes, strided_group(
            cluster, edp, plan.expert_tp * plan.ep), algorithm)
        ratio = expert.time_s / dense.time_s
    split = plan.chunk_layers(model.layers)
    every = routed_expert_params(model, plan.tp)  # in ChunkCost.params, as the optimizer
    mine = routed_expert_params(model, plan.expert_tp, plan.ep)  # steps them
    return [ch.params - moe_layers_of(model, split[g], sum(split[:g])) * (every - mine * ratio)
            for g, ch in enumerate(chunks)]


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
    if not ((h and chunks[0].tp is not None)
            or (plan.overlap_grad_reduce and any(b is not None for b, _ in buckets))
            or (soft.overlap_param_gather and any(x is not None for x in gathers))
            or (z_gather is not None and plan.zero3_prefetch > 0)):
        return chunks  # nothing runs beside the compute
    k = compute.efficiency(gpu).overlap_slowdown

    def extra(compute_s: float, comm_s: float) -> float:
        return compute.overlap_extra_s(compute_s, comm_s, k)

    forwards = [m * sum(c.t_fwd for c in chunks[s::p]) for s in range(p)]
    params = [sum(c.params for c in chunks[s::p]) for s in range(p)]
    done: dict[tuple, ChunkCost] = {}  # chunks alike (one stage's middle chunks) priced once
    out = []
    for g, ch in enumerate(chunks):
        bucket, n = buckets[g]
        key = (id(ch.tp), tuple((id(x.placed), x.fwd, x.bwd) for x in ch.inline), ch.t_fwd,
               ch.t_bwd, ch.t_rec, ch.head_fwd, id(bucket), n, g % p)
        if key in done:
            out.append(done[key])
            continue
        fwd, bwd = ch.t_fwd - ch.inline_s(True), ch.t_bwd + ch.t_rec - ch.inline_s(False)
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

    def layer(moe: bool | None) -> compute.LayerCost:
        return compute.layer_cost(
            model, plan.micro_batch, gpu, tp=plan.tp, sequence_parallel=plan.sequence_parallel,
            recompute=plan.recompute, attention=plan.attention, precision=plan.numerics,
            sustained=su, flash_kernel=soft.flash_kernel,
            recompute_early_stop=soft.recompute_early_stop, fp8=plan.fp8, moe=moe,
            ep=plan.ep, expert_imbalance=plan.expert_load, cp=plan.cp,
            cp_comm=plan.cp_comm, grouped_gemm=plan.moe_grouped_gemm, etp=plan.expert_tp)

    # a mixture-of-experts model: MoE layers, and its leading dense layers in the first chunk
    lc = layer(True if model.experts else None)
    dense = layer(False) if model.experts and model.moe_layers < model.layers else lc
    head_f, head_b = compute.logits_cost(local_model(model, plan.cp), plan.micro_batch, gpu,
                                          tp=plan.tp, precision=plan.numerics, sustained=su)
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
        first = sum(split[:end])
        d = n - moe_layers_of(model, n, first) if model.experts else 0  # its dense layers
        params = float(stage_params(model, tp=plan.tp, pp=n_chunks, stage=end, layers=n,
                                    first_layer=first))
        # the profile's pass adding each micro-batch's gradient into the accumulated one (ZeRO-2
        # and ZeRO-3 reduce every micro-batch's gradient instead of accumulating it whole)
        accumulate = (compute.memory_time(soft.accumulate_bytes_per_param * params, gpu, su)
                      if plan.zero_stage <= 1 else 0.0)
        figures[end] = (
            n, (n - d) * lc.forward.time_s + d * dense.forward.time_s + f.time_s,
            (n - d) * lc.backward.time_s + d * dense.backward.time_s + b.time_s + accumulate,
            (n - d) * lc.recompute.time_s + d * dense.recompute.time_s,
            f.time_s, b.time_s,
            sum(k * (x.forward.flops + x.backward.flops + x.recompute.flops)
                for k, x in ((n - d, lc), (d, dense))) + f.flops + b.flops,
            (n - d) * lc.model_flops + d * dense.model_flops + f.flops + b.flops, params)
    tp_bytes = round(lc.tp_bytes)
    # expert parallelism: each MoE layer's dispatch and combine all-to-alls over ep
    # neighbouring data-parallel ranks, carrying the rank's tokens (its s / tp share with
    # sequence parallelism); their seconds alone join the chunk's work
    layer_inline = per_layer(model, plan, cluster, net, lc)
    # an MoE layer under sequence parallelism gathers its routed rows over the experts' own
    # TP group (``inline.expert_tp_collectives``) instead of its MLP's TP collectives, which
    # only its shared experts run (Megatron-Core: they follow the attention's parallelism)
    routed_only = bool(model.experts and plan.sequence_parallel and not model.shared_experts)
    out = []
    for g in range(n_chunks):
        figure = figures[g if g in (0, n_chunks - 1) else 1]
        moe = moe_layers_of(model, split[g], sum(split[:g])) if routed_only else 0
        tp_fwd = calls * figure[0] - calls // 2 * moe
        rec = tp_fwd if plan.recompute == "full" else 0
        tp = tp_place(tp_op, tp_bytes, g % plan.pp) if plan.tp > 1 else None
        ch = ChunkCost(*figure, tp, tp_fwd, tp_fwd + rec)
        if layer_inline:
            ch = with_inline(ch, of_chunk(model, plan, layer_inline[g % plan.pp], split[g],
                                          sum(split[:g])), plan.recompute)
        out.append(ch)
    return out


def _pipeline_sends(model: Transformer, plan: Plan, cluster: Cluster,
                    net: FoldedNetwork) -> dict[tuple[int, int], Placed]:
    """One activation (forward) or activation-gradient (backward) message per pair of
    neighbouring stages: ``b s h / (tp cp)`` elements per GPU (Megatron's scatter-gather; a
    context-parallel rank sends its ``s / cp`` tokens)."""
    nbytes = round(plan.micro_batch * model.seq_len * model.hidden * plan.bytes_per_element
                   / (plan.tp * plan.cp))
    out: dict[tuple[int, int], Placed] = {}
    # by the pair's shape: two nodes, or one node and one NIC or two (all ``group_of`` sees)
    costs: dict[tuple[bool, bool], CollectiveCost] = {}
    p = plan.pp
    node, nic, place = net.node, net.nic_index, net.place_send
    for g in range(min(p, p * plan.virtual_stages - 1)):  # chunk g + p pairs like chunk g
        a, b = g, (g + 1) % p
        if a == b:
            continue
        same = node[a] == node[b]
        shape = (same, same and nic[a] == nic[b])
        cost = costs.get(shape)
        if cost is None:
            cost = costs[shape] = plan_collective("sendrecv", nbytes,
                                                  group_of(cluster, [net.rep[a], net.rep[b]]))
        out[(a, b)] = place(cost, a, b)  # forward
        if (b, a) not in out:
            out[(b, a)] = place(cost, b, a)  # backward (the same pair's shape)
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

