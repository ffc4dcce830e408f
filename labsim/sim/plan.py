"""Search the plans of a training run: every layout that is valid and fits, ranked by speed.

``plan_search(model, cluster, global_batch)`` enumerates data x tensor x pipeline parallel
degrees (dp tp pp = the cluster's GPUs), interleaving (virtual stages), micro-batch sizes,
ZeRO stages, recomputation, sequence parallelism and tensor-parallel communication overlap;
drops each plan that is invalid or does not fit the GPU's memory, counting the reasons
(``REASONS``); estimates the rest with ``labsim.estimate_step`` (the closed form) and confirms
the best ``confirm`` of them with ``simulate_step`` (the event simulation, contention
included), re-ranking those by their simulated time.

Estimating is embarrassingly parallel: plans are cut into chunks and evaluated on an executor,
by default the standard library's process pool over the local cores.  Any object with
``submit(fn, *args)`` returning a future with ``result()`` works unchanged (a
``concurrent.futures`` executor, Dask's ``Client.get_executor()``), and so does any with the
``multiprocessing.Pool`` API's ``apply_async`` (the standard library's pool, Ray's
``ray.util.multiprocessing.Pool``, which its documentation gives as a drop-in replacement);
every argument a chunk needs pickles.  The ranking does not depend on the executor or on the
order chunks finish in.

The search space follows what Megatron-LM and its successors expose (Narayanan et al. 2021,
section 3: tp inside a node, pp across nodes, dp over the rest; Korthikanti et al. 2022:
selective recompute and sequence parallelism); ZeRO-2/3 only with pp = 1 (``Plan`` refuses
the rest, as DeepSpeed's pipeline engine does).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from labsim.cluster import Cluster
from labsim.context_parallel import CP_COMM
from labsim.fp8 import check_gpu
from labsim.plan import Plan
from labsim.sim.step import simulate_step
from labsim.software import profile
from labsim.step import StepResult, estimate_step
from labsim.workload import Transformer

Estimator = Callable[[Transformer, Cluster, Plan], StepResult]
# sequences from which the search tries context parallelism: Megatron-Core's MoE README
# ("Empirically, use CP when sequence length >= 8K")
LONG_SEQUENCE = 8192

#: Why a candidate is dropped (the keys of ``PlanSearch.dropped``).
REASONS = {
    "tp does not divide heads": "each TP rank needs whole attention heads",
    "tp and kv_heads do not split evenly": "KV heads must be split or replicated evenly",
    "pp x virtual stages does not divide layers": "every model chunk needs the same layers",
    "dp x micro-batch does not divide the global batch": "whole micro-batches per replica",
    "interleaved: micro-batches not a multiple of pp": "Megatron-LM's interleaving rule",
    "ZeRO-2/3 with pipeline parallelism": "DeepSpeed's pipeline engine refuses it",
    "ZeRO-3 with mixture-of-experts layers": "labsim gathers ZeRO-3 units of dense layers only",
    "leading dense layers beyond the first chunk": "labsim prices them in the first chunk",
    "dense and MoE layers alternate across a chunk boundary":
        "with moe_every > 1 every chunk holds a multiple of it",
    "ep x etp does not divide the stage's GPUs, or ep the experts":
        "the experts' grid (etp x ep) folds into tp x cp x dp; each rank holds whole experts",
    "EP with TP but no sequence parallelism": "Megatron-Core requires it for MoE with TP",
    "2 x cp does not split the sequence": "the load-balanced causal split needs 2 cp chunks",
    "a2a: cp does not split the heads": "Ulysses splits each TP rank's heads over cp",
    "context parallelism without flash attention": "it runs in the fused attention kernel",
    "does not fit in memory": "first stage's peak above the GPU's memory",
}


def layout_name(plan: Plan) -> str:
    """``"dp x tp x pp"`` with the interleaving, context and expert parallelism and FP8,
    e.g. ``"8x8x2 v2"``, ``"16x1x4 v8 ep8"`` or ``"8x8x16 v8 cp16 all_gather"``."""
    return f"{plan.dp}x{plan.tp}x{plan.pp}" + (f" v{plan.virtual_stages}"
                                               if plan.virtual_stages > 1 else "") + (
        f" cp{plan.cp}" + ("" if plan.cp_comm == "p2p" else f" {plan.cp_comm}")
        if plan.cp > 1 else "") + (f" ep{plan.ep}" if plan.ep > 1 else "") + (
        " fp8" if plan.fp8 else "")


@dataclass(frozen=True)
class RankedPlan:
    """One plan that fits, with its estimated (and, for the best, simulated) step."""

    plan: Plan
    estimate: StepResult
    simulated: StepResult | None = None

    @property
    def result(self) -> StepResult:
        """The simulated step where the plan was confirmed, else the estimate."""
        return self.simulated or self.estimate

    @property
    def step_time_s(self) -> float:
        """The simulated step time where the plan was confirmed, else the estimate's."""
        return self.result.step_time_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation of ``result`` (no recomputation counted)."""
        return self.result.mfu

    @property
    def layout(self) -> str:
        """``"dp x tp x pp"`` with the interleaving, context and expert parallelism and FP8,
    e.g. ``"8x8x2 v2"``, ``"16x1x4 v8 ep8"`` or ``"8x8x16 v8 cp16 all_gather"``."""
        return layout_name(self.plan)

    def row(self) -> dict[str, Any]:
        """The plan's fields and its figures, flat (one CSV row)."""
        p, r = self.plan, self.result
        fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
        if not isinstance(fields["software"], str):
            fields["software"] = p.software.name  # type: ignore[union-attr]
        return {**fields, "microbatches": p.microbatches,
                "step_time_s": r.step_time_s, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu,
                "memory_bytes": r.peak_memory_bytes if r.memory is not None else None,
                "bubble_fraction": r.bubble_fraction,
                "simulated": self.simulated is not None,
                "estimated_step_time_s": self.estimate.step_time_s}


@dataclass(frozen=True)
class PlanSearch:
    """The outcome of ``plan_search``: the plans that fit, fastest first; how many plans were
    looked at; and why the others were dropped (reason of ``REASONS`` -> count)."""

    ranked: tuple[RankedPlan, ...]
    considered: int
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def best(self) -> RankedPlan:
        """The fastest plan that fits (ValueError when none does)."""
        if not self.ranked:
            raise ValueError("no plan fits: see .dropped for why each was refused; use more "
                             "GPUs, a smaller micro-batch, recompute='full' or ZeRO")
        return self.ranked[0]

    def rows(self) -> list[dict[str, Any]]:
        """Every ranked plan as one flat row (``RankedPlan.row``), fastest first."""
        return [r.row() for r in self.ranked]

    def __repr__(self) -> str:
        best = (f"best {self.best.layout} {self.best.step_time_s:.4g} s, MFU "
                f"{self.best.mfu:.1%}" if self.ranked else "no plan fits")
        return (f"PlanSearch({self.considered} plans, {len(self.ranked)} fit; {best}; dropped "
                + ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items())) + ")")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_plans(model: Transformer, cluster: Cluster, global_batch: int, *,
                    micro_batches: Sequence[int] = (1, 2, 4, 8),
                    max_virtual_stages: int = 4,
                    zero_stages: Sequence[int] = (0, 1, 2, 3),
                    recompute: Sequence[str] = ("none", "selective", "full"),
                    sequence_parallel: Sequence[bool] = (False, True),
                    tp_comm_overlap: Sequence[bool] | None = None,
                    tp_max: int | None = None,
                    precision: str = "bf16", fp8: Sequence[str | None] = (None,),
                    expert_parallel: Sequence[int] | None = None,
                    context_parallel: Sequence[int] | None = None,
                    cp_comm: Sequence[str] = ("p2p",),
                    **fixed: Any) -> Iterator[dict[str, Any]]:
    """Every combination of plan fields the search looks at (as ``Plan`` keyword arguments;
    ``fixed`` fields, e.g. ``software="megatron-lm-2021"``, go to every plan unchanged).
    Sequence parallelism and TP overlap are varied only where tp > 1; TP overlap by default
    only where the software profile can hide TP communication (``tp_overlap_hidden`` > 0:
    Megatron-Core with Transformer Engine) and the TP group stays inside a node (beyond, the
    overlap hides nothing: ``StepCosts.tp_hidden``); ``tp_max`` caps tp (e.g. at a node's
    GPUs); ``fp8``: the FP8 recipes to try (``labsim.fp8``; None: 16-bit GEMMs), e.g.
    ``(None, "delayed")`` on an H100; ``expert_parallel``: the ep degrees to try for a
    mixture-of-experts model (default: every one that divides both its experts and dp;
    ``labsim.expert_parallel``), 1 for a dense one; ``context_parallel``: the cp degrees to try
    (default: for sequences of 8k tokens or more, Megatron-Core's threshold for context
    parallelism, every one whose 2 x cp chunks split the sequence; 1 below) and ``cp_comm``
    how (``labsim.context_parallel.CP_COMM``)."""
    if fixed.get("microbatch_group") is not None:
        raise ValueError(
            "microbatch_group cannot be fixed for a search: it must lie between each "
            "candidate's pp and micro-batch count, which the search varies (its interleaved "
            "candidates run Megatron-LM's order); give it to one chosen Plan and compare with "
            "labsim.estimate_step or simulate_step")
    # the widest TP group whose overlap the search varies (asked for explicitly: every one)
    overlap_tp_max = cluster.gpus_per_node if tp_comm_overlap is None else cluster.world_size
    if tp_comm_overlap is None:
        hides = profile(fixed.get("software", "generic")).tp_overlap_hidden > 0
        tp_comm_overlap = (False, True) if hides else (False,)
    fp8 = tuple(fp8)
    if not fp8:
        raise ValueError("fp8=(): give at least one choice, None for 16-bit GEMMs")
    check_gpu(fp8, cluster.gpu)
    if expert_parallel is not None:
        expert_parallel = tuple(expert_parallel)
        if not expert_parallel or any(isinstance(e, bool) or not isinstance(e, int) or e < 1
                                      or (model.experts or 1) % e for e in expert_parallel):
            raise ValueError(f"expert_parallel={expert_parallel!r}: give ep degrees that "
                             f"divide {model.name}'s {model.experts or 1} experts, e.g. (1,)")
    cp_comm = tuple(cp_comm)
    if not cp_comm or any(c not in CP_COMM for c in cp_comm):
        raise ValueError(f"cp_comm={cp_comm!r}: give a non-empty choice of {CP_COMM}")
    if context_parallel is not None:
        context_parallel = tuple(context_parallel)
        if not context_parallel or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                                       for c in context_parallel):
            raise ValueError(f"context_parallel={context_parallel!r}: give cp degrees >= 1, "
                             "e.g. (1, 2, 4)")
    no_ep_overlap = {k: v for k, v in fixed.items()  # for ep = 1
                     if k not in ("ep_overlap", "ep_node_limit")}
    gpus = cluster.world_size
    for tp in _divisors(gpus):
        if tp_max is not None and tp > tp_max:
            continue
        for pp in _divisors(gpus // tp):
            rest = gpus // (tp * pp)
            cps = context_parallel or [c for c in _divisors(rest) if c == 1 or (
                model.seq_len >= LONG_SEQUENCE and model.seq_len % (2 * c) == 0)]
            virtual = [1] + [v for v in range(2, max_virtual_stages + 1) if pp > 1]
            sps = sequence_parallel if tp > 1 else (False,)
            overlaps = tp_comm_overlap if 1 < tp <= overlap_tp_max else (False,)
            for cp, v, mb, zero, rc in itertools.product(
                    [c for c in cps if rest % c == 0], virtual, micro_batches, zero_stages,
                    recompute):
                dp = rest // cp
                eps = ([e for e in _divisors(dp) if model.experts % e == 0] if model.experts
                       else [1]) if expert_parallel is None else expert_parallel
                comms = cp_comm if cp > 1 else ("p2p",)
                for sp, ov, f8, ep, cc in itertools.product(sps, overlaps, fp8, eps, comms):
                    yield dict(dp=dp, tp=tp, pp=pp, cp=cp, cp_comm=cc, ep=ep, virtual_stages=v,
                               schedule="interleaved" if v > 1 else "1f1b",
                               micro_batch=mb, global_batch=global_batch, zero_stage=zero,
                               recompute=rc, sequence_parallel=sp, tp_comm_overlap=ov,
                               precision=precision, fp8=f8,
                               **(fixed if ep > 1 else no_ep_overlap))


def refusal(spec: dict[str, Any], model: Transformer) -> str | None:
    """Why the plan ``spec`` (``Plan`` keyword arguments) is invalid for ``model`` (a key of
    ``REASONS``), or None: the structural rules ``Plan`` and ``Plan.validate_for`` enforce,
    tested before building the plan so that each refusal is counted under its own reason."""
    tp, pp = spec.get("tp", 1), spec.get("pp", 1)
    v, dp, mb = spec.get("virtual_stages", 1), spec.get("dp", 1), spec.get("micro_batch", 1)
    heads = model.heads
    kv = model.kv_heads or heads
    if heads % tp:
        return "tp does not divide heads"
    if kv % tp and tp % kv:
        return "tp and kv_heads do not split evenly"
    counted = (model.layers + bool(spec.get("account_for_embedding_in_pipeline_split"))
               + bool(spec.get("account_for_loss_in_pipeline_split")))
    if counted % (pp * v) or counted < pp * v:
        return "pp x virtual stages does not divide layers"
    gb = spec.get("global_batch") or dp * mb
    if gb % (dp * mb):
        return "dp x micro-batch does not divide the global batch"
    if v > 1 and (gb // (dp * mb)) % pp:
        return "interleaved: micro-batches not a multiple of pp"
    if spec.get("zero_stage", 0) >= 2 and pp > 1:
        return "ZeRO-2/3 with pipeline parallelism"
    cp = spec.get("cp", 1)
    if cp > 1:
        if model.seq_len % (2 * cp):
            return "2 x cp does not split the sequence"
        if spec.get("cp_comm", "p2p") == "a2a" and ((heads // tp) % cp or max(1, kv // tp) % cp):
            return "a2a: cp does not split the heads"
        attention = spec.get("attention") or profile(spec.get("software", "generic")).attention
        if attention != "flash":
            return "context parallelism without flash attention"
    ep = spec.get("ep", 1)
    if model.experts:
        if spec.get("zero_stage", 0) == 3:
            return "ZeRO-3 with mixture-of-experts layers"
        if (counted // (pp * v)) % model.moe_every or counted > model.layers and (
                model.moe_every > 1):  # an end chunk a layer short
            return "dense and MoE layers alternate across a chunk boundary"
        if model.dense_layers > counted // (pp * v) - bool(
                spec.get("account_for_embedding_in_pipeline_split")):
            return "leading dense layers beyond the first chunk"
    if (tp * cp * dp) % (ep * (spec.get("etp") or tp)) or (model.experts or 1) % ep:
        return "ep x etp does not divide the stage's GPUs, or ep the experts"
    if (ep > 1 or (spec.get("etp") or tp) != tp) and tp > 1 and not spec.get(
            "sequence_parallel"):  # the experts' grid takes each rank's s / tp tokens
        return "EP with TP but no sequence parallelism"
    return None


def _evaluate(model: Transformer, cluster: Cluster, specs: Sequence[dict[str, Any]],
              estimator: Estimator) -> tuple[list[tuple[Plan, StepResult]], Counter]:
    """Estimate a chunk of plans; runs in a worker process (everything here pickles)."""
    fits: list[tuple[Plan, StepResult]] = []
    dropped: Counter = Counter()
    gpu_bytes = cluster.gpu.memory_bytes
    for spec in specs:
        why = refusal(spec, model)
        if why is not None:
            dropped[why] += 1
            continue
        plan = Plan(**spec)  # anything else wrong is the caller's fixed fields: let it raise
        plan.validate_for(model, cluster.world_size)
        result = estimator(model, cluster, plan)
        if result.memory is not None and result.memory.total > gpu_bytes:
            dropped["does not fit in memory"] += 1
            continue
        # only the figures travel back: the costs and span source are large to pickle
        fits.append((plan, dataclasses.replace(result, costs=None, span_source=None)))
    return fits, dropped


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _run_chunks(parts: list, work: Callable, executor: Any, workers: int | None,
                bar: Any) -> list[tuple[list, Counter]]:
    """Each part's outcome, in the parts' order, on ``executor`` (or a local process pool)."""
    n = workers or os.cpu_count() or 1
    if executor is None and n == 1:
        out = []
        for p in parts:
            out.append(work(p))
            _tick(bar, out[-1])
        return out
    if executor is not None and not callable(getattr(executor, "submit", None)):
        # the multiprocessing.Pool API: Ray's ray.util.multiprocessing.Pool is a drop-in one
        pending = [executor.apply_async(work, (p,)) for p in parts]
        out = []
        for r in pending:
            out.append(r.get())
            _tick(bar, out[-1])
        return out
    pool = cf.ProcessPoolExecutor(n) if executor is None else executor
    try:
        futures = [pool.submit(work, p) for p in parts]
        index = {id(f): i for i, f in enumerate(futures)}
        outcomes: list = [None] * len(futures)
        done = (cf.as_completed(futures) if all(isinstance(f, cf.Future) for f in futures)
                else futures)
        for f in done:
            outcomes[index[id(f)]] = f.result()
            _tick(bar, outcomes[index[id(f)]])
        return outcomes
    finally:
        if executor is None:
            pool.shutdown()


def _tick(bar: Any, outcome: tuple[list, Counter]) -> None:
    if bar is not None:
        bar.update(len(outcome[0]) + sum(outcome[1].values()))


class _Work:
    """A picklable ``part -> _evaluate(model, cluster, part, estimator)``."""

    def __init__(self, model: Transformer, cluster: Cluster, estimator: Estimator) -> None:
        self.model, self.cluster, self.estimator = model, cluster, estimator

    def __call__(self, part: Sequence[dict[str, Any]]) -> tuple[list, Counter]:
        return _evaluate(self.model, self.cluster, part, self.estimator)


def plan_search(model: Transformer, cluster: Cluster, global_batch: int, *,
                confirm: int = 5, estimator: Estimator | None = None,
                executor: Any = None, workers: int | None = None,
                chunk: int = 500, progress: bool | str = False,
                **space: Any) -> PlanSearch:
    """Rank every valid plan of ``model`` on ``cluster`` for ``global_batch`` sequences that
    fits in memory, by estimated step time (``labsim.estimate_step``); confirm the best
    ``confirm`` with ``simulate_step`` and re-rank those by the simulated time.  ``space``
    narrows or fixes the search (``candidate_plans``' arguments: ``micro_batches=(1, 2)``,
    ``zero_stages=(0,)``, ``software="megatron-lm-2021"``...).

    ``executor``: where chunks of ``chunk`` plans are estimated (default: a process pool of
    ``workers`` processes, all local cores; ``workers=1`` estimates in this process; or any
    object whose ``submit(fn, arg)`` returns a future with ``result()``, e.g. Dask's
    ``Client.get_executor()``, or with ``apply_async``, e.g. Ray's multiprocessing pool).
    ``progress`` shows a bar of plans done (a string labels it).
    """
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r}: must be a positive whole number of "
                         f"sequences")
    if isinstance(confirm, bool) or not isinstance(confirm, int) or confirm < 0:
        raise ValueError(f"confirm={confirm!r}: must be a whole number >= 0")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r}: must be a whole number of plans >= 1")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or workers < 1):
        raise ValueError(f"workers={workers!r}: must be a whole number >= 1 (or None: all "
                         "cores)")
    if executor is not None and not (callable(getattr(executor, "submit", None)) or
                                     callable(getattr(executor, "apply_async", None))):
        raise ValueError("executor must have submit(fn, *args) returning a future (a "
                         "concurrent.futures executor, Dask's Client.get_executor()) or "
                         "apply_async (a multiprocessing.Pool, Ray's "
                         "ray.util.multiprocessing.Pool)")
    specs = list(candidate_plans(model, cluster, global_batch, **space))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(specs), unit="plan",
                   desc=progress if isinstance(progress, str) else "plans")
    try:
        work = _Work(model, cluster, estimator or estimate_step)
        outcomes = _run_chunks(_chunks(specs, chunk), work, executor, workers, bar)
    finally:
        if bar is not None:
            bar.close()
    fits: list[tuple[Plan, StepResult]] = []
    dropped: Counter = Counter()
    for good, bad in outcomes:
        fits += good
        dropped += bad
    order = sorted(range(len(fits)), key=lambda i: (fits[i][1].step_time_s, i))
    ranked = [RankedPlan(*fits[i]) for i in order]
    for i in range(min(confirm, len(ranked))):
        plan = ranked[i].plan
        ranked[i] = dataclasses.replace(ranked[i],
                                        simulated=simulate_step(model, cluster, plan))
    ranked[:confirm] = sorted(ranked[:confirm], key=lambda r: r.step_time_s)
    return PlanSearch(tuple(ranked), len(specs), dict(dropped))


#: The fields of a published run's plan the search varies; the rest stay as published.
LAYOUT_FIELDS = ("dp", "tp", "pp", "virtual_stages", "schedule", "ep", "cp", "cp_comm")


@dataclass(frozen=True)
class LayoutCheck:
    """A published run's layout beside the planner's choice on the same model, GPUs, batch
    and settings: ``rank`` is the published layout's place in the planner's ranking (0 =
    the planner's best; None: the planner drops it, e.g. as not fitting)."""

    run_id: str
    published: str
    search: PlanSearch
    rank: int | None

    @property
    def best(self) -> str:
        return self.search.best.layout

    @property
    def agrees(self) -> bool:
        return self.rank == 0

    def slowdown(self) -> float | None:
        """The published layout's step time over the planner's best, minus 1."""
        if self.rank is None:
            return None
        return self.search.ranked[self.rank].step_time_s / self.search.best.step_time_s - 1


def _published_axes(spec: dict[str, Any]) -> dict[str, Any]:
    """The published run's CP communication and FP8 recipe as the search's only choices
    (the degrees of cp and ep are searched around them)."""
    out: dict[str, Any] = {"cp_comm": (spec.get("cp_comm", "p2p"),)}
    if "fp8" in spec:
        out["fp8"] = (spec["fp8"],)
    return out


def check_layout(run: Any, *, max_virtual_stages: int | None = None, confirm: int = 3,
                 workers: int | None = None, **space: Any) -> LayoutCheck:
    """Search the layouts (``LAYOUT_FIELDS``) of a published run (``labsim.published.Run``)
    with every other setting as published (micro-batch, ZeRO stage, recompute, sequence
    parallelism, precision, software), and place the published layout in the ranking."""
    spec = dict(run.plan_spec)
    fixed = {k: v for k, v in spec.items() if k not in LAYOUT_FIELDS + (
        "micro_batch", "global_batch", "zero_stage", "recompute", "sequence_parallel",
        "tp_comm_overlap")}
    v = spec.get("virtual_stages", 1)
    search = plan_search(
        run.model, run.cluster, spec["global_batch"], confirm=confirm, workers=workers,
        micro_batches=(spec.get("micro_batch", 1),), zero_stages=(spec.get("zero_stage", 0),),
        recompute=(spec.get("recompute", "none"),),
        sequence_parallel=(spec.get("sequence_parallel", False),),
        max_virtual_stages=max_virtual_stages or max(4, v),
        **{**fixed, **_published_axes(spec), **space})
    rank = next((i for i, r in enumerate(search.ranked)
                 if layout_name(r.plan) == layout_name(run.plan)), None)
    return LayoutCheck(run.id, layout_name(run.plan), search, rank)
