"""Tensor-parallel studies over ``simulate_step``, and collective matmul as a simpy process.

* ``layer_times``: one transformer layer on one GPU of a ``tp``-way group, compute and
  blocking TP communication, forward and backward, from the costs a simulated step runs on
  (a one-layer copy of the model with a tiny vocabulary, so nothing else is in the step).
* ``tp_cluster``: ``tp`` GPUs of a cluster's kind in one node (NVLink), one per node (every
  ring hop crosses InfiniBand), or whole nodes (NVLink inside, InfiniBand between).
* ``tp_scaling``: at a fixed model and micro-batch, the per-layer time at each TP degree,
  its speed-up over one GPU and the efficiency speed-up / t (GEMMs shrink, communication
  does not).
* ``sp_activation_rows``: activation bytes per GPU with and without sequence parallelism
  (``labsim.activation_memory``, Korthikanti et al. 2022, Table 2).
* ``overlap_times``: a layer's blocking (Megatron-LM 2021) time against collective matmul,
  each all-gather / reduce-scatter of sequence parallelism cut into ring steps hidden under
  the GEMM it feeds (``labsim.tensor_parallel.collective_matmul_s``).
* ``simulate_collective_matmul``: the simulated face of that closed form, two streams.
* ``layout_rows``: whole training steps for a list of (tp, pp, dp) layouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import simpy

from labsim.cluster import Cluster
from labsim.compute import OVERLAP_SLOWDOWN
from labsim.memory import activation_memory
from labsim.plan import Plan
from labsim.sim.step import simulate_step
from labsim.step import step_costs
from labsim.tensor_parallel import collective_matmul_s, layer_gemm_flops
from labsim.trace import Span, Trace
from labsim.workload import Transformer

__all__ = ["CollectiveMatmulRun", "LayerTimes", "LayoutRow", "layer_times", "layout_rows",
           "overlap_times", "simulate_collective_matmul", "sp_activation_rows", "tp_cluster",
           "tp_scaling"]


@dataclass(frozen=True)
class LayerTimes:
    """One layer and one micro-batch on one GPU of a ``tp``-way group: compute and blocking
    TP communication seconds, forward and backward; ``where`` names the links."""

    tp: int
    where: str
    compute_fwd_s: float
    compute_bwd_s: float
    comm_fwd_s: float
    comm_bwd_s: float

    @property
    def compute_s(self) -> float:
        return self.compute_fwd_s + self.compute_bwd_s

    @property
    def comm_s(self) -> float:
        return self.comm_fwd_s + self.comm_bwd_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def comm_fraction(self) -> float:
        """Share of the layer's time spent in (blocking) TP communication."""
        return self.comm_s / self.total_s


def tp_cluster(base: Cluster, tp: int, across_nodes: bool = False) -> Cluster:
    """``tp`` GPUs of ``base``'s kind: in one node on its NVLink (``tp`` up to a node's GPUs),
    in whole nodes of ``base`` (larger ``tp``), or with ``across_nodes`` one GPU per node, so
    that every ring hop crosses the network (one NIC each)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    if across_nodes:
        return Cluster(base.gpu, tp, 1, base.intra_node, base.inter_node, 1,
                       name=f"{tp} x {base.gpu.name}, one per node ({base.inter_node.name})")
    per = base.gpus_per_node
    if tp <= per:
        if per % tp:
            raise ValueError(f"tp={tp} does not divide a node's {per} GPUs")
        nics = max(1, base.nics_per_node * tp // per)
        return Cluster(base.gpu, 1, tp, base.intra_node, base.inter_node, nics,
                       name=f"{tp} x {base.gpu.name} in one node ({base.intra_node.name})")
    if tp % per:
        raise ValueError(f"tp={tp} is not a whole number of {per}-GPU nodes")
    return dataclasses.replace(base, nodes=tp // per,
                               name=f"{tp // per} nodes of {per} x {base.gpu.name}")


def layer_times(model: Transformer, cluster: Cluster, *, micro_batch: int = 1,
                sequence_parallel: bool = False, precision: str = "bf16",
                attention: str = "flash", where: str = "") -> LayerTimes:
    """One layer of ``model`` on every GPU of ``cluster`` as one TP group (tp = its GPUs),
    priced as ``simulate_step`` prices it (``labsim.step.step_costs`` of a one-layer copy of
    the model with a tiny vocabulary): the layer's forward and backward compute (the output
    layer's share removed), and its blocking TP collectives -- each at its time alone under
    the NCCL model (``labsim.collectives``), times the collectives a pass issues (2 forward,
    2 backward; reduce-scatter + all-gather with sequence parallelism).

    The simulator runs an op's TP collectives as one flow after its compute, inside the op's
    span, so a trace does not show them apart; the costs it runs from do."""
    tp = cluster.world_size
    one = dataclasses.replace(model, layers=1, vocab=8 * tp, name=f"{model.name} layer")
    plan = Plan(tp=tp, micro_batch=micro_batch, sequence_parallel=sequence_parallel,
                precision=precision, attention=attention)
    (chunk,) = step_costs(one, cluster, plan).chunks
    alone_s = chunk.tp.alone_s if chunk.tp is not None and chunk.tp.pipes else 0.0
    return LayerTimes(tp, where or cluster.name, chunk.t_fwd - chunk.head_fwd,
                      chunk.t_rec + chunk.t_bwd - chunk.head_bwd, alone_s * chunk.tp_fwd,
                      alone_s * chunk.tp_bwd)


def tp_scaling(model: Transformer, base: Cluster, degrees: Iterable[int], *,
               micro_batch: int = 1, across_nodes: bool = False,
               **kwargs: object) -> list[dict[str, float]]:
    """At a fixed model and micro-batch: per-layer seconds, speed-up over one GPU and
    efficiency (speed-up / tp) at each TP degree, on ``tp_cluster(base, tp, across_nodes)``."""
    one = layer_times(model, tp_cluster(base, 1), micro_batch=micro_batch, **kwargs).total_s
    rows = []
    for tp in degrees:
        lt = layer_times(model, tp_cluster(base, tp, across_nodes), micro_batch=micro_batch,
                         **kwargs)
        rows.append({"tp": tp, "layer_s": lt.total_s, "comm_fraction": lt.comm_fraction,
                     "speedup": one / lt.total_s, "efficiency": one / lt.total_s / tp})
    return rows


def sp_activation_rows(model: Transformer, degrees: Iterable[int], *,
                       micro_batch: int = 1) -> list[dict[str, float]]:
    """Activation bytes per GPU for all layers of ``model`` (pp = 1, one micro-batch in
    flight, 16-bit) at each TP degree: plain TP, with sequence parallelism, with sequence
    parallelism and selective recomputation, and with full recomputation."""
    rows = []
    for tp in degrees:
        def mem(sp: bool, recompute: str, t: int = tp) -> float:
            return activation_memory(model, micro_batch=micro_batch, tp=t,
                                     sequence_parallel=sp and t > 1, recompute=recompute)
        rows.append({"tp": tp, "tp_only": mem(False, "none"),
                     "sequence_parallel": mem(True, "none"),
                     "sp_selective": mem(True, "selective"), "full_recompute": mem(False, "full")})
    return rows


@dataclass(frozen=True)
class OverlapTimes:
    """One layer (forward + backward) with sequence parallelism on one GPU: blocking
    collectives after their GEMMs (``blocking_s``), or cut into ring steps under them
    (``overlapped_s``); ``compute_s`` alone is the floor."""

    tp: int
    where: str
    compute_s: float
    comm_s: float
    blocking_s: float
    overlapped_s: float


def overlap_times(model: Transformer, cluster: Cluster, *, micro_batch: int = 1,
                  where: str = "", **kwargs: object) -> OverlapTimes:
    """Blocking against collective matmul for one layer of ``model`` on ``cluster``.

    The layer's simulated compute is shared among its parts by their FLOPs
    (``layer_gemm_flops``: QKV, attention core, output projection, MLP up and down; memory-bound
    kernels are spread in proportion); each of the four sequence-parallel collectives (an
    all-gather before QKV and before the MLP, a reduce-scatter after the output projection and
    after the MLP) overlaps its GEMM forward, and backward its data-gradient GEMM and the
    weight-gradient GEMM beside it (twice the forward GEMM).  A shard's GEMM under a ring step
    runs 18.9 % slower (``OVERLAP_SLOWDOWN``, Lee et al. 2025, as the step model charges data
    parallelism's overlap); the less efficient smaller GEMMs are not charged, so
    ``overlapped_s`` is a lower bound on the overlapped layer's time."""
    lt = layer_times(model, cluster, micro_batch=micro_batch, sequence_parallel=True,
                     where=where, **kwargs)
    tp = lt.tp
    flops = layer_gemm_flops(micro_batch, model.seq_len, model.hidden, model.ffn_hidden)
    total = sum(flops.values())
    pairs = [flops[k] / total for k in ("qkv", "out", "up", "down")]
    core = flops["core"] / total
    c_f, c_b = lt.comm_fwd_s / 4, lt.comm_bwd_s / 4  # one collective of the four
    slow = OVERLAP_SLOWDOWN  # compute beside communication, charged as the step model does
    fwd = core * lt.compute_fwd_s + sum(
        collective_matmul_s(share * lt.compute_fwd_s, c_f, tp, slow) for share in pairs)
    bwd = core * lt.compute_bwd_s + sum(
        collective_matmul_s(share * lt.compute_bwd_s, c_b, tp, slow) for share in pairs)
    return OverlapTimes(tp, lt.where, lt.compute_s, lt.comm_s, lt.total_s, fwd + bwd)


@dataclass(frozen=True)
class CollectiveMatmulRun:
    """A simulated collective matmul: its seconds and a two-stream trace of rank 0."""

    time_s: float
    spans: list[Span] = field(repr=False, compare=False)

    @property
    def trace(self) -> Trace:
        return Trace(self.spans, rank_label="rank")


def simulate_collective_matmul(gemm_s: float, comm_s: float, tp: int) -> CollectiveMatmulRun:
    """An all-gather + GEMM cut into ``tp`` shards on one rank of a ring: the local shard's
    GEMM starts at once; ring step ``k`` delivers shard ``k`` after ``comm_s / (tp - 1)``
    (a rank forwards a shard as soon as it has it, so the steps follow each other on the
    link); the GEMM of shard ``k`` starts when it has arrived and the previous GEMM is done.
    The simulated face of ``collective_matmul_s``."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    env = simpy.Environment()
    spans: list[Span] = []
    arrived = [env.event() for _ in range(tp)]
    arrived[0].succeed()
    g = gemm_s / tp

    def link():  # noqa: ANN202 - a simpy process
        for k in range(1, tp):
            start = env.now
            yield env.timeout(comm_s / (tp - 1))
            spans.append(Span(0, "comm", "comm", start, env.now, f"ring step {k}"))
            arrived[k].succeed()

    def gemms():  # noqa: ANN202 - a simpy process
        for k in range(tp):
            yield arrived[k]
            start = env.now
            yield env.timeout(g)
            spans.append(Span(0, "compute", "compute", start, env.now, f"GEMM shard {k}"))

    env.process(link())
    done = env.process(gemms())
    env.run(done)
    return CollectiveMatmulRun(env.now, spans)


@dataclass(frozen=True)
class LayoutRow:
    """One simulated training step of a (tp, pp, dp) layout: step seconds, FLOP/s per GPU
    counting recomputation (as Narayanan et al. 2021 Eq. 3 does) and without it (MFU basis),
    the pipeline bubble, memory per GPU of the first stage, and whether it fits."""

    tp: int
    pp: int
    dp: int
    virtual_stages: int
    step_s: float
    hw_flops_per_gpu: float
    model_flops_per_gpu: float
    bubble: float
    memory_bytes: float
    fits: bool


def layout_rows(model: Transformer, cluster: Cluster, layouts: Sequence[tuple[int, ...]],
                global_batch: int, *, micro_batch: int = 1,
                **plan_fields: object) -> list[LayoutRow]:
    """``simulate_step`` for each ``(tp, pp, dp)`` or ``(tp, pp, dp, v)`` layout (v > 1:
    the interleaved schedule) of ``model`` on ``cluster``; other ``Plan`` fields as given."""
    rows = []
    for layout in layouts:
        tp, pp, dp, v = (*layout, 1)[:4]
        fields = dict(plan_fields)
        if v > 1:
            fields.update(schedule="interleaved", virtual_stages=v)
        plan = Plan(dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, global_batch=global_batch,
                    **fields)
        r = simulate_step(model, cluster, plan)
        peak = cluster.gpu.peak(plan.numerics.peak_dtype(cluster.gpu))
        rows.append(LayoutRow(tp, pp, dp, v, r.step_time_s, r.hfu * peak,
                              r.model_flops_per_gpu_s, r.bubble_fraction,
                              r.peak_memory_bytes, r.fits))
    return rows
