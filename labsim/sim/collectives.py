"""Collectives in simpy: the simulated face of ``labsim.estimate_collective`` (same arguments,
same ``CollectiveResult``).

* NCCL model (default): the collective is one flow on the cluster's network (``labsim.network
  .collective_flow``: its loads on every member's port and every NIC it uses), after NCCL's
  latency; the trace has one span per rank (``"comm"``), labelled with NCCL's choice.
* Textbook model (``protocol="alpha-beta"``): every step of the schedule is a flow of its
  transfers' bytes after the step's alpha; steps follow each other.  Trace ``detail``:
  ``"full"`` one span per transfer (ending in proportion to its bytes), ``"step"`` one per
  step, ``"phase"`` one per phase, ``"auto"`` full up to 20 000 transfers, else step up to
  20 000 steps, else phase.

``start_collective`` runs one inside a simulation you own, beside other traffic on the same
``Network`` (a training step does so; ``labsim.sim.step``).
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np
import simpy

from labsim.cluster import Cluster
from labsim.collectives.estimate import (
    TEXTBOOK,
    CollectiveResult,
    _result,
    resolve,
    step_pipes,
    textbook_steps,
)
from labsim.collectives.group import group_of
from labsim.collectives.nccl import NCCL_OPS, plan_collective
from labsim.collectives.schedule import PIPELINE_BYTES, Step, normalize
from labsim.network import collective_flow
from labsim.sim.network import Network
from labsim.trace import Trace

DETAILS = ("full", "step", "phase", "auto")
AUTO_LIMIT = 20_000


def run_steps(net: Network, cluster: Cluster, steps: list[Step],
              records: list[tuple]) -> Generator:
    """A simpy process body: the textbook steps one after another; appends (start, end,
    step) to ``records``."""
    for step in steps:
        pipes, loads, alpha = step_pipes(step, cluster)
        heaviest = float(loads.max()) if len(pipes) else 0.0
        start = net.env.now
        if heaviest > 0:
            yield net.flow(heaviest, pipes, loads / heaviest, latency=alpha)
        elif alpha > 0:
            yield net.env.timeout(alpha)
        records.append((start, net.env.now, step))


def _trace_steps(records: list[tuple], detail: str) -> Trace:
    trace = Trace(detail=detail)
    if detail == "full":
        for start, end, step in records:
            ends = start + (end - start) * step.nbytes / step.max_bytes
            for i, (src, dst) in enumerate(zip(step.pattern.src, step.pattern.dst)):
                trace.add(int(src), "comm", "send", start, float(ends[i]),
                          f"{step.label} -> {int(dst)}", float(step.nbytes[i]), dst=int(dst),
                          phase=step.phase)
    elif detail == "step":
        for start, end, step in records:
            trace.add(int(step.pattern.src[0]), "comm", "comm", start, end, step.label,
                      step.total_bytes, transfers=len(step), phase=step.phase)
    else:
        i = 0
        while i < len(records):
            j = i
            while j + 1 < len(records) and records[j + 1][2].phase == records[i][2].phase:
                j += 1
            group = records[i:j + 1]
            trace.add(int(records[i][2].pattern.src[0]), "comm", "comm", records[i][0],
                      records[j][1], records[i][2].phase,
                      sum(r[2].total_bytes for r in group), steps=len(group),
                      transfers=sum(len(r[2]) for r in group))
            i = j + 1
    return trace


def start_collective(net: Network, cluster: Cluster, op: str, nbytes: float, ranks: list,
                     algorithm: str = "auto", protocol: str = "auto") -> simpy.Event:
    """Start ``op`` among ``ranks`` on a network of ``cluster.pipe_capacities()`` you own (NCCL
    model); the event fires when it is done.  Collectives started together share the links
    they both use."""
    cost = plan_collective(op, nbytes, group_of(cluster, ranks), algorithm, protocol)
    pipes, loads = collective_flow(cluster, ranks, cost)
    return net.flow(cost.nbytes, pipes, loads, cost.cap_Bps, cost.latency_s)


def simulate_collective(op: str, nbytes: float, cluster: Cluster, algorithm: str = "auto",
                        ranks: object = None, *, protocol: str = "auto",
                        achieved: bool = True, detail: str = "auto",
                        piece_bytes: int = PIPELINE_BYTES) -> CollectiveResult:
    """Simulate ``op`` on ``nbytes`` (nccl-tests size) among ``ranks`` (None: every GPU; an int
    n: ranks 0..n-1; or a list) of ``cluster`` (module doc)."""
    if detail not in DETAILS:
        raise ValueError(f"detail must be one of {DETAILS}, got {detail!r}")
    op, size, members = resolve(op, nbytes, cluster, ranks)
    n = len(members)
    env = simpy.Environment()
    net = Network(env, cluster.pipe_capacities(achieved))
    if protocol == TEXTBOOK:
        if algorithm == "auto":
            algorithm = "ring" if op != "alltoall" else "pairwise"
        steps = textbook_steps(op, size, members, cluster, algorithm, piece_bytes)
        records: list[tuple] = []
        env.process(run_steps(net, cluster, steps, records))
        env.run()
        transfers = sum(len(s) for s in steps)
        if detail == "auto":
            detail = ("full" if transfers <= AUTO_LIMIT else
                      "step" if len(steps) <= AUTO_LIMIT else "phase")
        _, algo = normalize(op, algorithm, n, size)
        return _result(op, algo, TEXTBOOK, size, n, float(env.now), cluster, 0, len(steps),
                       transfers, achieved, net.moved.copy(), _trace_steps(records, detail),
                       net.events)
    if op not in NCCL_OPS:
        raise ValueError(f"{op} has no NCCL model; use protocol='alpha-beta'")
    cost = plan_collective(op, size, group_of(cluster, members), algorithm, protocol)
    pipes, loads = collective_flow(cluster, members, cost)
    done = net.flow(cost.nbytes, pipes, loads, cost.cap_Bps, cost.latency_s)
    env.run()
    t = float(env.now) if done.triggered else 0.0
    trace = Trace(detail="rank")
    label = f"{op} {cost.algorithm}/{cost.protocol}, {cost.channels} channels"
    shown = members if n <= AUTO_LIMIT else members[:1]
    for r in shown:
        trace.add(int(r), "comm", "comm", 0.0, t, label, size)
    moved = net.moved.copy()
    np.maximum(moved, 0.0, out=moved)
    return _result(op, cost.algorithm, cost.protocol, size, n, t, cluster, cost.channels, 1,
                   n, achieved, moved, trace, net.events)
