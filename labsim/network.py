"""How flows share links: the one network model of labsim (values; ``labsim.sim.network``
executes it in time).

A *pipe* is one direction of one link (a GPU's port into its node's switch, a NIC into the
fabric).  A *flow* moves ``nbytes`` of payload and puts ``load`` wire bytes on each of its
pipes per payload byte (a ring all-reduce puts 2(n-1)/n on every member's port; one transfer
puts 1 on the sender's tx and the receiver's rx pipe); it may also have its own ``cap`` on
payload bytes per second (a protocol's or a channel count's limit).

Concurrent flows share pipes by **weighted max-min fairness** (progressive filling, Bertsekas
& Gallager, *Data Networks*, sec. 6.5.2): every unfrozen flow raises its byte rate on its most
loaded pipe at the same pace until a pipe is full or the flow reaches its cap; the flows
through a full pipe freeze; repeat.  Two flows alone on one pipe get half each; a flow alone
gets ``min(cap, min over pipes of capacity / load)`` -- which is why a collective's closed form
(``labsim.collectives.nccl.CollectiveCost.time_s``) and its simulation agree when it is alone.

``collective_flow`` lays a collective's loads on the pipes of a whole cluster (every member
GPU's port, every NIC the group uses) for ``labsim.simulate_collective``; ``FoldedNetwork``
lays a training step's collectives on the pipes of one representative GPU per pipeline stage
(``labsim.step.costs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # annotations only: labsim.collectives imports this module's users
    from labsim.cluster import Cluster
    from labsim.collectives.nccl import CollectiveCost
    from labsim.plan import Plan


def fair_rates(flows: Sequence[tuple[Sequence[int], Sequence[float], float]],
               capacity: Sequence[float]) -> list[float]:
    """Payload rate (bytes/s) of each flow ``(pipes, loads, cap)`` sharing pipes of
    ``capacity`` (bytes/s each), by weighted max-min fairness (module doc).

    A flow that loads no pipe runs at its cap (``inf`` if it has none).
    """
    rate = [0.0] * len(flows)
    weight = [0.0] * len(flows)
    left: dict[int, float] = {}
    active = []
    for i, (pipes, loads, cap) in enumerate(flows):
        heaviest = max(loads, default=0.0)
        if heaviest <= 0:
            rate[i] = cap
            continue
        weight[i] = 1.0 / heaviest
        active.append(i)
        for p in pipes:
            left[p] = float(capacity[p])
    while active:
        use: dict[int, float] = {}
        for i in active:
            for p, load in zip(*flows[i][:2]):
                if load > 0:
                    use[p] = use.get(p, 0.0) + load * weight[i]
        step = min(left[p] / u for p, u in use.items())
        for i in active:
            step = min(step, (flows[i][2] - rate[i]) / weight[i])
        step = max(step, 0.0)
        for p, u in use.items():
            left[p] -= u * step
        for i in active:
            rate[i] += step * weight[i]
        full = {p for p in use if left[p] <= 1e-9 * float(capacity[p])}
        still = [i for i in active if rate[i] < flows[i][2] * (1 - 1e-12)
                 and not any(p in full for p, ld in zip(*flows[i][:2]) if ld > 0)]
        if len(still) == len(active):  # rounding left every pipe a hair from full
            break
        active = still
    return rate


def alone_rate(pipes: Sequence[int], loads: Sequence[float], cap: float,
               capacity: Sequence[float]) -> float:
    """The payload rate of a flow alone: ``min(cap, capacity[p] / load[p])``."""
    rate = cap
    for p, load in zip(pipes, loads):
        if load > 0:
            rate = min(rate, float(capacity[p]) / load)
    return rate


def shared_growth(a: Placed, b: Placed, capacity: np.ndarray) -> tuple[float, float]:
    """How much longer each of two flows takes per second of its bandwidth time alone while
    both move bytes at once: ``alone rate / shared rate - 1`` for ``a`` and for ``b``, the
    shared rates by the network's weighted max-min fairness (0, 0 when no pipe is shared)."""
    if not set(a.pipes) & set(b.pipes):
        return 0.0, 0.0
    shared = fair_rates([(a.pipes, a.loads, a.cap_Bps), (b.pipes, b.loads, b.cap_Bps)],
                        capacity)
    return tuple(alone_rate(f.pipes, f.loads, f.cap_Bps, capacity) / r - 1
                 for f, r in zip((a, b), shared))


def shared_fractions(flows: Sequence[Placed], capacity: np.ndarray) -> list[float]:
    """Each of ``flows``' rate while all of them move at once, as a fraction of its rate
    alone (1: it shares no pipe it is short of), by the network's weighted max-min
    fairness."""
    shared = fair_rates([(f.pipes, f.loads, f.cap_Bps) for f in flows], capacity)
    return [r / alone_rate(f.pipes, f.loads, f.cap_Bps, capacity)
            for f, r in zip(flows, shared)]


def collective_flow(cluster: Cluster, ranks: Sequence[int], cost: CollectiveCost,
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(pipes, loads) of a collective of ``cost`` among ``ranks`` of ``cluster``: its intra
    load on both directions of every member's port, its NIC load on both directions of every
    NIC the members use (``cluster.pipe_names()`` numbering)."""
    ranks = np.asarray(ranks, dtype=np.int64)
    n = cluster.world_size
    pipes, loads = [], []
    if cost.intra_load > 0:
        pipes += [ranks, n + ranks]
        loads += [np.full(2 * len(ranks), cost.intra_load)]
    if cost.nic_load > 0:
        g = cluster.gpus_per_node
        nics = np.unique((ranks // g) * cluster.nics_per_node
                         + (ranks % g) * cluster.nics_per_node // g)
        m = cluster.nodes * cluster.nics_per_node
        pipes += [2 * n + nics, 2 * n + m + nics]
        loads += [np.full(2 * len(nics), cost.nic_load)]
    if not pipes:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    return np.concatenate(pipes), np.concatenate(loads)


class Placed(NamedTuple):
    """A collective of the step on the folded network: its ``cost`` and the ``pipes`` it
    loads with ``loads`` wire bytes per payload byte; ``alone_s`` is its time alone (a
    tuple: a step places one per stage and kind, 250 for a 64-stage plan, and tuples build
    fast)."""

    cost: CollectiveCost
    pipes: tuple[int, ...]
    loads: tuple[float, ...]
    alone_s: float

    @property
    def nbytes(self) -> float:
        return self.cost.nbytes

    @property
    def latency_s(self) -> float:
        return self.cost.latency_s

    @property
    def cap_Bps(self) -> float:
        return self.cost.cap_Bps


class FoldedNetwork:
    """Pipe numbering of the folded network: stage s has ``2s`` (port tx) and ``2s + 1`` (port
    rx); the NIC of each (node, nic) a stage's representative uses has a tx and an rx pipe."""

    def __init__(self, cluster: Cluster, plan: Plan) -> None:  # plan: a labsim.Plan
        self.c, self.plan = cluster, plan
        g = cluster.gpus_per_node
        self.rep = [s * plan.tp * plan.gradient_ranks for s in range(plan.pp)]
        self.node = [r // g for r in self.rep]
        self.stage_gpus = min(g, plan.tp * plan.gradient_ranks)  # GPUs of one stage on its node
        self.stage_nics = max(1, self.stage_gpus * cluster.nics_per_node // g)
        keys: dict[tuple[int, int], int] = {}
        nic_of = {local: cluster.nic_of(local) for local in {r % g for r in self.rep}}
        self.nic_index = [nic_of[r % g] for r in self.rep]  # each representative's NIC
        self.nic = []  # the pipe number of its tx (rx: + 1)
        for r, nic in zip(self.rep, self.nic_index):
            key = (r // g, nic)
            self.nic.append(keys.setdefault(key, 2 * plan.pp + 2 * len(keys)))
        caps = [cluster.intra_node.achieved_Bps] * (2 * plan.pp)
        caps += [cluster.inter_node.achieved_Bps] * (2 * len(keys))
        self.capacity = np.array(caps)
        self._caps = caps  # the same, as floats: indexing a list is cheaper per placement
        # every port pipe has one capacity and every NIC pipe another, so a collective's
        # loads and time alone are the same on every stage and only its pipes differ: by
        # (id(cost), kind of placement), (cost, loads, alone_s, the first Placed), the cost
        # kept alive so that its id stays its own
        self._alone: dict[tuple[int, int], tuple[CollectiveCost, tuple, float, Placed]] = {}

    def place(self, cost: CollectiveCost, stage: int) -> Placed:
        """A group collective of ``stage`` (every stage GPU on the node in an identical group
        at the same time)."""
        pipes: tuple[int, ...] = ()
        if cost.intra_load > 0:
            pipes = (2 * stage, 2 * stage + 1)
        if cost.nic_load > 0:
            pipes += (self.nic[stage], self.nic[stage] + 1)
        known = self._alone.get((id(cost), 2))
        if known is not None:
            return Placed(cost, pipes, known[1], known[2]) if known[1] else known[3]
        loads: list[float] = []
        if cost.intra_load > 0:
            loads += [cost.intra_load] * 2
        if cost.nic_load > 0:
            groups = max(1.0, self.stage_gpus / cost.group.ppn)
            per_nic = groups * cost.nic_load * cost.group.nics / self.stage_nics
            loads += [per_nic] * 2
        return self._placed(cost, pipes, tuple(loads), 2)

    def place_send(self, cost: CollectiveCost, src: int, dst: int) -> Placed:
        """A pipeline message from stage ``src`` to ``dst`` (every stage GPU sends its own)."""
        same = self.node[src] == self.node[dst]  # kind of placement 1: within a node
        pipes = (2 * src, 2 * dst + 1) if same else (self.nic[src], self.nic[dst] + 1)
        known = self._alone.get((id(cost), same))
        if known is not None:
            return Placed(cost, pipes, known[1], known[2]) if known[1] else known[3]
        share = 1.0 if same else self.stage_gpus / self.stage_nics
        return self._placed(cost, pipes, (share, share), same)

    def _placed(self, cost: CollectiveCost, pipes: tuple[int, ...],
                loads: tuple[float, ...], kind: int) -> Placed:
        if cost.nbytes == 0 or cost.group.nranks < 2:
            placed = Placed(cost, (), (), 0.0)
        else:
            rate = alone_rate(pipes, loads, cost.cap_Bps, self._caps)
            placed = Placed(cost, pipes, loads, cost.latency_s + cost.nbytes / rate)
        self._alone[id(cost), kind] = (cost, placed.loads, placed.alone_s, placed)
        return placed
