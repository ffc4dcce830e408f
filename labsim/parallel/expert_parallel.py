"""Mixture of experts and expert parallelism by hand, as Megatron-Core runs them.

A mixture-of-experts (MoE) layer replaces the MLP by ``E`` expert MLPs and a router; each
token goes to ``k`` of them (Shazeer et al. 2017, "Outrageously Large Neural Networks";
Fedus et al. 2022, "Switch Transformers", JMLR 23; Jiang et al. 2024, "Mixtral of Experts").
Tokens are rows ``(T, h)``; the router is ``w_router`` ``(E, h)``; expert ``e`` is
``GeLU(x W_in[e]^T) W_out[e]^T`` with ``W_in`` ``(E, f, h)`` and ``W_out`` ``(E, h, f)``.

* ``top_k_route``: the ``k`` largest logits of each token, their softmax as the weights
  (Megatron-Core's default, ``moe_router_pre_softmax=False``, and Mixtral's: softmax over all
  experts then renormalised over the top k is the same thing);
* ``balancing_loss``: the Switch Transformer's auxiliary loss ``E * sum_i f_i P_i``, with
  ``f_i`` the fraction of the ``T k`` routed slots that went to expert ``i`` (not
  differentiable) and ``P_i`` the mean router probability of expert ``i`` over all experts'
  softmax (Fedus et al. 2022, eq. 4; Megatron-Core ``switch_load_balancing_loss_func`` in
  ``megatron/core/transformer/moe/moe_utils.py`` divides ``f`` by ``k`` the same way): 1.0 when
  routing and probabilities are uniform;
* ``moe_forward``: the layer, each expert on only the rows routed to it (``k / E`` of the
  dense FLOPs); ``dense_moe`` computes every expert on every token and masks: the oracle;
* ``capacity_keep``: token dropping, each expert keeping at most
  ``ceil(T k / E * capacity_factor)`` of its rows, those with the largest routing weights
  (Megatron-Core ``get_capacity`` and ``topk_softmax_with_capacity``, ``drop_policy="probs"``);
* ``AllToAll`` and ``ep_moe_forward``: expert parallelism.  Rank ``r`` of ``R`` holds its own
  tokens and experts ``r E/R .. (r+1) E/R - 1``; it sorts its routed rows by expert, exchanges
  the per-expert counts (one all-to-all of ``E`` numbers), sends each row to the rank holding
  its expert (the *dispatch* all-to-all), runs its local experts and sends the results back
  (the *combine* all-to-all), as Megatron-Core's ``MoEAlltoAllTokenDispatcher``
  (``megatron/core/transformer/moe/token_dispatcher.py``).  Backward runs each all-to-all
  reversed: two forward, two backward per layer (``labsim.expert_parallel.alltoalls_per_layer``).

``demo`` runs the expert-parallel layer against the whole layer under ``torchrun
--nproc_per_node=N -m labsim.lab.worker labsim.parallel.expert_parallel:demo``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


def top_k_route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)``, both ``(T, k)``: each token's ``k`` largest logits' experts,
    largest first, and the softmax of those logits (each row sums to 1)."""
    top, experts = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=-1), experts


def balancing_loss(logits: torch.Tensor, experts: torch.Tensor, num_experts: int
                   ) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss ``E * sum_i f_i P_i`` (a scalar)."""
    counts = torch.bincount(experts.flatten(), minlength=num_experts).to(logits.dtype)
    f = counts / experts.numel()
    p = torch.softmax(logits, dim=-1).mean(0)
    return num_experts * (f * p).sum()


def expert_forward(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """One expert MLP on rows ``x``: ``GeLU(x w_in^T) w_out^T``."""
    return F.linear(F.gelu(F.linear(x, w_in)), w_out)


def moe_forward(x: torch.Tensor, w_router: torch.Tensor, w_in: torch.Tensor,
                w_out: torch.Tensor, k: int) -> torch.Tensor:
    """The MoE layer on rows ``x`` ``(T, h)``: each expert runs only on its routed rows."""
    weights, experts = top_k_route(F.linear(x, w_router), k)
    out = torch.zeros_like(x)
    for e in range(w_in.shape[0]):
        token, slot = torch.nonzero(experts == e, as_tuple=True)
        if token.numel():
            y = expert_forward(x[token], w_in[e], w_out[e]) * weights[token, slot, None]
            out = out.index_add(0, token, y)
    return out


def dense_moe(x: torch.Tensor, w_router: torch.Tensor, w_in: torch.Tensor,
              w_out: torch.Tensor, k: int) -> torch.Tensor:
    """The same layer computed densely: every expert on every token, weighted by the
    routing weight (zero where the token was not routed): ``E / k`` times the FLOPs."""
    weights, experts = top_k_route(F.linear(x, w_router), k)
    gate = torch.zeros(x.shape[0], w_in.shape[0], dtype=x.dtype).scatter(1, experts, weights)
    every = torch.stack([expert_forward(x, w_in[e], w_out[e]) for e in range(w_in.shape[0])],
                        dim=1)  # (T, E, h)
    return (every * gate[..., None]).sum(1)


def capacity(tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows each expert keeps: ``ceil(tokens k / E * capacity_factor)`` (Megatron-Core
    ``get_capacity(num_tokens * topk, num_experts, capacity_factor)``)."""
    return math.ceil(tokens * k / num_experts * capacity_factor)


def capacity_keep(weights: torch.Tensor, experts: torch.Tensor, num_experts: int,
                  capacity_factor: float) -> torch.Tensor:
    """``(T, k)`` booleans: which routed slots their expert keeps, at most ``capacity`` per
    expert, those with the largest weights (the rest are dropped: that slot contributes
    nothing, the token passes through the residual)."""
    cap = capacity(experts.shape[0], experts.shape[1], num_experts, capacity_factor)
    keep = torch.zeros_like(experts, dtype=torch.bool)
    for e in range(num_experts):
        token, slot = torch.nonzero(experts == e, as_tuple=True)
        best = torch.argsort(weights[token, slot], descending=True, stable=True)[:cap]
        keep[token[best], slot[best]] = True
    return keep


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits as an autograd function: forward sends
    ``send_counts[j]`` rows to rank ``j`` and receives ``recv_counts[j]`` from it; backward
    sends the gradients back the way the rows came (the counts swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_counts: list[int],  # type: ignore[override]
                recv_counts: list[int]) -> torch.Tensor:
        ctx.counts = (list(send_counts), list(recv_counts))
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(recv_counts), list(send_counts))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        send, recv = ctx.counts
        out = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send, recv)
        return out, None, None


def ep_moe_forward(x: torch.Tensor, w_router: torch.Tensor, w_in: torch.Tensor,
                   w_out: torch.Tensor, k: int) -> torch.Tensor:
    """The MoE layer with expert parallelism: ``x`` this rank's rows, ``w_router`` whole,
    ``w_in`` / ``w_out`` this rank's ``E / R`` experts; returns this rank's rows of the whole
    layer's output."""
    world, local = dist.get_world_size(), w_in.shape[0]
    experts_total = local * world
    weights, experts = top_k_route(F.linear(x, w_router), k)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)              # routed slots grouped by expert
    token = torch.arange(x.shape[0]).repeat_interleave(k)[order]
    per_expert = torch.bincount(flat, minlength=experts_total)
    got = torch.empty_like(per_expert)
    dist.all_to_all_single(got, per_expert)               # [src][local expert] counts
    send = per_expert.view(world, local).sum(1).tolist()
    recv_by_expert = got.view(world, local)
    recv = recv_by_expert.sum(1).tolist()
    rows = AllToAll.apply(x[token], send, recv)           # dispatch
    which = torch.arange(local).repeat(world).repeat_interleave(recv_by_expert.flatten())
    out = torch.zeros_like(rows)
    for e in range(local):  # every expert, even on no rows: the combine's backward must run
        idx = torch.nonzero(which == e, as_tuple=True)[0]
        out = out.index_copy(0, idx, expert_forward(rows[idx], w_in[e], w_out[e]))
    back = AllToAll.apply(out, recv, send)                # combine
    gate = weights.flatten()[order, None]
    return torch.zeros_like(x).index_add(0, token, back * gate)


def rank_experts(rank: int, world: int, num_experts: int) -> slice:
    """The experts rank ``rank`` of ``world`` holds: a contiguous block of ``E / world``."""
    if num_experts % world:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {world} ranks: "
                         "choose an expert-parallel size that divides the experts")
    per = num_experts // world
    return slice(rank * per, (rank + 1) * per)


def demo(rank: int, world: int, tokens: int = 8, hidden: int = 16, ffn: int = 32,
         experts: int = 8, k: int = 2) -> float:
    """torchrun smoke test: the expert-parallel layer against the whole layer in this
    process; the largest difference of outputs, input gradients and this rank's expert
    gradients (0.0 up to rounding when right)."""
    torch.manual_seed(0)  # every rank builds the same whole layer and batch
    x = torch.randn(world * tokens, hidden, dtype=torch.float64)
    w_router = torch.randn(experts, hidden, dtype=torch.float64)
    w_in = torch.randn(experts, ffn, hidden, dtype=torch.float64) / hidden ** 0.5
    w_out = torch.randn(experts, hidden, ffn, dtype=torch.float64) / ffn ** 0.5
    whole = [t.clone().requires_grad_(True) for t in (x, w_in, w_out)]
    moe_forward(whole[0], w_router, whole[1], whole[2], k).square().sum().backward()
    mine, held = slice(rank * tokens, (rank + 1) * tokens), rank_experts(rank, world, experts)
    part = [x[mine].clone().requires_grad_(True), w_in[held].clone().requires_grad_(True),
            w_out[held].clone().requires_grad_(True)]
    out = ep_moe_forward(part[0], w_router, part[1], part[2], k)
    out.square().sum().backward()
    ref = moe_forward(x, w_router, w_in, w_out, k)[mine]
    diffs = [out.detach() - ref, part[0].grad - whole[0].grad[mine],
             part[1].grad - whole[1].grad[held], part[2].grad - whole[2].grad[held]]
    return float(max(d.abs().max() for d in diffs))
