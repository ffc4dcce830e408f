"""A 2-D mesh step timed on this machine, and labsim's prediction for the same configuration.

``time_mesh(parallelize, train_step, cfg, rows)`` launches ``dp * tp`` gloo workers once.
Each rank (one thread) measures, at the same moment as the others, what labsim needs to
model it as a "GPU": the rate of an fp32 matmul and of a large copy while every rank is busy
(the ranks share the machine's cores, as they do in the step), then rank 0 measures the same
alone (the one-process step's device).  The tensor-parallel groups time all-reduces of a few
sizes at once, and ``fit_alpha_beta`` fits the ring's alpha-beta time (Thakur et al. 2005;
lab 07) to them.  Then the learner's ``parallelize(model, dp, tp)`` shards a ``MeshGPT`` and
``train_step`` trains it, interleaved round by round with one process's step of the same
model on the whole batch (rank 0 alone, the others waiting at a barrier), so that a load that
comes and goes slows both alike (``labsim.lab.timing``).  One more step runs under
``CommRecorder``: the collectives and matmul FLOPs of one rank.

``predict(cfg, rows, run)`` builds "this machine" from those figures (``this_machine``) and
asks ``labsim.simulate_step`` for both steps; ``explain`` puts measurement, prediction and an
alpha-beta bound side by side.  Two things the step simulator cannot express on this machine,
which the comparison shows rather than hides: its collectives are NCCL's (latencies of
microseconds from NCCL's tuning tables, not gloo's measured alpha), and its kernels are a GPU's
(GEMMs at a size-dependent fraction of the peak fitted on A100 runs, no host work per op).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from labsim.cluster import Cluster
from labsim.hardware import GPU, Link
from labsim.lab.device import Timing
from labsim.lab.timing import spread
from labsim.plan import Plan
from labsim.sim.step import simulate_step
from labsim.step import StepResult
from labsim.workload import Transformer

MATMUL_N = 512  # the measured "peak": an n x n fp32 matmul, as labsim.experiments.profile does
COPY_BYTES = 32e6  # a copy far larger than the caches: read + write at memory speed
ALLREDUCE_NUMELS = (2**10, 2**13, 2**16, 2**18, 2**20)  # float32 elements, 4 KB to 4 MB
LR = 0.01


def fit_alpha_beta(rows: Sequence[tuple[float, float]], p: int = 2) -> tuple[float, float]:
    """``(alpha_s, bandwidth_Bps)`` of a ring all-reduce over ``p`` ranks,
    ``t = 2 (p - 1) alpha + 2 (p - 1) / p * S / B``, fitted to ``rows`` of (bytes S, seconds t)
    by least squares on the relative error (each row weighs alike, small or large); alpha is
    kept >= 0, and when the times do not grow with the size (noise larger than the bytes'
    cost) the bandwidth is infinite: latency alone was measured."""
    if len(rows) < 2:
        raise ValueError("fitting alpha and B needs at least two sizes")
    s = np.array([r[0] for r in rows], dtype=float)
    t = np.array([r[1] for r in rows], dtype=float)
    a = np.stack([np.full_like(s, 2 * (p - 1)), 2 * (p - 1) / p * s], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:  # a negative latency fits noise: refit the bandwidth alone
        alpha = 0.0
        beta = float(np.sum(a[:, 1]) / np.sum(a[:, 1] ** 2))
    if beta <= 0:  # times that fall with size: no byte cost above the noise, latency alone
        alpha = float(np.sum(a[:, 0]) / np.sum(a[:, 0] ** 2))
        return alpha, float("inf")
    return float(alpha), float(1.0 / beta)


@dataclass(frozen=True)
class MeshRun:
    """What ``time_mesh`` measured.

    ``mesh_s`` / ``serial_s``: seconds of the 2-D step (the slowest rank) and of one process's
    step on the whole batch, one per round, measured in alternation; ``rank_flops_per_s`` and
    ``rank_copy_Bps``: a rank's fp32 matmul rate and copy bandwidth while every rank is busy
    (median over ranks), ``solo_*`` the same on rank 0 alone; ``alpha_s``, ``bandwidth_Bps``:
    the ring fit of the tensor-parallel groups' all-reduces (``allreduce_rows``: bytes,
    median seconds); ``comms``: one rank's collectives in one 2-D step, kind -> [count,
    bytes]; ``flops_per_rank``: matmul FLOPs of one rank in one 2-D step, ``serial_flops`` of
    the one-process step (``FlopCounterMode``).
    """

    dp: int
    tp: int
    mesh_s: tuple[float, ...]
    serial_s: tuple[float, ...]
    rank_flops_per_s: float
    rank_copy_Bps: float
    solo_flops_per_s: float
    solo_copy_Bps: float
    alpha_s: float
    bandwidth_Bps: float
    allreduce_rows: tuple[tuple[float, float], ...]
    comms: dict[str, list[int]] = field(default_factory=dict)
    flops_per_rank: int = 0
    serial_flops: int = 0

    @property
    def timings(self) -> dict[str, Timing]:
        """The two steps' rounds as ``Timing``s, for ``labsim.lab.timing.compare``."""
        return {self.mesh_name: Timing(self.mesh_s), "1 process": Timing(self.serial_s)}

    @property
    def mesh_name(self) -> str:
        return f"{self.dp}x{self.tp} mesh"

    def summary(self, which: str) -> tuple[float, float, float]:
        """(median, lower quartile, upper quartile) seconds of ``"mesh"`` or ``"serial"``."""
        times = self.mesh_s if which == "mesh" else self.serial_s
        low, high = spread(times)
        return statistics.median(times), low, high


def _matmul_rate(n: int = MATMUL_N, repeat: int = 6) -> float:
    """FLOP/s of an ``n x n`` fp32 matmul, the best of ``repeat`` calls after one warm-up."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _copy_rate(nbytes: float = COPY_BYTES, repeat: int = 4) -> float:
    """Bytes/s read plus written by a copy of ``nbytes``, the best of ``repeat``."""
    src = torch.ones(int(nbytes // 4))
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _allreduce_rows(group: Any, repeat: int = 5) -> list[tuple[float, float]]:
    """(bytes, median seconds) of ``dist.all_reduce`` on ``group`` for ``ALLREDUCE_NUMELS``."""
    rows = []
    for numel in ALLREDUCE_NUMELS:
        x = torch.ones(numel)
        dist.all_reduce(x, group=group)
        samples = []
        for _ in range(repeat):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            samples.append(time.perf_counter() - t0)
        rows.append((4.0 * numel, statistics.median(samples)))
    return rows


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn()`` between two barriers of the whole world (the slowest rank's time)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def mesh_worker(rank: int, world: int, parallelize: Callable[..., Any],
                train_step: Callable[..., Any], cfg: Transformer, rows: int, dp: int, tp: int,
                rounds: int) -> dict[str, Any]:
    """One rank of ``time_mesh``: the roofs, the all-reduce fit, then the rounds (module doc)."""
    from torch.utils.flop_counter import FlopCounterMode

    from labsim.lab.comm import CommRecorder, count_by_kind
    from labsim.parallel.mesh import MeshGPT, global_batch, serial_step

    torch.manual_seed(rank)
    dist.barrier()
    rank_flops, rank_copy = _matmul_rate(), _copy_rate()  # every rank at once
    dist.barrier()
    solo = (_matmul_rate(), _copy_rate()) if rank == 0 else (0.0, 0.0)
    dist.barrier()
    groups = [dist.new_group(list(range(r * tp, (r + 1) * tp))) for r in range(dp)]
    allreduce = _allreduce_rows(groups[rank // tp]) if tp > 1 else []
    tokens, targets = global_batch(cfg, rows)
    model = MeshGPT(cfg)
    mesh = parallelize(model, dp, tp)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    serial = MeshGPT(cfg) if rank == 0 else None
    serial_opt = torch.optim.SGD(serial.parameters(), lr=LR) if serial is not None else None

    def mesh_step() -> None:
        train_step(model, mesh, opt, tokens, targets)

    def serial_once() -> None:
        if serial is not None:
            serial_step(serial, serial_opt, tokens, targets)

    mesh_step()  # warm-up: first calls build DTensor's caches and FSDP's buffers
    serial_once()
    times: dict[str, list[float]] = {"mesh": [], "serial": []}
    for r in range(rounds):
        order = (("mesh", mesh_step), ("serial", serial_once))
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            times[name].append(_timed(fn))
    with CommRecorder() as rec:
        mesh_step()
    with FlopCounterMode(display=False) as serial_flops:
        serial_once()
    comms = {k: [n, sum(op.nbytes for op in rec.comms if op.kind == k)]
             for k, n in count_by_kind(rec.comms).items()}
    return {"times": times, "rank_flops": rank_flops, "rank_copy": rank_copy, "solo": solo,
            "allreduce": allreduce, "comms": comms, "flops": rec.flops,
            "serial_flops": int(serial_flops.get_total_flops())}


def time_mesh(parallelize: Callable[..., Any], train_step: Callable[..., Any],
              cfg: Transformer, rows: int, *, dp: int = 2, tp: int = 2, rounds: int = 5,
              timeout_s: float = 300.0) -> MeshRun:
    """Time ``train_step`` on a ``MeshGPT(cfg)`` sharded by ``parallelize`` over ``dp x tp``
    gloo workers (one thread each) on a global batch of ``rows`` sequences, against one
    process's step, and measure this machine's roofs and gloo's alpha-beta (module doc)."""
    from labsim.lab.launcher import launch

    ranks = launch(mesh_worker, dp * tp,
                   args=(parallelize, train_step, cfg, rows, dp, tp, rounds),
                   timeout_s=timeout_s, progress=f"{dp}x{tp} mesh and one process").values
    rows_ar = [r for r in ranks[0]["allreduce"]]
    if tp > 1:  # both groups measured at once: the median of the ranks that led each group
        leaders = [ranks[g * tp]["allreduce"] for g in range(dp)]
        rows_ar = [(leaders[0][i][0], statistics.median(lead[i][1] for lead in leaders))
                   for i in range(len(leaders[0]))]
    alpha, bandwidth = fit_alpha_beta(rows_ar, tp) if rows_ar else (0.0, float("inf"))
    copy_Bps = statistics.median(r["rank_copy"] for r in ranks)
    # bytes through loopback move no faster than a memory copy: the bound when none was seen
    bandwidth = min(bandwidth, copy_Bps)
    return MeshRun(dp, tp, tuple(ranks[0]["times"]["mesh"]), tuple(ranks[0]["times"]["serial"]),
                   statistics.median(r["rank_flops"] for r in ranks),
                   copy_Bps, ranks[0]["solo"][0],
                   ranks[0]["solo"][1], alpha, bandwidth, tuple(rows_ar), ranks[0]["comms"],
                   int(ranks[0]["flops"]), int(ranks[0]["serial_flops"]))


# -- labsim's prediction for the same steps --------------------------------------------------


def this_machine(run: MeshRun) -> tuple[Cluster, Cluster]:
    """(the ``dp * tp`` ranks as a labsim cluster, one process as a one-GPU cluster) from what
    ``time_mesh`` measured: each "GPU" has the matmul rate and copy bandwidth a rank measured
    (beside the others, or alone), the link between ranks gloo's fitted alpha and bandwidth."""
    def device(name: str, flops: float, copy_Bps: float) -> GPU:
        return GPU(name, {"fp32": flops, "tf32": flops}, 16e9, copy_Bps,
                   f"measured here: {MATMUL_N}x{MATMUL_N} fp32 matmul, "
                   f"{COPY_BYTES / 1e6:.0f} MB copy, one thread")

    gloo = Link("gloo on this machine", run.bandwidth_Bps, run.alpha_s,
                f"fitted to all-reduces of {len(run.allreduce_rows)} sizes on {run.tp} ranks",
                kind="pcie")
    ranks = Cluster(device("a rank beside the others", run.rank_flops_per_s, run.rank_copy_Bps),
                    1, run.dp * run.tp, gloo, gloo, 1, name="this machine, one rank per process")
    alone = Cluster(device("one process alone", run.solo_flops_per_s, run.solo_copy_Bps), 1, 1,
                    gloo, gloo, 1, name="this machine, one process")
    return ranks, alone


def mesh_plan(rows: int, dp: int, tp: int) -> Plan:
    """The plan ``time_mesh`` runs: FSDP (ZeRO-3) over dp, tensor parallel over tp, fp32, plain
    SGD, PyTorch's fused attention, the generic (PyTorch) software profile."""
    return Plan(dp=dp, tp=tp, micro_batch=rows // dp, global_batch=rows,
                zero_stage=3 if dp > 1 else 0, precision="fp32", optimizer="sgd",
                attention="flash", software="generic")


@dataclass(frozen=True)
class MeshPrediction:
    """labsim's answer for the 2-D step (``mesh``) and the one-process step (``serial``)."""

    mesh: StepResult
    serial: StepResult


def predict(cfg: Transformer, rows: int, run: MeshRun) -> MeshPrediction:
    """``simulate_step`` for the measured 2-D step and the one-process step on this machine."""
    ranks, alone = this_machine(run)
    return MeshPrediction(simulate_step(cfg, ranks, mesh_plan(rows, run.dp, run.tp)),
                          simulate_step(cfg, alone, mesh_plan(rows, 1, 1)))


def alpha_beta_comm_s(run: MeshRun) -> float:
    """A floor on one rank's communication per 2-D step from what it issued (``run.comms``)
    and gloo's fitted alpha and bandwidth, the textbook ring of lab 07 (S: the whole tensor's
    bytes): an all-reduce over ``p`` ranks ``2 (p - 1) alpha + 2 (p - 1) / p S / B``, an
    all-gather or reduce-scatter ``(p - 1) alpha + (p - 1) / p S / B``; all-reduces run in the
    "tp" groups, gathers and reduce-scatters in the "dp" groups."""
    total = 0.0
    for kind, (count, nbytes) in run.comms.items():
        p = run.tp if kind == "all_reduce" else run.dp
        if p < 2 or kind not in ("all_reduce", "all_gather", "reduce_scatter"):
            continue
        passes = 2 if kind == "all_reduce" else 1
        total += passes * ((p - 1) * count * run.alpha_s
                           + (p - 1) / p * nbytes / run.bandwidth_Bps)
    return total


def gemm_fractions(cfg: Transformer, rows: int, dp: int, tp: int, gpu: GPU
                   ) -> tuple[float, float]:
    """(smallest, largest) fraction of ``gpu``'s fp32 peak at which labsim prices the GEMMs of
    one rank's layer (``labsim.compute``: the size-dependent GEMM efficiency of the chip's
    constants times the generic software profile's sustained fraction)."""
    from labsim.compute import efficiency
    from labsim.software import profile

    eff, sustained = efficiency(gpu), profile("generic").sustained_for(gpu)
    fractions = [eff.gemm(g.flops) * sustained for g in cfg.layer_gemms(rows // dp, tp)]
    return min(fractions), max(fractions)


def explain(cfg: Transformer, rows: int, run: MeshRun, pred: MeshPrediction
            ) -> list[dict[str, Any]]:
    """One row per step (the 2-D mesh, one process): the measured median and quartiles;
    labsim's prediction, its error, its compute and exposed communication and the fractions of
    the measured matmul rate it prices the GEMMs at; two floors from this machine's own
    figures (the matmul FLOPs at the measured rate; for the 2-D step, the collectives it issued
    at gloo's alpha-beta) and what is left of the measured step above them (``rest_s``)."""
    ranks, alone = this_machine(run)
    out = []
    for which, result, flops, rate, cluster, dp, tp in (
            ("mesh", pred.mesh, run.flops_per_rank, run.rank_flops_per_s, ranks, run.dp,
             run.tp),
            ("serial", pred.serial, run.serial_flops, run.solo_flops_per_s, alone, 1, 1)):
        med, low, high = run.summary(which)
        floor = flops / rate
        comm = alpha_beta_comm_s(run) if which == "mesh" else 0.0
        breakdown = dict(result.breakdown)
        low_f, high_f = gemm_fractions(cfg, rows, dp, tp, cluster.gpu)
        out.append({"step": run.mesh_name if which == "mesh" else "1 process",
                    "measured_s": med, "low_s": low, "high_s": high,
                    "labsim_s": result.step_time_s, "error": result.step_time_s / med - 1,
                    "labsim_compute_s": sum(v for k, v in breakdown.items() if k != "comm"),
                    "labsim_comm_s": breakdown.get("comm", 0.0),
                    "gemm_fractions": (low_f, high_f),
                    "matmul_floor_s": floor, "alpha_beta_comm_s": comm,
                    "rest_s": max(0.0, med - floor - comm),
                    "rest_share": max(0.0, med - floor - comm) / med})
    return out
