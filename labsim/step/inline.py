"""Collectives inside a chunk's ops that its compute waits for, besides tensor parallelism's:
expert parallelism's dispatch and combine all-to-alls (``labsim.expert_parallel``; with
``Plan(ep_overlap=True)`` only what outlasts another micro-batch's layer compute) and context
parallelism's attention traffic (``labsim.context_parallel``: the ring's sends where attention
does not hide them, or its blocking all-gathers or all-to-alls).

Each is an ``Inline``: one collective placed on the folded network and how many of it a
forward and a backward pass of the chunk wait for.  Their seconds alone join the chunk's
compute (``with_inline``), so the event-free evaluations price them alone; the event engine
(``labsim.sim.step``) moves their bytes on the pipes after the op's compute, where they meet
the gradient buckets and pipeline sends (``labsim.step.alone`` watches them for that).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from labsim import context_parallel, expert_parallel
from labsim.cluster import Cluster
from labsim.collectives.group import group_of, strided_group
from labsim.collectives.nccl import plan_collective
from labsim.compute import LayerCost
from labsim.moe import moe_layers_of
from labsim.network import FoldedNetwork, Placed
from labsim.plan import Plan
from labsim.workload import Transformer

if TYPE_CHECKING:
    from labsim.step.costs import ChunkCost


class Inline(NamedTuple):
    """``placed`` (one collective) ``fwd`` times in a forward pass of a chunk and ``bwd``
    times in a backward one (recompute included); a fraction where only part of it shows, as
    a ring send partly hidden by attention."""

    placed: Placed
    fwd: float
    bwd: float

    def seconds(self, forward: bool) -> float:
        """Seconds alone of this collective's share of one pass."""
        if not self.placed.pipes:
            return 0.0
        return self.placed.alone_s * (self.fwd if forward else self.bwd)


# one layer's collectives: (placed, forward count, backward count without recompute, MoE only)
LayerInline = tuple[Placed, float, float, bool]


def flows(inline: tuple[Inline, ...], forward: bool) -> list[tuple[Placed, float]]:
    """The (collective, count) pairs of one pass that move bytes, in order."""
    pairs = [(x.placed, x.fwd if forward else x.bwd) for x in inline]
    return [(pl, n) for pl, n in pairs if n and pl.pipes]


def shown_share(beside_s: float, comm_s: float) -> float:
    """The share of ``comm_s`` seconds of communication that ``beside_s`` seconds of compute
    running beside it do not hide (0 when the compute outlasts it)."""
    return max(0.0, 1.0 - beside_s / comm_s) if comm_s > 0 else 0.0


def per_layer(model: Transformer, plan: Plan, cluster: Cluster, net: FoldedNetwork,
              lc: LayerCost) -> dict[int, list[LayerInline]]:
    """Per stage, one layer's inline collectives (empty without EP and CP)."""
    out: dict[int, list[LayerInline]] = {}
    if plan.ep > 1:
        tokens = plan.micro_batch * model.seq_len / plan.cp / (
            plan.tp if plan.sequence_parallel else 1)
        nbytes = round(expert_parallel.dispatch_bytes(
            model, tokens, plan.ep, plan.bytes_per_element, plan.expert_load))
        cost = plan_collective("alltoall", nbytes, strided_group(cluster, plan.ep,
                                                                 plan.expert_tp))
        if plan.ep_node_limit is not None and cost.group.nnodes > 1:
            g = cost.group
            nic, intra = expert_parallel.node_limited_loads(model, g.nnodes, g.nranks / g.nnodes,
                                                            plan.ep_node_limit)
            cost = replace(cost, nic_load=cost.nic_load * nic, intra_load=intra,
                           cap_Bps=cost.cap_Bps / nic)
        f, b = expert_parallel.alltoalls_per_layer("none")
        for s in range(plan.pp):
            placed = net.place(cost, s)
            shown = shown_share(lc.forward.time_s + lc.backward.time_s,  # another
                                (f + b) * placed.alone_s) if plan.ep_overlap else 1.0  # layer
            out.setdefault(s, []).append((placed, f * shown, b * shown, True))
    if model.experts and plan.sequence_parallel and plan.expert_tp > 1:
        for s in range(plan.pp):
            out.setdefault(s, []).extend(expert_tp_collectives(model, plan, cluster, net, s))
    if plan.cp > 1:
        for s, entries in _context_parallel(model, plan, cluster, net, lc).items():
            out.setdefault(s, []).extend(entries)
    return out


def expert_tp_collectives(model: Transformer, plan: Plan, cluster: Cluster,
                          net: FoldedNetwork, stage: int) -> list[LayerInline]:
    """An MoE layer's collectives over the experts' tensor-parallel group (``etp`` ranks),
    as Megatron-Core's all-to-all dispatcher runs them under sequence parallelism: after the
    dispatch the routed rows a rank received are all-gathered over the group (each rank's
    ``s / tp`` tokens, ``top_k`` copies each, ``etp`` ranks' worth), and the experts' outputs
    reduce-scattered back before the combine (``gather_from_sequence_parallel_region`` and
    ``reduce_scatter_to_sequence_parallel_region`` on the expert TP group); the reverse in
    backward.  Blocking, as the dispatcher waits for them."""
    tokens = plan.micro_batch * model.seq_len / plan.cp / plan.tp
    nbytes = round(plan.expert_tp * expert_parallel.routed_bytes(
        model, tokens, plan.bytes_per_element, plan.expert_load))
    group = strided_group(cluster, plan.expert_tp, 1)
    return [(net.place(plan_collective(op, nbytes, group), stage), 1.0, 1.0, True)
            for op in ("allgather", "reduce_scatter")]


def of_chunk(model: Transformer, plan: Plan, layer: list[LayerInline], layers: int,
             first_layer: int) -> tuple[Inline, ...]:
    """A chunk's inline collectives: each layer's (the MoE ones on its MoE layers only),
    and with full recomputation the recomputed forward's in backward."""
    moe = moe_layers_of(model, layers, first_layer)
    again = plan.recompute == "full"
    out = []
    for placed, f, b, moe_only in layer:
        n = moe if moe_only else layers
        if n and (f or b):
            out.append(Inline(placed, n * f, n * (b + (f if again else 0.0))))
    return tuple(out)


def with_inline(ch: ChunkCost, inline: tuple[Inline, ...], recompute: str) -> ChunkCost:
    """``ch`` with ``inline``'s seconds alone added to its forward, backward and, with full
    recomputation, the recomputed forward's share to its recompute."""
    if not inline:
        return ch
    fwd = sum([x.seconds(True) for x in inline])
    bwd = sum([x.seconds(False) for x in inline])
    rec = fwd if recompute == "full" else 0.0
    return ch._replace(t_fwd=ch.t_fwd + fwd, t_bwd=ch.t_bwd + bwd - rec,
                       t_rec=ch.t_rec + rec, inline=inline)


def _context_parallel(model: Transformer, plan: Plan, cluster: Cluster, net: FoldedNetwork,
                      lc: LayerCost) -> dict[int, list[LayerInline]]:
    """Per stage, one layer's context-parallel collectives: the ring's sends, each step's
    share that the block's attention does not hide (``shown_share``: Transformer Engine
    overlaps the next block's send with this block's kernel); or
    the blocking all-gathers or all-to-alls.  The ring's pair is two neighbours of the cp
    group, across a node boundary where the group leaves a node (there every GPU of the
    stage sends at once)."""
    cp, tp, g, e = plan.cp, plan.tp, cluster.gpus_per_node, plan.bytes_per_element
    out: dict[int, list[LayerInline]] = {}
    if plan.cp_comm == "p2p":
        kv = context_parallel.kv_block_bytes(model, plan.micro_batch, tp, cp, e)
        pair = [0, tp] if tp * cp <= g else [g - tp, g]
        costs = [plan_collective("sendrecv", round(n), group_of(cluster, pair))
                 for n in (kv, 2 * kv)]  # forward: K, V; backward: K, V and dK, dV
        for s in range(plan.pp):
            fwd, bwd = (net.place(c, s) for c in costs)
            f = (cp - 1) * shown_share(lc.attention_fwd_s / cp, fwd.alone_s)
            b = (cp - 1) * shown_share(lc.attention_bwd_s / cp, bwd.alone_s)
            out[s] = [(fwd, f, 0.0, False), (bwd, 0.0, b, False)]
        return out
    group = strided_group(cluster, cp, tp)
    costs = [(plan_collective(op, round(n), group), f, b) for op, n, f, b in
             context_parallel.cp_collectives(model, plan.micro_batch, tp, cp, plan.cp_comm, e)]
    for s in range(plan.pp):
        out[s] = [(net.place(c, s), f, b, False) for c, f, b in costs]
    return out
