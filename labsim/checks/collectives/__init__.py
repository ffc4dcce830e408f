"""Checks for lab 07 (collectives): a ring all-reduce on real processes, its alpha-beta
time, and nccl-tests' bus bandwidth.

``ring_allreduce`` runs the learner's function on gloo processes through ``check_worker`` (one
launch for every case).  Each rank's result must be the sum over ranks, written into the tensor
it was given, and the recorder (at the dispatcher, so a ``ProcessGroup`` called directly is seen)
must show a ring: only point-to-point ``send``/``recv``, every send to the rank's successor and
every receive from its predecessor (or all the other way round), at most 2(p-1) sends per rank --
exactly 2(p-1) when every chunk is non-empty -- each of at most ceil(S/p) elements (Patarasuk &
Yuan 2009).  ``dist.all_reduce`` or any other collective fails the rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from labsim.checks._core import Case, Outcome, Spec, close, plain_outcome
from labsim.checks._observe import watch
from labsim.collectives import busbw, collective_time
from labsim.experiments.collectives import AllReduce, rank_tensor
from labsim.hardware import Link

RING_SIZES = (1, 2, 3, 5, 7, 64, 1000, 10_001)
RING_DTYPES = ("float64",) * 6 + ("float32", "int64")
NPROCS = 3
P2P = frozenset({"c10d::send", "c10d::recv_", "c10d::recv_any_source_"})
FORBID_RING = ("labsim.checks.collectives.reference:*",
               "labsim.experiments.collectives:torch_allreduce")
FORBID_COST = ("labsim.collectives.cost:*", "labsim.collectives.bandwidth:*")


@dataclass(frozen=True)
class RingCase:
    """One case of the ring check on one rank: what the learner's function returned (or the
    error it raised, as an ``Outcome``), whether it wrote the sum into the tensor it was given,
    and what the recorder saw."""

    numel: int
    dtype: str
    outcome: Outcome
    in_place: bool


def _ring_cases(nprocs: int = NPROCS) -> list[Case]:
    cases = []
    for numel, dtype in zip(RING_SIZES, RING_DTYPES):
        dt = getattr(torch, dtype)
        total = sum(rank_tensor(r, numel, dt).double() for r in range(nprocs)).to(dt)
        tol = close(rtol=1e-5, atol=1e-6) if dtype == "float32" else None  # sum order
        cases.append(Case(f"{numel} element(s) {dtype} on {nprocs} ranks", (numel, dtype),
                          expected=[total] * nprocs, compare=tol))
    return cases


def _ring_drive(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec,
                nprocs: int = NPROCS, timeout_s: float = 120.0) -> list[Outcome]:
    from labsim.lab.launcher import LaunchTimeout, WorkerError, launch

    fn = fns[0]
    try:  # a stub fails at once, before any process group exists
        fn(torch.zeros(1))
    except NotImplementedError as exc:
        return [Outcome.of_error(exc)] * len(cases)
    except Exception:  # noqa: BLE001, S110 - expected: no process group in this process
        pass
    sizes = [int(c.args[0]) for c in cases]
    dtypes = [str(c.args[1]) for c in cases]
    try:
        result = launch(check_worker, nprocs, args=(fn, sizes, dtypes, spec.forbid),
                        timeout_s=timeout_s, progress=spec.title)
    except (LaunchTimeout, WorkerError) as exc:
        return [Outcome.of_error(exc)] * len(cases)
    outcomes = []
    for i in range(len(cases)):
        per_rank: list[RingCase] = [r[i] for r in result]
        bad = next((rc.outcome for rc in per_rank if rc.outcome.error), None)
        observed = {"ranks": [dict(rc.outcome.observed) for rc in per_rank],
                    "in_place": [rc.in_place for rc in per_rank],
                    "references": sorted({ref for rc in per_rank
                                          for ref in rc.outcome.observed.get("references", [])})}
        if bad is not None:
            outcomes.append(Outcome(None, bad.error, bad.error_types, bad.message, observed))
        else:
            outcomes.append(plain_outcome([rc.outcome.value for rc in per_rank], observed))
    return outcomes


def ring_rule(case: Case, out: Outcome, nprocs: int = NPROCS) -> str | None:
    """Only point-to-point messages of at most ceil(S/p) elements, 2(p-1) sends per rank
    (fewer only when some chunks are empty), and the result in the given tensor."""
    numel, dtype = int(case.args[0]), str(case.args[1])
    item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    chunk = math.ceil(numel / nprocs) * item
    sends_needed = 2 * (nprocs - 1)
    for rank, seen in enumerate(out.observed.get("ranks", [])):
        others = sorted({m[0] for m in seen.get("messages", []) if m[0] not in P2P})
        if others:
            return (f"rank {rank} used {', '.join(others)}: a ring all-reduce sends and "
                    "receives point to point only")
        sends = [m for m in seen.get("messages", []) if m[0] == "c10d::send"]
        if len(sends) > sends_needed or (numel >= nprocs and len(sends) != sends_needed):
            return (f"rank {rank} sent {len(sends)} messages; a ring on {nprocs} ranks sends "
                    f"2(p-1) = {sends_needed} (one chunk per step)")
        ring = _ring_neighbours(rank, nprocs, seen.get("messages", []))
        if ring is not None:
            return ring
        big = max((m[1] for m in sends), default=0)
        if big > chunk:
            return (f"rank {rank} sent {big} bytes at once; each ring step sends one chunk of "
                    f"at most ceil(S/p) elements = {chunk} bytes")
    if not all(out.observed.get("in_place", [])):
        return "the sum must be written into the tensor passed in (in place) and returned"
    return None


def _ring_neighbours(rank: int, nprocs: int, messages: Sequence[Sequence[Any]]) -> str | None:
    """A ring: every send goes to one neighbour and every receive comes from the other (either
    direction round the ring).  Sending each chunk straight to its owner (a direct exchange)
    also moves 2(p-1) chunks per rank, but talks to every rank."""
    sent_to = {int(m[4]) for m in messages if m[0] == "c10d::send"}
    received_from = {int(m[4]) for m in messages if m[0] != "c10d::send"}
    after, before = (rank + 1) % nprocs, (rank - 1) % nprocs
    if any(m[0] == "c10d::recv_any_source_" for m in messages):
        return (f"rank {rank} received from any source; in a ring each rank receives from its "
                f"predecessor only (rank {before})")
    for to, frm in ((after, before), (before, after)):
        if sent_to <= {to} and received_from <= {frm}:
            return None
    return (f"rank {rank} sent to ranks {sorted(sent_to)} and received from "
            f"{sorted(received_from)}; in a ring each rank sends only to its successor (rank "
            f"{after}) and receives only from its predecessor (rank {before})")


ring_allreduce = Spec("ring_allreduce", _ring_cases, drive=_ring_drive,
                      compare=close(rtol=1e-12, atol=1e-12), rules=(ring_rule,),
                      forbid=FORBID_RING)
"""``fn(tensor)`` must sum ``tensor`` over all ranks like ``dist.all_reduce``, in place, with
a ring of point-to-point messages, on sizes the world size does not divide and sizes smaller
than it, for floats and ints.  Runs ``fn`` on 3 gloo processes (one launch)."""


def _ring_time_cases() -> list[Case]:
    specs = [("8 GB on 8 A100 (300 GB/s, 3.4 us)", 8e9, 8, 300e9, 3.4e-6),
             ("1 MiB on 4 PCIe GPUs", 2**20, 4, 31.5e9, 5.7e-6),
             ("two ranks", 1e9, 2, 50e9, 14e-6),
             ("1 GiB on 1024 ranks: latency matters", 2**30, 1024, 50e9, 14e-6),
             ("one rank: nothing to do", 1e9, 1, 50e9, 14e-6),
             ("tiny message: latency only", 64, 64, 450e9, 3.4e-6)]
    return [Case(name, (s, n, b, a),
                 expected=collective_time("allreduce", s, n, Link("x", b, a, "check"),
                                          achieved=False))
            for name, s, n, b, a in specs]


ring_time = Spec("ring_time", _ring_time_cases, compare=close(rtol=1e-9), forbid=FORBID_COST,
                 ops=False)
"""``fn(nbytes, n, bandwidth_Bps, latency_s)``: ring all-reduce time in the alpha-beta model,
2(n-1) alpha + 2 (n-1)/n S / B (sizes here divide evenly)."""


def _bus_bandwidth_cases() -> list[Case]:
    specs = [("allreduce", 1e9, 8, 0.01), ("allreduce", 1e9, 2, 0.01),
             ("allgather", 4e9, 4, 0.02), ("reduce_scatter", 4e9, 16, 0.05),
             ("broadcast", 1e9, 8, 0.004), ("alltoall", 2e9, 8, 0.1),
             ("allreduce", 1e9, 1, 0.001)]
    return [Case(f"{op} {s:g} B on {n} ranks in {t:g} s", (op, s, n, t),
                 expected=busbw(op, s, n, t)) for op, s, n, t in specs]


bus_bandwidth = Spec("bus_bandwidth", _bus_bandwidth_cases, compare=close(rtol=1e-9),
                     forbid=FORBID_COST, ops=False)
"""``fn(op, nbytes, n, time_s)``: nccl-tests busbw = S/t x factor(op, n)."""


def _fit_rows(alpha_s: float, bandwidth_Bps: float, ranks: Sequence[int],
              sizes: Sequence[float], noise: float = 0.0) -> list[tuple[float, int, float]]:
    """Times of the alpha-beta ring at every (size, p), each scaled by a fixed factor in
    [1 - noise, 1 + noise] (deterministic: the same rows every time)."""
    rows = []
    for i, (p, s) in enumerate((p, s) for p in ranks for s in sizes):
        t = 2 * (p - 1) * alpha_s + 2 * (p - 1) / p * s / bandwidth_Bps
        rows.append((float(s), int(p), t * (1 + noise * math.sin(1.7 * i + 0.3))))
    return rows


def _fit_cases() -> list[Case]:
    from labsim.checks.collectives.reference import fit_alpha_beta

    grid = [2.0**k for k in range(10, 25, 2)]
    specs = [("exact rows, p = 2 and 3: alpha and B come back", 20e-6, 1e9, (2, 3), grid, 0.0),
             ("one world size is enough: the sizes separate alpha from B", 50e-6, 5e8, (2,),
              grid, 0.0),
             ("a fast network, p = 2, 4, 8", 5e-6, 2e10, (2, 4, 8), grid, 0.0),
             ("10 % noise: the relative least-squares fit", 30e-6, 2e9, (2, 3), grid, 0.10),
             ("noise, few points", 100e-6, 1e8, (2, 3), grid[::3], 0.05),
             ("latency-bound sizes only, with noise", 80e-6, 3e9, (2, 3, 4), grid[:3], 0.03)]
    cases = []
    for name, alpha, bw, ranks, sizes, noise in specs:
        rows = _fit_rows(alpha, bw, ranks, sizes, noise)
        cases.append(Case(name, (rows,), expected=fit_alpha_beta(rows)))
    return cases


fit_alpha_beta = Spec("fit_alpha_beta", _fit_cases, compare=close(rtol=1e-6),
                      forbid=("labsim.checks.collectives.reference:*",), ops=False)
"""``fn(rows) -> (alpha_s, bandwidth_Bps)``: least squares of the ring's alpha-beta time on
the relative error of measured ``(nbytes, p, seconds)`` rows."""


def check_worker(rank: int, world: int, fn: AllReduce, sizes: Sequence[int],
                 dtypes: Sequence[str], forbid: Sequence[str] = ()) -> list[RingCase]:
    """Run the learner's ``fn`` on each (size, dtype) under the recorder and the tripwire.

    A case that raises on some rank is reported, not re-raised, so the other cases still run
    (all ranks call every case in the same order)."""
    import torch.distributed as dist

    out = []
    for numel, dtype in zip(sizes, dtypes):
        x = rank_tensor(rank, numel, getattr(torch, dtype))
        ptr = x.data_ptr()
        with watch(forbid) as seen:
            try:
                got: Any = fn(x)
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                got = exc
        if isinstance(got, Exception):
            outcome = Outcome.of_error(got, seen.summary())
            in_place = False
        else:
            outcome = plain_outcome(got, seen.summary())
            in_place = (isinstance(got, torch.Tensor) and got.data_ptr() == ptr
                        and torch.equal(got, x))
        out.append(RingCase(numel, dtype, outcome, in_place))
        dist.barrier()
    return out
