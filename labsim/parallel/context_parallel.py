"""Context parallelism by hand: one sequence split over ``R`` processes, attention computed
exactly with ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers",
arXiv:2310.01889) or with DeepSpeed-Ulysses' all-to-alls (Jacobs et al. 2023,
arXiv:2309.14509), as Transformer Engine runs them for Megatron-Core (``cp_comm_type``
``"p2p"`` and ``"a2a"``, ``transformer_engine/pytorch/attention``).  Forward only.

Tensors are ``(batch, heads, tokens, head_dim)``.

* ``partial_attention``: attention of queries on one block of keys and values, with the
  positions of both for a causal mask; returns the output and each row's log-sum-exp of
  scores (``-inf`` and a zero output where a row sees none of the block's keys);
* ``merge_attention``: two partial results over disjoint key blocks merged exactly with the
  online softmax (lab 04): ``lse = logaddexp(lse1, lse2)``, ``o = e^{lse1-lse} o1 +
  e^{lse2-lse} o2``;
* ``zigzag_positions``: for causal attention the sequence is cut into ``2R`` chunks and rank
  ``r`` holds chunks ``r`` and ``2R-1-r`` (Megatron-Core / Transformer Engine's load
  balancing), so that every rank does the same work;
* ``ring_attention``: each rank keeps its queries; its key-value block travels round the
  ring in ``R-1`` steps (send to ``r+1``, receive from ``r-1``), and every step's partial
  result is merged in; chunk pairs entirely above the causal diagonal are skipped, so each
  rank computes ``2R+1`` of the ``(2R)^2`` chunk pairs;
* ``ulysses_attention``: an all-to-all turns the sequence-split Q, K, V into head-split ones
  over the whole sequence, each rank runs ordinary attention on ``heads / R`` heads, a
  second all-to-all turns the output back.

``demo`` runs both against full attention under ``torchrun --nproc_per_node=N -m
labsim.lab.worker labsim.parallel.context_parallel:demo``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labsim.context_parallel import zigzag_positions as _zigzag


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of queries ``q`` on the block ``k``, ``v``: ``o`` ``(b, h, n, d)``
    normalised over this block only, ``lse`` ``(b, h, n)`` the log-sum-exp of the scaled
    scores; with ``causal`` a query at position ``p`` sees keys at positions ``<= p``."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(scores.dtype).min))
    return torch.nan_to_num(weights) @ v, lse


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                    lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint key blocks, merged: exact attention over both."""
    lse = torch.logaddexp(lse1, lse2)
    safe = lse.clamp_min(torch.finfo(lse.dtype).min)
    w1, w2 = torch.exp(lse1 - safe), torch.exp(lse2 - safe)
    return w1[..., None] * o1 + w2[..., None] * o2, lse


def zigzag_positions(rank: int, world: int, tokens: int) -> torch.Tensor:
    """Positions of the ``tokens`` a rank holds under the load-balanced split
    (``labsim.context_parallel.zigzag_positions``), as a tensor."""
    return torch.tensor(_zigzag(rank, world, tokens))


def contiguous_positions(rank: int, world: int, tokens: int) -> torch.Tensor:
    """Positions of the ``tokens`` a rank holds when the sequence is cut in ``world`` blocks."""
    return torch.arange(rank * tokens, (rank + 1) * tokens)


def _chunks(x: torch.Tensor, pos: torch.Tensor, causal: bool
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A rank's tokens as the chunks that are contiguous in the sequence (two when causal)."""
    if not causal:
        return [(x, pos)]
    c = x.shape[-2] // 2
    return [(x[..., :c, :], pos[:c]), (x[..., c:, :], pos[c:])]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool) -> torch.Tensor:
    """Exact attention of this rank's queries on the whole sequence: K/V blocks passed round
    the ring, partial results merged.  With ``causal`` the rank holds the zigzag chunks
    (``zigzag_positions``); chunk pairs above the diagonal are not computed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = q.shape[-2]
    where = zigzag_positions if causal else contiguous_positions
    q_parts = _chunks(q, where(rank, world, n), causal)
    outs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(q_parts)
    kv = torch.stack([k, v]).contiguous()
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:  # start passing the block on while this step computes
            nxt = torch.empty_like(kv)
            reqs = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, kv, (rank + 1) % world),
                dist.P2POp(dist.irecv, nxt, (rank - 1) % world)])
        for i, (qc, qp) in enumerate(q_parts):
            for (kc, kp), (vc, _) in zip(_chunks(kv[0], where(src, world, n), causal),
                                         _chunks(kv[1], where(src, world, n), causal)):
                if causal and int(kp[0]) > int(qp[-1]):
                    continue  # every key after every query: nothing to see
                part = partial_attention(qc, kc, vc, qp, kp, causal)
                outs[i] = part if outs[i] is None else merge_attention(*outs[i], *part)
        if step < world - 1:
            for req in reqs:
                req.wait()
            kv = nxt
    return torch.cat([o for o, _ in outs], dim=-2)  # type: ignore[misc]


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` in ``world`` along ``scatter_dim``, send piece ``j`` to rank ``j``, and
    concatenate what arrives along ``gather_dim`` in rank order."""
    world = dist.get_world_size()
    send = [p.contiguous() for p in x.chunk(world, dim=scatter_dim)]
    recv = [torch.empty_like(p) for p in send]
    dist.all_to_all(recv, send)
    return torch.cat(recv, dim=gather_dim)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      causal: bool) -> torch.Tensor:
    """Exact attention of this rank's (contiguous) block of the sequence: all-to-all to
    ``heads / R`` heads over the whole sequence, attention, all-to-all back."""
    q, k, v = (_all_to_all(t, scatter_dim=1, gather_dim=2) for t in (q, k, v))
    s = q.shape[-2]
    pos = torch.arange(s)
    out, _ = partial_attention(q, k, v, pos, pos, causal)
    return _all_to_all(out, scatter_dim=2, gather_dim=1)


def demo(rank: int, world: int, batch: int = 1, heads: int = 4, tokens: int = 8,
         head_dim: int = 16) -> float:
    """torchrun smoke test: ring (causal and not) and Ulysses attention against full attention
    of the whole sequence on this rank; the largest difference (0.0 up to rounding)."""
    torch.manual_seed(0)  # every rank builds the same whole sequence
    s = world * tokens
    q, k, v = (torch.randn(batch, heads, s, head_dim, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(s)
    worst = 0.0
    for causal in (False, True):
        full, _ = partial_attention(q, k, v, pos, pos, causal)
        where = (zigzag_positions if causal else contiguous_positions)(rank, world, tokens)
        ring = ring_attention(q[..., where, :], k[..., where, :], v[..., where, :], causal)
        mine = contiguous_positions(rank, world, tokens)
        uly = ulysses_attention(q[..., mine, :], k[..., mine, :], v[..., mine, :], causal)
        worst = max(worst, float((ring - full[..., where, :]).abs().max()),
                    float((uly - full[..., mine, :]).abs().max()))
    return worst
