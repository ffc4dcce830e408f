"""The reference ring all-reduce, from point-to-point messages.

Patarasuk & Yuan's bandwidth-optimal ring (2009, "Bandwidth optimal all-reduce algorithms for
clusters of workstations"), the algorithm NCCL runs for large messages.  The tensor is cut into
``world_size`` chunks (``torch.tensor_split``: when the size does not divide, the first chunks
get one element more).  Reduce-scatter: in step s rank r sends chunk (r - s) mod p to rank r+1
and adds the chunk (r - s - 1) mod p it receives from r-1; after p-1 steps rank r owns the full
sum of chunk (r + 1) mod p.  All-gather: p-1 more steps pass the finished chunks around the
ring.

Under torchrun: ``torchrun --nproc_per_node=4 -m labsim.lab.worker
labsim.checks.collectives.reference:demo`` (gloo on CPUs, NCCL on GPUs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labsim.experiments.collectives import rank_tensor, torch_allreduce


def _exchange(send: torch.Tensor, recv: torch.Tensor, to: int, frm: int) -> None:
    """Send ``send`` to rank ``to`` while receiving ``recv`` from ``frm`` (no deadlock: the
    send is posted asynchronously before the blocking receive)."""
    req = dist.isend(send.contiguous(), to) if send.numel() else None
    if recv.numel():
        dist.recv(recv, frm)
    if req is not None:
        req.wait()


def ring_allreduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over every rank of the default process group, in place, with a ring of
    send/recv; returns ``tensor``.  Any size, including sizes the world size does not divide
    and sizes smaller than it (empty chunks are simply not sent)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    if p == 1:
        return tensor
    flat = tensor.view(-1)
    chunks = list(torch.tensor_split(flat, p))
    right, left = (rank + 1) % p, (rank - 1) % p
    for s in range(p - 1):  # reduce-scatter
        send, recv = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
        buf = torch.empty_like(recv)
        _exchange(send, buf, right, left)
        recv += buf
    for s in range(p - 1):  # all-gather: pass the finished chunks around
        send, recv = chunks[(rank - s + 1) % p], chunks[(rank - s) % p]
        _exchange(send, recv, right, left)
    return tensor


def demo(rank: int, world: int) -> float:
    """torchrun smoke test: the ring's result minus dist.all_reduce's (0.0 when right)."""
    x = rank_tensor(rank, 1_000_003, torch.float32)
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        x = x.cuda()
    return float((ring_allreduce(x.clone()) - torch_allreduce(x.clone())).abs().max())


def fit_alpha_beta(rows: list[tuple[float, int, float]]) -> tuple[float, float]:
    """Fit the ring's alpha-beta model ``t = 2(p-1) alpha + 2 (p-1)/p S / B`` to measured
    ``(nbytes S, ranks p, seconds t)`` rows by least squares on the *relative* error (each row
    divided by its t, so microsecond and millisecond points weigh alike).  Returns
    ``(alpha_s, bandwidth_Bps)``."""
    import numpy as np

    a = np.array([[2 * (p - 1) / t, 2 * (p - 1) / p * s / t] for s, p, t in rows])
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    return float(alpha), float(1.0 / beta)
