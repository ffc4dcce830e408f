"""Data-parallel gradient reduction and ZeRO traffic of a training step (values + timing).

Closed-form ring collectives from ``labsim.collectives`` placed on a per-stage communication
stream: buckets of ``bucket_bytes`` become ready as the last backward of a model chunk walks
its layers in reverse (``overlap_grad_reduce``) or all at the end; ZeRO-1/2 reduce-scatter the
gradients and all-gather the updated parameters after the optimizer step (Rajbhandari et al.
2020).  ``group_link`` gives the link a ring over a rank group runs at.
"""

from __future__ import annotations

from dataclasses import replace

from labsim import compute
from labsim.cluster import Cluster
from labsim.collectives import collective_time
from labsim.hardware import GPU, Link
from labsim.plan import Plan
from labsim.sim.pipeline import ChunkCost

_WIRE_FACTOR = {"allreduce": 2.0, "reduce_scatter": 1.0, "allgather": 1.0}


def collective_s(op: str, nbytes: float, n: int, link: Link) -> float:
    """Closed-form ring collective time (``labsim.collectives``); zero for a group of one."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return collective_time(op, int(round(nbytes)), n, link)


def wire_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes each GPU sends in a ring collective of an ``nbytes`` buffer over ``n`` GPUs."""
    return _WIRE_FACTOR[op] * (n - 1) / n * nbytes if n > 1 else 0.0


def node_link(cluster: Cluster) -> Link:
    """The inter-node link as one GPU sees it: its share of the node's NICs."""
    share = min(1.0, cluster.nics_per_node / cluster.gpus_per_node)
    lk = cluster.inter_node
    return replace(lk, bandwidth_Bps=lk.bandwidth_Bps * share) if share < 1 else lk


def group_link(cluster: Cluster, size: int, stride: int) -> Link:
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


def reduce_gradients(plan: Plan, cluster: Cluster, chunks: list[ChunkCost], stats: list[dict],
                      gpu: GPU, spans: list) -> list[float]:
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
            t_bucket = collective_s(op, size, dp, link)
            for k in range(n_buckets):
                if plan.overlap_grad_reduce:
                    ready = b_start + (b_end - b_start) * (k + 1) / n_buckets
                else:
                    ready = st["last"]
                start = max(ready, comm_free)
                comm_free = start + t_bucket
                spans.append((s, "dp", "comm", start, comm_free, [
                    f"{op} bucket {k} chunk {g}", size,
                    {"wire_bytes": wire_bytes(op, size, dp), "op": op}]))
        t0 = max(free, comm_free)
        t_opt = compute.optimizer_time(params / shard, gpu, plan.optimizer)
        spans.append((s, "optimizer", "optimizer", t0, t0 + t_opt, ["optimizer step", 0.0, {}]))
        end = t0 + t_opt
        if plan.zero_stage in (1, 2) and dp > 1:
            nbytes = params * plan.bytes_per_element
            t_ag = collective_s("allgather", nbytes, dp, link)
            spans.append((s, "dp", "comm", end, end + t_ag, [
                "allgather parameters", nbytes,
                {"wire_bytes": wire_bytes("allgather", nbytes, dp), "op": "allgather"}]))
            end += t_ag
        ends.append(end)
    return ends


def zero3_traffic(plan: Plan, chunks: list[ChunkCost], spans: list) -> None:
    """Record ZeRO-3's per-micro-batch traffic (all-gather before forward and before backward,
    reduce-scatter after backward) as zero-length accounting spans on stage 0's dp stream."""
    if plan.zero_stage != 3 or plan.dp == 1:
        return
    nbytes = sum(c.param_bytes for c in chunks)
    for i in range(plan.microbatches):
        for op in ("allgather", "allgather", "reduce_scatter"):
            spans.append((0, "dp", "comm", 0.0, 0.0, [
                f"ZeRO-3 {op} mb {i}", nbytes,
                {"wire_bytes": wire_bytes(op, nbytes, plan.dp), "op": op}]))


