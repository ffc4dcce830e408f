"""Context parallelism: every sequence split over ``cp`` GPUs, each holding ``s / cp`` of its
tokens for every layer, attention the only op that needs the others' (Liu et al. 2023, Ring
Attention, arXiv:2310.01889; Jacobs et al. 2023, DeepSpeed-Ulysses, arXiv:2309.14509).

As Megatron-Core and Transformer Engine run it (``transformer_engine/pytorch/attention``,
``cp_comm_type``; Megatron-Core ``--context-parallel-size``, order ``tp-cp-ep-dp-pp``): the
``cp`` ranks sit between the tensor- and the data-parallel ones, hold the same parameters and
reduce their gradients with the data-parallel ranks (``dp x cp`` of them).  For causal
attention the sequence is cut into ``2 cp`` chunks and rank ``i`` takes chunks ``i`` and ``2 cp
- 1 - i`` so that every rank does the same attention work (load balancing; so ``s`` must
split into ``2 cp`` chunks).  Three ways to bring the keys and values together:

* ``"p2p"`` (ring attention): ``cp - 1`` steps per layer, each rank sending its current K/V
  block to the next while it computes attention on the one it holds; backward passes K/V and
  their gradients round the ring the same way.  A step's send hides behind the block's
  attention when the attention takes longer (long sequences), otherwise the rest shows.
* ``"all_gather"``: K and V all-gathered before attention (backward: gathered again, their
  gradients reduce-scattered), blocking.
* ``"a2a"`` (Ulysses): all-to-alls turn sequence-split Q, K, V into head-split ones over the
  whole sequence and the output back, blocking; the heads (per TP rank) must split over cp.

Everything but attention runs on ``s / cp`` tokens (``local_model``): GEMMs, element-wise
kernels, activations, the pipeline's messages, the TP collectives.
"""

from __future__ import annotations

from dataclasses import replace

from labsim.workload import Transformer

CP_COMM = ("p2p", "all_gather", "a2a")


def check_cp(model: Transformer, cp: int, cp_comm: str, tp: int = 1,
             attention: str = "flash") -> None:
    """Raise ``ValueError`` naming the fix unless ``model``'s sequences split over ``cp``
    ranks the ``cp_comm`` way (module doc)."""
    if cp_comm not in CP_COMM:
        raise ValueError(f"cp_comm={cp_comm!r}: choose one of {CP_COMM}")
    if cp == 1:
        return
    if attention != "flash":
        raise ValueError(f"cp={cp} with attention={attention!r}: context parallelism runs in "
                         "Transformer Engine's fused attention; use attention='flash'")
    if model.seq_len % (2 * cp):
        raise ValueError(f"cp={cp} and seq_len={model.seq_len}: the load-balanced split cuts "
                         f"a sequence into 2 x cp = {2 * cp} equal chunks; choose cp with "
                         f"2 x cp dividing {model.seq_len}")
    if cp_comm == "a2a":
        kv = model.kv_heads or model.heads
        if (model.heads // tp) % cp or max(1, kv // tp) % cp:
            raise ValueError(f"cp={cp} with cp_comm='a2a' splits each TP rank's "
                             f"{model.heads // tp} query and {max(1, kv // tp)} KV heads over "
                             "cp; choose cp dividing both, or cp_comm='p2p'")


def zigzag_positions(rank: int, world: int, tokens: int) -> list[int]:
    """Positions of the ``tokens`` a rank holds under the load-balanced split: chunks ``rank``
    and ``2 world - 1 - rank`` of ``2 world`` equal chunks (module doc)."""
    if tokens % 2:
        raise ValueError(f"{tokens} tokens per rank do not split into two equal chunks: the "
                         "load-balanced split needs the sequence to divide into 2 x ranks chunks")
    c = tokens // 2
    return [i * c + j for i in (rank, 2 * world - 1 - rank) for j in range(c)]


def zigzag_chunk_pairs(world: int) -> int:
    """(query chunk, key chunk) pairs on or below the diagonal a rank computes in causal
    attention under the load-balanced split, each of ``(s / 2 world)^2`` scores: ``2 world +
    1`` on every rank (its early chunk sees ``rank + 1`` chunks, its late one ``2 world -
    rank``)."""
    return 2 * world + 1


def local_model(model: Transformer, cp: int) -> Transformer:
    """``model`` as one context-parallel rank sees it outside attention: ``s / cp`` tokens of
    every sequence."""
    return model if cp == 1 else replace(model, seq_len=model.seq_len // cp)


def kv_block_bytes(model: Transformer, micro_batch: int, tp: int, cp: int,
                   bytes_per_element: float) -> float:
    """One rank's K and V for its ``s / cp`` tokens: what a ring step sends (the KV heads of
    its TP shard, or one head where the TP group replicates them)."""
    kv = model.kv_heads or model.heads
    heads = kv // tp if kv % tp == 0 else 1
    return micro_batch * model.seq_len / cp * 2 * heads * model.head_dim * bytes_per_element


def cp_collectives(model: Transformer, micro_batch: int, tp: int, cp: int, cp_comm: str,
                   bytes_per_element: float) -> list[tuple[str, float, int, int]]:
    """The blocking collectives of one layer's attention over the cp group as ``(op, bytes,
    forward count, backward count)``, for ``"all_gather"`` and ``"a2a"`` (``"p2p"``'s ring
    sends are priced with their overlap, ``labsim.step.inline``).  Bytes as
    ``labsim.collectives`` counts them: an all-gather's gathered buffer, an all-to-all's send
    buffer."""
    if cp == 1 or cp_comm == "p2p":
        return []
    e, kv = bytes_per_element, kv_block_bytes(model, micro_batch, tp, cp, bytes_per_element)
    if cp_comm == "all_gather":  # K, V gathered (forward, again backward), dK, dV scattered
        return [("allgather", kv * cp, 1, 1), ("reduce_scatter", kv * cp, 0, 1)]
    tokens = micro_batch * model.seq_len / cp
    q = tokens * (model.heads // tp) * model.head_dim * e
    return [("alltoall", q + kv, 1, 1), ("alltoall", q, 1, 1)]  # Q, K, V in; output out
