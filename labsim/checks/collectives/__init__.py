"""Checks for lab 07 (collectives): a ring all-reduce on real processes, its alpha-beta
time, and nccl-tests' bus bandwidth.

``ring_allreduce`` runs the learner's function on gloo processes through ``check_worker``
(one launch for every case) and compares each rank's result with ``dist.all_reduce``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from labsim.checks._core import Case, CheckFailed, close, run_check
from labsim.collectives import busbw, collective_time
from labsim.experiments.collectives import AllReduce, rank_tensor
from labsim.hardware import Link

RING_SIZES = (1, 2, 3, 5, 7, 64, 1000, 10_001)


@dataclass(frozen=True)
class RingCase:
    """One case of the ring check on one rank: the tensor size and dtype, what the learner's
    function returned (or the error it raised) and what ``dist.all_reduce`` gives."""

    numel: int
    dtype: str
    got: torch.Tensor | Exception
    expected: torch.Tensor
RING_DTYPES = (torch.float64,) * 7 + (torch.int64,)


def ring_allreduce(fn: Callable[[torch.Tensor], torch.Tensor], nprocs: int = 3,
                   timeout_s: float = 120.0) -> None:
    """``fn(tensor)`` must sum ``tensor`` over all ranks like ``dist.all_reduce``, on sizes
    that the world size does not divide and sizes smaller than it, for floats and ints.
    Runs ``fn`` on ``nprocs`` gloo processes (one launch)."""
    from labsim.lab.launcher import LaunchTimeout, WorkerError, launch

    title = "ring_allreduce"
    names = [f"{n} element(s) {str(d).replace('torch.', '')} on {nprocs} ranks"
             for n, d in zip(RING_SIZES, RING_DTYPES)]
    try:  # a stub fails at once, before any process group exists
        fn(torch.zeros(1))
    except NotImplementedError:
        outcomes: list[Any] = [NotImplementedError()] * len(RING_SIZES)
        expected: list[Any] = [None] * len(RING_SIZES)
    except Exception:  # noqa: BLE001 - expected: no process group in this process
        outcomes = []
    else:
        outcomes = []
    if not outcomes:
        try:
            result = launch(check_worker, nprocs, args=(fn, RING_SIZES, RING_DTYPES),
                            timeout_s=timeout_s)
        except (LaunchTimeout, WorkerError) as exc:
            raise CheckFailed(f"FAIL {title}: 0/{len(RING_SIZES)} cases passed\n{exc}") \
                from None
        # rank 0's view; every rank must agree, so compare all ranks' results
        outcomes, expected = [], []
        for i in range(len(RING_SIZES)):
            per_rank = [r[i].got for r in result]
            bad = next((g for g in per_rank if isinstance(g, Exception)), None)
            outcomes.append(bad if bad is not None else per_rank)
            expected.append([r[i].expected for r in result])

    def lookup(i: int) -> Any:
        if isinstance(outcomes[i], Exception):
            raise outcomes[i]
        return outcomes[i]

    cases = [Case(names[i], (i,), expected=expected[i]) for i in range(len(RING_SIZES))]
    run_check(title, lookup, cases, compare=close(rtol=1e-12, atol=1e-12))


def ring_time(fn: Callable[[float, int, float, float], float]) -> None:
    """``fn(nbytes, n, bandwidth_Bps, latency_s)``: ring all-reduce time in the alpha-beta
    model, 2(n-1) alpha + 2 (n-1)/n S / B (sizes here divide evenly)."""
    specs = [("8 GB on 8 A100 (300 GB/s, 3.4 us)", 8e9, 8, 300e9, 3.4e-6),
             ("1 MiB on 4 PCIe GPUs", 2**20, 4, 31.5e9, 5.7e-6),
             ("two ranks", 1e9, 2, 50e9, 14e-6),
             ("1 GiB on 1024 ranks: latency matters", 2**30, 1024, 50e9, 14e-6),
             ("one rank: nothing to do", 1e9, 1, 50e9, 14e-6),
             ("tiny message: latency only", 64, 64, 450e9, 3.4e-6)]
    cases = [Case(name, (s, n, b, a),
                  expected=collective_time("allreduce", s, n, Link("x", b, a, "check"),
                                           achieved=False))
             for name, s, n, b, a in specs]
    run_check("ring_time", fn, cases, compare=close(rtol=1e-9))


def bus_bandwidth(fn: Callable[[str, float, int, float], float]) -> None:
    """``fn(op, nbytes, n, time_s)``: nccl-tests busbw = S/t x factor(op, n)."""
    specs = [("allreduce", 1e9, 8, 0.01), ("allreduce", 1e9, 2, 0.01),
             ("allgather", 4e9, 4, 0.02), ("reduce_scatter", 4e9, 16, 0.05),
             ("broadcast", 1e9, 8, 0.004), ("alltoall", 2e9, 8, 0.1),
             ("allreduce", 1e9, 1, 0.001)]
    cases = [Case(f"{op} {s:g} B on {n} ranks in {t:g} s", (op, s, n, t),
                  expected=busbw(op, s, n, t)) for op, s, n, t in specs]
    run_check("bus_bandwidth", fn, cases, compare=close(rtol=1e-9))


def check_worker(rank: int, world: int, fn: AllReduce, sizes: Sequence[int],
                 dtypes: Sequence[torch.dtype]) -> list[RingCase]:
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
        out.append(RingCase(numel, str(dtype), got, expected))
        dist.barrier()
    return out
