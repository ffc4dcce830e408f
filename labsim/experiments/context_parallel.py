"""Studies of the long-context lab: what the learner's ring attention costs each rank on real
processes, and what ``labsim`` says of long sequences at scale.

Measured (``ring_worker``, one launch of 4 gloo processes): for each sequence length, each
rank runs the learner's ring attention (causal, load-balanced chunks) and reports its matmul
FLOPs, the elements it sent and its peak of new tensor bytes (``labsim.lab.profile.peak_bytes``);
rank 0 also runs the learner's ``partial_attention`` on the whole sequence at once (full
attention on one process) for the same peak.

Simulated: ``attention_share_rows`` (the ``s^2`` attention core's share of a layer's FLOPs as
the sequence grows), ``ring_step_rows`` (one ring step's attention against its K/V send,
inside a node and across nodes: when the sends hide) and ``llama3_long_context`` (the
long-context stage of Llama 3 405B as Meta ran it, context parallel 16).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from labsim.attention import attention_flops
from labsim.cluster import Cluster
from labsim.context_parallel import zigzag_chunk_pairs, zigzag_positions
from labsim.workload import Transformer


@dataclass(frozen=True)
class RingRun:
    """One rank at one sequence length: its matmul FLOPs, elements sent, peak new bytes of
    its ring attention, and (rank 0) the peak of full attention on the whole sequence."""

    rank: int
    seq_len: int
    flops: int
    sent: int
    peak_bytes: int
    full_peak_bytes: int = 0


def ring_worker(rank: int, world: int, ring: Callable[..., Any], partial: Callable[..., Any],
                seq_lens: Sequence[int] = (512, 1024, 2048), heads: int = 2,
                head_dim: int = 32) -> list[RingRun]:
    """This rank's ``RingRun`` at each sequence length (module doc)."""
    import torch.distributed as dist

    from labsim.lab.comm import CommRecorder
    from labsim.lab.profile import peak_bytes

    rows = []
    for s in seq_lens:
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(1, heads, s, head_dim, generator=g) for _ in range(3))
        where = torch.tensor(zigzag_positions(rank, world, s // world))
        mine = [t[..., where, :].contiguous() for t in (q, k, v)]
        with CommRecorder() as rec:
            ring(*mine, True)
        sent = sum(c.numel for c in rec.comms if c.kind == "send")
        peak = peak_bytes(ring, *mine, True)
        full = 0
        if rank == 0:
            pos = torch.arange(s)
            full = peak_bytes(partial, q, k, v, pos, pos, True)
        dist.barrier()
        rows.append(RingRun(rank, s, int(rec.flops), int(sent), int(peak), int(full)))
    return rows


def contiguous_blocks(world: int) -> list[int]:
    """Blocks of ``(s / R)^2`` each rank computes under causal attention when rank ``r``
    holds the ``r``-th contiguous block: ``r + 1`` (those at or before its own)."""
    return [r + 1 for r in range(world)]


def zigzag_blocks(world: int) -> float:
    """The same count under the load-balanced split: ``2R + 1`` pairs of half-blocks, equal
    on every rank (``labsim.context_parallel.zigzag_chunk_pairs``)."""
    return zigzag_chunk_pairs(world) / 4


# -- simulated ----------------------------------------------------------------------------------


def attention_share_rows(model: Transformer, seq_lens: Sequence[int]) -> list[dict[str, float]]:
    """Per sequence length: one layer's forward matmul FLOPs per sequence in its GEMMs
    (``2 s`` per parameter) and in the causal attention core (``QK^T`` and ``PV``, Dao's
    count), and the core's share."""
    rows = []
    for s in seq_lens:
        gemm = 2.0 * s * model.params_per_layer
        core = attention_flops(s, model.head_dim, heads=model.heads, causal=True)
        rows.append({"seq_len": s, "gemm": gemm, "attention": core,
                     "share": core / (core + gemm)})
    return rows


@dataclass(frozen=True)
class RingStep:
    """One ring step forward at one sequence length: the block's attention on one GPU and
    the K/V send beside it, inside a node (NVLink) and across nodes (one NIC per GPU)."""

    seq_len: int
    attention_s: float
    send_nvlink_s: float
    send_ib_s: float

    def shown(self, send_s: float) -> float:
        """The share of the send the block's attention does not hide."""
        return max(0.0, 1.0 - self.attention_s / send_s) if send_s > 0 else 0.0


def ring_step_rows(model: Transformer, cluster: Cluster, cp: int, seq_lens: Sequence[int],
                   micro_batch: int = 1, tp: int = 1) -> list[RingStep]:
    """``cp``-way ring attention of ``model`` (bf16, FlashAttention) at each sequence length:
    a step's attention forward is ``1 / cp`` of the rank's (``labsim.compute.layer_cost``), its
    send one rank's K and V (``labsim.context_parallel.kv_block_bytes``) priced by the NCCL
    model between two GPUs of a node and two of neighbouring nodes."""
    from labsim.collectives.group import group_of
    from labsim.collectives.nccl import plan_collective
    from labsim.compute import layer_cost
    from labsim.context_parallel import kv_block_bytes

    g = cluster.gpus_per_node
    rows = []
    for s in seq_lens:
        m = replace(model, seq_len=s)
        lc = layer_cost(m, micro_batch, cluster.gpu, tp=tp, cp=cp,
                        sequence_parallel=tp > 1)
        kv = kv_block_bytes(m, micro_batch, tp, cp, 2)
        inside = plan_collective("sendrecv", round(kv), group_of(cluster, [0, 1])).time_s
        across = plan_collective("sendrecv", round(kv), group_of(cluster, [g - 1, g])).time_s
        rows.append(RingStep(s, lc.attention_fwd_s / cp, inside, across))
    return rows


def llama3_long_context() -> dict[str, Any]:
    """Llama 3 405B's long-context stage as published (Dubey et al. 2024, Table 4 and section
    3.3.2: 16,384 H100, TP 8, CP 16, PP 16, DP 8, 131,072-token sequences, all-gather context
    parallelism) against ``labsim.simulate_step`` on that layout."""
    from labsim import simulate_step
    from labsim.published import runs

    run = next(r for r in runs() if r.id == "meta2024_llama3_405b_cp16_131k_16384gpu")
    result = simulate_step(run.model, run.cluster, run.plan)
    return {"run": run, "result": result, "measured_s": run.measured_step_s(),
            "error": result.step_time_s / run.measured_step_s() - 1}
