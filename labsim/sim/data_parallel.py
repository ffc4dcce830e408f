"""Data-parallel studies over ``simulate_step``: exposed communication, bucket size, scaling.

* ``exposed_comm_s``: the part of a step's gradient communication that compute did not hide,
  step time minus stage 0's compute and optimizer time (pipeline depth 1).
* ``bucket_sweep``: exposed communication against the DDP bucket size.  Too small: every
  bucket pays the ring's 2(N-1) latencies; too large: the last bucket, ready only when
  backward ends, carries most of the bytes and nothing is left to overlap it with.
* ``dp_scaling``: scaling efficiency T(1) N / T(N) ... as tokens/s(N) / (N tokens/s(1)) for
  a fixed per-GPU batch (weak scaling), with ``accumulation`` micro-batches per step.
* ``flat_cluster``: N GPUs all joined by one kind of link (one NVLink or PCIe switch of N
  GPUs, or N one-GPU nodes on InfiniBand), to compare NVLink with InfiniBand at the same GPU
  count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from labsim.cluster import Cluster
from labsim.hardware import link as labsim_link
from labsim.plan import Plan
from labsim.sim.step import simulate_step
from labsim.software import SoftwareProfile
from labsim.step import StepResult
from labsim.workload import Transformer

__all__ = ["bucket_sweep", "dp_scaling", "exposed_comm_s", "flat_cluster"]


def exposed_comm_s(result: StepResult) -> float:
    """Seconds of the step not covered by stage 0's compute or optimizer (pp = 1 plans)."""
    busy = sum(v for k, v in result.breakdown.items() if k not in ("comm", "send"))
    return max(0.0, result.step_time_s - busy)


def bucket_sweep(model: Transformer, cluster: Cluster, plan: Plan,
                 bucket_bytes: Sequence[float]) -> list[dict[str, float]]:
    """For each bucket size: step time, total and exposed communication seconds."""
    rows = []
    for b in bucket_bytes:
        r = simulate_step(model, cluster, replace(plan, bucket_bytes=float(b)), memory=False)
        rows.append({"bucket_bytes": float(b), "step_s": r.step_time_s,
                     "comm_s": r.breakdown.get("comm", 0.0), "exposed_s": exposed_comm_s(r)})
    return rows


def flat_cluster(gpu: str, n: int, link: str) -> Cluster:
    """``n`` GPUs where every pair talks over ``link``: one switch domain of ``n`` GPUs for a
    GPU link (NVLink, PCIe), ``n`` one-GPU nodes with a NIC each on a non-blocking fabric for
    a network link (InfiniBand, Ethernet), which is how NCCL sees such a machine."""
    chosen = labsim_link(link)
    if chosen.kind == "net":
        return Cluster(gpu, n, 1, "nvlink3", chosen, 1, name=f"{n}x{gpu} all on {chosen.name}")
    return Cluster(gpu, 1, n, chosen, chosen, name=f"{n}x{gpu} all on {chosen.name}")


def dp_scaling(model: Transformer, clusters: Sequence[Cluster], *, micro_batch: int = 1,
               accumulation: int = 1, overlap: bool = True,
               bucket_bytes: float = 25 * 2**20,
               software: str | SoftwareProfile = "generic") -> list[dict[str, float]]:
    """Weak scaling of data parallelism: each cluster's GPUs all in dp, ``micro_batch`` x
    ``accumulation`` sequences per GPU per step.  Efficiency = tokens/s / (N x tokens/s of
    one GPU running the same per-GPU work).  ``software``: the profile (a forced
    ``dp_nccl_algo`` shows what NCCL's algorithm choice is worth)."""
    rows = []
    base: float | None = None
    for c in clusters:
        n = c.world_size
        plan = Plan(dp=n, micro_batch=micro_batch, global_batch=n * micro_batch * accumulation,
                    overlap_grad_reduce=overlap, bucket_bytes=bucket_bytes,
                    software=software)
        r = simulate_step(model, c, plan, memory=False)
        if base is None:
            one = replace(c, nodes=1, gpus_per_node=1, nics_per_node=1, name="one GPU")
            solo = simulate_step(model, one, replace(plan, dp=1, global_batch=micro_batch *
                                                     accumulation), memory=False)
            base = solo.tokens_per_s
        rows.append({"gpus": n, "tokens_per_s": r.tokens_per_s, "step_s": r.step_time_s,
                     "efficiency": r.tokens_per_s / (n * base), "exposed_s": exposed_comm_s(r)})
    return rows
