"""Collectives as simpy processes: the simulated face of ``labsim.collectives``.

``simulate_collective`` moves every chunk of a collective's schedule over the cluster's
shared links and records the transfers in a ``Trace``.  ``run_collective`` is the same thing
as a process inside a simulation you own (a training step runs many collectives at once on
one ``Network``, and they contend for links).

Trace detail (``detail=``) chooses what is recorded, never what is simulated, so times are
identical at every level:

* ``"full"``: one span per transfer, on the sender's ``comm`` stream (its end is when that
  transfer's bytes were through at the rate it started with);
* ``"step"``: one span per step on the group's first rank (label, bytes of the whole step);
* ``"phase"``: one span per phase (reduce-scatter, inter-node, ...) on the first rank;
* ``"auto"``: ``full`` up to 20 000 transfers, else ``step`` up to 20 000 steps, else ``phase``.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import simpy

from labsim.cluster import Cluster
from labsim.collectives.cost import algbw, busbw_factor, group_ranks
from labsim.collectives.schedule import PIPELINE_BYTES, Step, normalize, schedule
from labsim.sim.network import Network
from labsim.trace import Trace
from labsim.units import fmt_bandwidth, fmt_bytes, fmt_time

DETAILS = ("full", "step", "phase", "auto")
AUTO_LIMIT = 20_000


@dataclass(frozen=True, repr=False)
class CollectiveResult:
    """One simulated collective: time, nccl-tests bandwidths, the trace and link loads.

    ``algbw_Bps`` = S / t; ``busbw_Bps`` = algbw x nccl-tests factor (all-reduce 2(n-1)/n).
    ``pipe_bytes[i]`` is what pipe ``i`` of ``cluster`` carried (``cluster.pipe_names()``).
    """

    op: str
    algorithm: str
    nbytes: float
    n: int
    time_s: float
    algbw_Bps: float
    busbw_Bps: float
    trace: Trace
    cluster: Cluster
    steps: int
    transfers: int
    events: int
    network: Network = field(compare=False, repr=False)
    achieved: bool = True

    @cached_property
    def pipe_bytes(self) -> np.ndarray:
        """Bytes each pipe carried (index as ``cluster.pipe_names()``)."""
        return self.network.pipe_bytes

    def __repr__(self) -> str:
        return (f"CollectiveResult({self.op} {self.algorithm}, {fmt_bytes(self.nbytes)} on "
                f"{self.n} GPUs of {self.cluster.name}: {fmt_time(self.time_s)}, algbw "
                f"{fmt_bandwidth(self.algbw_Bps)}, busbw {fmt_bandwidth(self.busbw_Bps)}, "
                f"{self.steps} steps, {self.transfers} transfers)")

    def link_utilisation(self) -> dict[str, float]:
        """Fraction of the run each pipe was busy at its full bandwidth (used pipes only)."""
        cap = self.cluster.pipe_capacities(self.achieved)
        names = self.cluster.pipe_names()
        if self.time_s <= 0:
            return {}
        util = self.pipe_bytes / (cap * self.time_s)
        return {names[i]: float(util[i]) for i in np.flatnonzero(self.pipe_bytes)}


def _full_spans(trace: Trace, stream: str, step: Step, start: float, end: float,
                alpha: float, rates: np.ndarray) -> None:
    src, dst = step.pattern.src, step.pattern.dst
    ends = np.minimum(start + alpha + step.nbytes / rates, end)
    for i in range(len(src)):
        trace.add(int(src[i]), stream, "send", start, float(ends[i]),
                  f"{step.label} -> {int(dst[i])}", float(step.nbytes[i]), dst=int(dst[i]),
                  phase=step.phase)


def _coarse_spans(trace: Trace, stream: str, records: list[tuple], level: str) -> None:
    """records: (start, end, label, phase, bytes, first rank, transfers) per step."""
    if level == "step":
        for start, end, label, phase, nbytes, rank, m in records:
            trace.add(rank, stream, "comm", start, end, label, nbytes, transfers=m,
                      phase=phase)
        return
    i = 0
    while i < len(records):
        j = i
        while j + 1 < len(records) and records[j + 1][3] == records[i][3]:
            j += 1
        group = records[i:j + 1]
        trace.add(records[i][5], stream, "comm", records[i][0], records[j][1], records[i][3],
                  sum(r[4] for r in group), steps=len(group),
                  transfers=sum(r[6] for r in group))
        i = j + 1


def run_collective(network: Network, steps: Iterable[Step], trace: Trace | None = None,
                   detail: str = "auto", stream: str = "comm") -> Generator:
    """A simpy process body: run ``steps`` one after another on ``network``.

    Spans go into ``trace`` (if given) on ``stream`` at ``detail`` (module doc) once the
    collective ends; the process value is ``(steps, transfers, detail used)``.
    """
    if detail not in DETAILS:
        raise ValueError(f"detail must be one of {DETAILS}, got {detail!r}")
    env = network.env
    records: list[tuple] = []
    full: list[tuple] | None = [] if detail in ("full", "auto") else None
    moved = count = 0
    for step in steps:
        start = env.now
        rates = yield network.transfer(step)
        moved += len(step)
        count += 1
        if trace is None:
            continue
        records.append((start, env.now, step.label, step.phase, step.total_bytes,
                        int(step.pattern.src[0]), len(step)))
        if full is not None:
            if detail == "auto" and moved > AUTO_LIMIT:
                full = None
            else:
                full.append((step, start, env.now, network.patterns.get(step.pattern)[1],
                             rates))
    if detail == "auto":
        detail = ("full" if full is not None else
                  "step" if len(records) <= AUTO_LIMIT else "phase")
    if trace is not None:
        if detail == "full":
            for args in full or ():
                _full_spans(trace, stream, *args)
        else:
            _coarse_spans(trace, stream, records, detail)
    return count, moved, detail


def start_collective(network: Network, op: str, nbytes: float, ranks: Sequence[int],
                     algorithm: str = "ring", *, trace: Trace | None = None,
                     detail: str = "step", stream: str = "comm",
                     piece_bytes: int = PIPELINE_BYTES) -> simpy.Process:
    """Start ``op`` among ``ranks`` as a process on a network you own, next to other work.

    For a training step: one ``Network`` per simulation, then e.g.
    ``yield start_collective(net, "allreduce", grad_bytes, dp_group, trace=tr,
    stream="dp-comm")`` inside a rank's process.  Collectives started at the same time share
    the links they both use (max-min fair), so concurrent TP and DP traffic slow each other
    down exactly where they meet.
    """
    steps = schedule(op, nbytes, list(ranks), algorithm, network.cluster, piece_bytes)
    return network.env.process(run_collective(network, steps, trace, detail, stream))


def simulate_collective(op: str, nbytes: float, cluster: Cluster, algorithm: str = "ring",
                        ranks: Sequence[int] | int | None = None, *, achieved: bool = True,
                        detail: str = "auto", piece_bytes: int = PIPELINE_BYTES,
                        ) -> CollectiveResult:
    """Simulate ``op`` on ``nbytes`` (nccl-tests size) among ``ranks`` of ``cluster``.

    ``ranks``: None for every GPU, an int n for ranks 0..n-1, or a list of ranks.  Alone on
    one node with one ring this equals ``collective_time`` to rounding error.
    """
    group = group_ranks(cluster, ranks)
    op, algo = normalize(op, algorithm, len(group), nbytes)
    if detail not in DETAILS:
        raise ValueError(f"detail must be one of {DETAILS}, got {detail!r}")
    nbytes = int(nbytes)
    env = simpy.Environment()
    network = Network(env, cluster, achieved)
    trace = Trace()
    proc = env.process(run_collective(
        network, schedule(op, nbytes, group, algo, cluster, piece_bytes), trace, detail))
    env.run()
    steps, transfers, trace.detail = proc.value
    t = float(env.now)
    n = len(group)
    return CollectiveResult(
        op, algo, float(nbytes), n, t, algbw(nbytes, t), algbw(nbytes, t) * busbw_factor(op, n),
        trace, cluster, steps, transfers, network.events, network, achieved)
