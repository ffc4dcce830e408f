"""Studies of the mixture-of-experts lab: what the learner's expert-parallel layer sends on
real processes, and what ``labsim`` says of MoE models at scale.

Measured (``traffic_worker``, one launch of 4 gloo processes): each rank routes its tokens with
the learner's router and runs the learner's expert-parallel layer forward and backward; it
reports the rows it sends every rank, the rows its experts receive, the all-to-alls it issued
(``labsim.lab.comm.CommRecorder``) and which routed slots the learner's ``capacity_keep``
would drop.

Simulated: ``parameter_rows`` (total against active parameters: memory pays for every expert,
each token's FLOPs for ``top_k`` of them), ``ep_layer_rows`` (one MoE layer's compute against
its dispatch and combine all-to-alls as expert parallelism grows inside a node and across
nodes, with Megatron-Core's layout and the one network of ``labsim.simulate_step``),
``node_limited_rows`` (DeepSeek-V3's node-limited routing: the copies of a token that cross
InfiniBand) and ``published_mixtral`` (Megatron-Core v0.9's Mixtral 8x7B run).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from labsim.cluster import Cluster
from labsim.expert_parallel import offnode_copies
from labsim.plan import Plan
from labsim.workload import Transformer

# -- measured on processes ----------------------------------------------------------------------


@dataclass(frozen=True)
class RankTraffic:
    """One rank's run of the learner's expert-parallel layer: rows it sent each rank (its own
    included), rows its experts received, its forward and backward collectives as (kind,
    elements), the routed slots per local expert, and the slots capacity factor 1.0 and 1.25
    would drop (the learner's ``capacity_keep`` on this rank's tokens)."""

    rank: int
    sent_rows: tuple[int, ...]
    received_rows: int
    forward: tuple[tuple[str, int], ...]
    backward: tuple[tuple[str, int], ...]
    per_expert: tuple[int, ...]
    dropped: tuple[int, int]


def traffic_worker(rank: int, world: int, router: Callable[..., Any],
                   ep_layer: Callable[..., Any], capacity_keep: Callable[..., Any],
                   skews: Sequence[float] = (0.0,), **sizes: Any) -> list[RankTraffic]:
    """One rank's ``RankTraffic`` for each router skew of ``skews`` (``rank_traffic``)."""
    return [rank_traffic(rank, world, router, ep_layer, capacity_keep, skew=s, **sizes)
            for s in skews]


def rank_traffic(rank: int, world: int, router: Callable[..., Any],
                 ep_layer: Callable[..., Any], capacity_keep: Callable[..., Any], *,
                 tokens: int = 256, hidden: int = 64, ffn: int = 128, experts: int = 8,
                 k: int = 2, skew: float = 0.0, seed: int = 0) -> RankTraffic:
    """One rank: the learner's router on its ``tokens`` rows, its expert-parallel layer forward
    and backward (recorded), its capacity dropping at factors 1.0 and 1.25.  ``skew``
    raises expert 0's logit (by ``skew`` for a token along the batch's mean): an
    under-trained router that favours one expert."""
    import torch.distributed as dist

    from labsim.lab.comm import CommRecorder

    g = torch.Generator().manual_seed(seed)  # every rank builds the same weights
    w_router = torch.randn(experts, hidden, generator=g) / hidden ** 0.5
    w_in = torch.randn(experts, ffn, hidden, generator=g) / hidden ** 0.5
    w_out = torch.randn(experts, hidden, ffn, generator=g) / ffn ** 0.5
    x = torch.randn(world * tokens, hidden, generator=g)[rank * tokens:(rank + 1) * tokens]
    w_router_skewed = w_router.clone()
    if skew:  # shift expert 0's logit by ~skew for these tokens
        w_router_skewed[0] += skew * x.mean(0) / x.mean(0).square().sum()
    weights, chosen = router(x @ w_router_skewed.T, k)
    local = experts // world
    sent = torch.bincount(chosen.flatten() // local, minlength=world)
    per_expert = torch.bincount(chosen.flatten(), minlength=experts)
    total = per_expert.clone()
    dist.all_reduce(total)
    mine = total[rank * local:(rank + 1) * local]
    dropped = tuple(int((~capacity_keep(weights, chosen, experts, f)).sum()) for f in (1.0, 1.25))
    leaves = [t.clone().requires_grad_(True) for t in (x, w_in[rank * local:(rank + 1) * local],
                                                         w_out[rank * local:(rank + 1) * local])]
    with CommRecorder() as rec:
        out = ep_layer(leaves[0], w_router_skewed, leaves[1], leaves[2], k)
        rec.phase = "backward"
        out.square().sum().backward()
    return RankTraffic(rank, tuple(int(n) for n in sent), int(mine.sum()),
                       tuple((c.kind, c.numel) for c in rec.comms if c.phase == "forward"),
                       tuple((c.kind, c.numel) for c in rec.comms if c.phase == "backward"),
                       tuple(int(n) for n in mine), dropped)


def flops_of(fn: Callable[..., Any], *args: Any) -> int:
    """Matmul FLOPs of ``fn(*args)`` forward and backward (PyTorch's ``FlopCounterMode``), the
    floating-point arguments taking gradients."""
    from torch.utils.flop_counter import FlopCounterMode

    leaves = [a.detach().clone().requires_grad_(True)
              if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    with FlopCounterMode(display=False) as counter:
        fn(*leaves).square().sum().backward()
    return int(counter.get_total_flops())


def imbalance(ranks: Sequence[RankTraffic]) -> float:
    """Routed rows of the busiest expert over the mean (1.0: perfectly balanced)."""
    counts = [n for r in ranks for n in r.per_expert]
    return max(counts) / (sum(counts) / len(counts))


# -- simulated ----------------------------------------------------------------------------------


def parameter_rows(names: Sequence[str]) -> list[dict[str, Any]]:
    """Per preset: total and active parameters, training FLOPs per token (6 x active, Kaplan
    et al. 2020's rule), and the bytes of weights, gradients and Adam state (16 per parameter,
    mixed precision, lab 01) that every expert costs whether a token uses it or not."""
    rows = []
    for name in names:
        m = Transformer.preset(name)
        rows.append({"name": name, "experts": m.experts, "top_k": m.top_k,
                     "total": m.params, "active": m.active_params,
                     "flops_per_token": 6.0 * m.active_params,
                     "states_bytes": 16.0 * m.params})
    return rows


@dataclass(frozen=True)
class EpLayer:
    """One expert-parallel degree: where its group sits, one MoE layer's compute and its
    all-to-alls (seconds alone, forward + backward, per micro-batch), and the step."""

    ep: int
    where: str
    compute_s: float
    alltoall_s: float
    step_s: float
    step_overlap_s: float
    memory_bytes: float

    @property
    def alltoall_fraction(self) -> float:
        return self.alltoall_s / (self.compute_s + self.alltoall_s)


def ep_layer_rows(model: Transformer, cluster: Cluster, plan: Plan, eps: Sequence[int]
                  ) -> list[EpLayer]:
    """``plan`` with each expert-parallel degree of ``eps``: one MoE layer of the first
    chunk (its compute, its all-to-alls alone) and the step, with and without
    ``ep_overlap``."""
    from labsim import simulate_step
    from labsim.step.costs import step_costs

    rows = []
    per_node = cluster.gpus_per_node
    for ep in eps:
        p = replace(plan, ep=ep)
        costs = step_costs(model, cluster, p)
        chunk = costs.chunks[0]
        layers = chunk.layers
        compute = (chunk.t_fwd - chunk.head_fwd + chunk.t_bwd - chunk.head_bwd) / layers
        a2a = (chunk.inline_s(True) + chunk.inline_s(False)) / layers
        step = simulate_step(model, cluster, p)
        overlap = (simulate_step(model, cluster, replace(p, ep_overlap=True)) if ep > 1
                   else step)
        span = ep * p.tp * p.cp
        where = ("one GPU" if ep == 1 else "inside one node (NVLink)" if span <= per_node
                 else f"across {math.ceil(span / per_node)} nodes (InfiniBand)")
        rows.append(EpLayer(ep, where, compute - a2a, a2a, step.step_time_s,
                            overlap.step_time_s, step.peak_memory_bytes))
    return rows


def node_limited_rows(experts: int = 256, k: int = 8, nodes: int = 8,
                      limits: Sequence[int | None] = (None, 4)) -> list[dict[str, Any]]:
    """DeepSeek-V3's MoE layer (256 routed experts, 8 per token, EP64 over 8 nodes of 8 GPUs):
    copies of one token on InfiniBand per dispatch, plain, deduplicated per node, and with
    each node limit."""
    rows = [{"routing": "any experts, one copy per routed expert",
             "copies": offnode_copies(experts, k, nodes, dedup=False)}]
    for limit in limits:
        label = ("any experts, one copy per node reached" if limit is None
                 else f"at most {limit} nodes, one copy per node reached")
        rows.append({"routing": label, "copies": offnode_copies(experts, k, nodes, limit)})
    return rows


def node_limited_steps(model: Transformer, cluster: Cluster, plan: Plan,
                       limits: Sequence[int | None] = (None, 8, 4, 2)) -> list[dict[str, Any]]:
    """``plan`` (expert parallelism across nodes) with each ``Plan.ep_node_limit`` of
    ``limits`` (None: NCCL's all-to-all, one copy per routed expert): one MoE layer's
    all-to-alls alone, forward + backward, and the step (``simulate_step``)."""
    from labsim import simulate_step
    from labsim.step.costs import step_costs

    rows = []
    for limit in limits:
        p = replace(plan, ep_node_limit=limit)
        chunk = step_costs(model, cluster, p).chunks[0]
        rows.append({"limit": limit, "step_s": simulate_step(model, cluster, p).step_time_s,
                     "alltoall_s": (chunk.inline_s(True) + chunk.inline_s(False))
                     / chunk.layers})
    return rows


def published_mixtral() -> dict[str, Any]:
    """Megatron-Core v0.9's Mixtral 8x7B run (64 H100, TP1 EP8 PP4 VP8): measured against
    ``labsim.simulate_step`` on its published layout."""
    from labsim import simulate_step
    from labsim.published import runs

    run = next(r for r in runs() if r.id == "mcore09_mixtral_8x7b_ep8_64gpu")
    result = simulate_step(run.model, run.cluster, run.plan)
    return {"run": run, "result": result, "measured_s": run.measured_step_s(),
            "simulated_s": result.step_time_s,
            "error": result.step_time_s / run.measured_step_s() - 1}
