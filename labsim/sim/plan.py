"""Search the plans of a training run: every layout that is valid and fits, ranked by speed.

``plan_search(model, cluster, global_batch)`` enumerates data x tensor x pipeline parallel
degrees (dp tp pp = the cluster's GPUs), interleaving (virtual stages), micro-batch sizes,
ZeRO stages, recomputation, sequence parallelism and the pipeline schedule; drops each plan that
is invalid (``Plan`` / ``Plan.validate_for`` refuse it) or does not fit the GPU's memory,
counting the reasons; estimates the rest with a fast step model (``estimator``, the closed-form
``labsim.estimate_step`` where it exists, else ``simulate_step`` without a trace) and confirms
the best ``confirm`` of them with ``simulate_step``.

Estimating is embarrassingly parallel: plans are cut into chunks and evaluated on an executor —
by default the standard library's process pool over the local cores; any
``concurrent.futures.Executor`` works unchanged, including a distributed engine's (Dask's
``Client.get_executor()``, Ray's ``ray.util.multiprocessing``-backed executors).

The search space follows what Megatron-LM and its successors expose (Narayanan et al. 2021,
section 3: tp inside a node, pp across nodes, dp over the rest; Korthikanti et al. 2022:
selective recompute and sequence parallelism); ZeRO-2/3 only with pp = 1 (``Plan`` refuses
the rest, as DeepSpeed's pipeline engine does).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from labsim.cluster import Cluster
from labsim.plan import Plan
from labsim.sim.step import StepResult, simulate_step
from labsim.workload import Transformer

Estimator = Callable[[Transformer, Cluster, Plan], StepResult]


@dataclass(frozen=True)
class RankedPlan:
    """One plan that fits, with its estimated (and, for the best, simulated) step."""

    plan: Plan
    estimate: StepResult
    simulated: StepResult | None = None

    @property
    def step_time_s(self) -> float:
        """The simulated step time where the plan was confirmed, else the estimate's."""
        return (self.simulated or self.estimate).step_time_s

    @property
    def mfu(self) -> float:
        return (self.simulated or self.estimate).mfu

    def row(self) -> dict[str, Any]:
        """The plan's fields and its figures, flat (one CSV row)."""
        p, r = self.plan, self.simulated or self.estimate
        return {**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)},
                "step_time_s": r.step_time_s, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu,
                "memory_bytes": r.peak_memory_bytes if r.memory is not None else None,
                "bubble_fraction": r.bubble_fraction,
                "simulated": self.simulated is not None}


@dataclass(frozen=True)
class PlanSearch:
    """The outcome of ``plan_search``: the plans that fit, fastest first; how many plans were
    looked at; and why the others were dropped (reason -> count)."""

    ranked: tuple[RankedPlan, ...]
    considered: int
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def best(self) -> RankedPlan:
        if not self.ranked:
            raise ValueError("no plan fits: see .dropped for why each was refused")
        return self.ranked[0]

    def rows(self) -> list[dict[str, Any]]:
        return [r.row() for r in self.ranked]

    def __repr__(self) -> str:
        best = (f"best {self.best.plan.dp}x{self.best.plan.tp}x{self.best.plan.pp} "
                f"{self.best.step_time_s:.4g} s, MFU {self.best.mfu:.1%}"
                if self.ranked else "no plan fits")
        return (f"PlanSearch({self.considered} plans, {len(self.ranked)} fit; {best}; dropped "
                + ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items())) + ")")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_plans(model: Transformer, cluster: Cluster, global_batch: int, *,
                    micro_batches: Sequence[int] = (1, 2, 4, 8),
                    max_virtual_stages: int = 4,
                    zero_stages: Sequence[int] = (0, 1, 2, 3),
                    recompute: Sequence[str] = ("none", "selective", "full"),
                    precision: str = "bf16", **fixed: Any) -> Iterator[dict[str, Any]]:
    """Every combination of plan fields the search looks at (as ``Plan`` keyword arguments;
    ``fixed`` fields are passed to every plan unchanged)."""
    gpus = cluster.world_size
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            virtual = [1] + [v for v in range(2, max_virtual_stages + 1) if pp > 1]
            for v in virtual:
                schedules = ["interleaved"] if v > 1 else (["1f1b"] if pp > 1 else ["1f1b"])
                for mb in micro_batches:
                    for zero in zero_stages:
                        for rc in recompute:
                            for sp in ([False, True] if tp > 1 else [False]):
                                for schedule in schedules:
                                    yield dict(dp=dp, tp=tp, pp=pp, virtual_stages=v,
                                               schedule=schedule, micro_batch=mb,
                                               global_batch=global_batch, zero_stage=zero,
                                               recompute=rc, sequence_parallel=sp,
                                               precision=precision, **fixed)


def _reason(exc: ValueError) -> str:
    text = str(exc)
    for key in ("divisible", "divide", "heads", "layers", "interleaved", "zero_stage",
                "sequence_parallel", "global_batch"):
        if key in text:
            return f"invalid: {key}"
    return "invalid: other"


def _evaluate(model: Transformer, cluster: Cluster, specs: Sequence[dict[str, Any]],
              estimator: Estimator) -> tuple[list[tuple[Plan, StepResult]], Counter]:
    """Estimate a chunk of plans; runs in a worker process (everything here pickles)."""
    fits: list[tuple[Plan, StepResult]] = []
    dropped: Counter = Counter()
    gpu_bytes = cluster.gpu.memory_bytes
    for spec in specs:
        try:
            plan = Plan(**spec)
            plan.validate_for(model, cluster.world_size)
        except ValueError as exc:
            dropped[_reason(exc)] += 1
            continue
        result = estimator(model, cluster, plan)
        if result.memory is not None and result.memory.total > gpu_bytes:
            dropped["does not fit in memory"] += 1
            continue
        fits.append((plan, result))
    return fits, dropped


def _default_estimator() -> Estimator:
    import labsim

    return getattr(labsim, "estimate_step", _simulate_fast)


def _simulate_fast(model: Transformer, cluster: Cluster, plan: Plan) -> StepResult:
    return simulate_step(model, cluster, plan)


def _chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def plan_search(model: Transformer, cluster: Cluster, global_batch: int, *,
                confirm: int = 5, estimator: Estimator | None = None,
                executor: cf.Executor | None = None, workers: int | None = None,
                chunk: int = 256, progress: bool = False,
                **space: Any) -> PlanSearch:
    """Rank every valid plan of ``model`` on ``cluster`` for ``global_batch`` sequences that
    fits in memory, by estimated step time; confirm the best ``confirm`` with
    ``simulate_step``.  ``space`` narrows or fixes the search (``candidate_plans``'
    arguments: ``micro_batches=(1, 2)``, ``zero_stages=(0,)``, ``attention="standard"``...).

    ``executor``: where chunks of ``chunk`` plans are estimated (default: a process pool of
    ``workers`` processes, all local cores; ``workers=1`` estimates in this process).
    ``progress`` shows a bar of chunks done.
    """
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r}: must be a positive whole number of "
                         f"sequences")
    if not isinstance(confirm, int) or confirm < 0:
        raise ValueError(f"confirm={confirm!r}: must be a whole number >= 0")
    estimator = estimator or _default_estimator()
    specs = list(candidate_plans(model, cluster, global_batch, **space))
    parts = list(_chunks(specs, max(1, chunk)))
    fits: list[tuple[Plan, StepResult]] = []
    dropped: Counter = Counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(specs), desc="plans", unit="plan")
    own_pool = executor is None and (workers or os.cpu_count() or 1) > 1
    pool = cf.ProcessPoolExecutor(workers or os.cpu_count()) if own_pool else executor
    try:
        if pool is None:
            outcomes: Iterable[tuple[list, Counter]] = (
                _evaluate(model, cluster, p, estimator) for p in parts)
        else:
            futures = [pool.submit(_evaluate, model, cluster, p, estimator) for p in parts]
            outcomes = (f.result() for f in cf.as_completed(futures))
        for good, bad in outcomes:
            fits += good
            dropped += bad
            if bar is not None:
                bar.update(len(good) + sum(bad.values()))
    finally:
        if own_pool:
            pool.shutdown()
        if bar is not None:
            bar.close()
    fits.sort(key=lambda pr: (pr[1].step_time_s, pr[0].gpus))
    ranked = [RankedPlan(p, r) for p, r in fits]
    for i in range(min(confirm, len(ranked))):
        p = ranked[i].plan
        ranked[i] = dataclasses.replace(ranked[i], simulated=simulate_step(model, cluster, p))
    ranked[:confirm] = sorted(ranked[:confirm], key=lambda r: r.step_time_s)
    return PlanSearch(tuple(ranked), len(specs), dict(dropped))
