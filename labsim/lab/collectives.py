"""Ring all-reduce from point-to-point messages, and the worker drivers of lab 07.

``ring_allreduce`` is the reference: Patarasuk & Yuan's bandwidth-optimal ring (2009), the
algorithm NCCL runs for large messages.  The tensor is cut into ``world_size`` chunks
(``torch.tensor_split``: when the size does not divide, the first chunks get one element
more).  Reduce-scatter: in step s rank r sends chunk (r - s) mod p to rank r+1 and adds the
chunk (r - s - 1) mod p it receives from r-1; after p-1 steps rank r owns the full sum of
chunk (r + 1) mod p.  All-gather: p-1 more steps pass the finished chunks around the ring.

The drivers (``check_worker``, ``timing_worker``) run inside ``labsim.lab.launch`` workers
with a learner's function shipped by value, so a lab needs only one launch per purpose.
Under torchrun: ``torchrun --nproc_per_node=4 -m labsim.lab.worker
labsim.lab.collectives:demo``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

AllReduce = Callable[[torch.Tensor], torch.Tensor]


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


def rank_tensor(rank: int, numel: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A deterministic tensor that differs per rank (so a wrong reduction shows)."""
    g = torch.Generator().manual_seed(1000 + rank * 7919 + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def check_worker(rank: int, world: int, fn: AllReduce, sizes: Sequence[int],
                 dtypes: Sequence[torch.dtype]) -> list[dict[str, Any]]:
    """Run the learner's ``fn`` on each (size, dtype); compare with ``dist.all_reduce``.

    Returns per case: the learner's result (a tensor) or the error it raised, and the
    expected tensor.  A case that raises on some rank is reported, not re-raised, so the
    other cases still run (all ranks call every case in the same order).
    """
    out = []
    for numel, dtype in zip(sizes, dtypes):
        x = rank_tensor(rank, numel, dtype)
        expected = x.clone()
        dist.all_reduce(expected)
        try:
            got: Any = fn(x.clone())
        except NotImplementedError:
            got = NotImplementedError("the function raised NotImplementedError")
        except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
            got = RuntimeError(f"{type(exc).__name__}: {exc}")
        out.append({"numel": numel, "dtype": str(dtype), "got": got, "expected": expected})
        dist.barrier()
    return out


def timing_worker(rank: int, world: int, fns: dict[str, AllReduce], sizes: Sequence[int],
                  repeat: int = 5) -> dict[str, list[float]]:
    """Median seconds per call of each all-reduce function for each size (float32)."""
    times: dict[str, list[float]] = {}
    for name, fn in fns.items():
        times[name] = []
        for numel in sizes:
            x = rank_tensor(rank, numel, torch.float32)
            fn(x.clone())  # warm-up
            samples = []
            for _ in range(repeat):
                y = x.clone()
                dist.barrier()
                t0 = time.perf_counter()
                fn(y)
                dist.barrier()
                samples.append(time.perf_counter() - t0)
            times[name].append(sorted(samples)[len(samples) // 2])
    return times


def torch_allreduce(tensor: torch.Tensor) -> torch.Tensor:
    """``dist.all_reduce`` (gloo's or NCCL's own algorithm), with the same signature."""
    dist.all_reduce(tensor)
    return tensor


def demo(rank: int, world: int) -> float:
    """torchrun smoke test: the ring's result minus dist.all_reduce's (0.0 when right)."""
    x = rank_tensor(rank, 1_000_003, torch.float32)
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        x = x.cuda()
    return float((ring_allreduce(x.clone()) - torch_allreduce(x.clone())).abs().max())
