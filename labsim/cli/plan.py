"""Rank the parallel plans of a training run from a TOML or JSON config.

    labsim plan configs/plan-llama2-70b.toml [--csv OUT] [--top 10] [--workers N]

The config has these tables::

    [model]    preset = "llama2-70b"            (or any Transformer fields, as for simulate)
    [cluster]  preset = "dgx-h100", nodes = 8   (as for simulate)
    [search]   global_batch = 1024              (sequences per step; required)
               micro_batches = [1, 2, 4]        (optional: any argument of candidate_plans:
               zero_stages, recompute, sequence_parallel, tp_comm_overlap, max_virtual_stages,
               tp_max, precision, software, fp8 = ["off", "delayed"], expert_parallel =
               [1, 8] (a mixture-of-experts model's ep degrees; default: every one that
               divides its experts and dp), context_parallel = [1, 2, 4] and cp_comm =
               ["p2p", "all_gather"] (default: cp tried from 8k-token sequences, ring
               attention); and confirm = 5, how many to simulate)
    [budget]   tokens = 2e12                    (optional: the run's token budget, and
               usd_per_gpu_hour = 4.9 or price = "aws-p5-capacity-block", usd_per_kwh,
               pue, power_W)

Prints the top plans as a table (the best ``confirm`` simulated, the rest estimated) and
writes the whole ranking as CSV (default ``<config name>-plans.csv`` here).  With a
``[budget]`` each plan also gets the run's days, GPU-hours, energy and dollars at its MFU.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
from pathlib import Path

from labsim.cli._guard import guarded, output_path, write_atomic
from labsim.cli.step import build, load_config
from labsim.cost import PRICES, run_cost
from labsim.sim.plan import PlanSearch, RankedPlan, plan_search
from labsim.units import fmt_bytes, fmt_time

SEARCH_KEYS = {"global_batch", "micro_batches", "zero_stages", "recompute",
               "sequence_parallel", "tp_comm_overlap", "max_virtual_stages", "tp_max",
               "precision", "software", "confirm", "fp8", "expert_parallel",
               "context_parallel", "cp_comm"}
LISTS = {"micro_batches", "zero_stages", "recompute", "sequence_parallel", "tp_comm_overlap",
         "fp8", "expert_parallel", "context_parallel", "cp_comm"}
BUDGET_KEYS = {"tokens", "usd_per_gpu_hour", "price", "usd_per_kwh", "pue", "power_W"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML (.toml) or JSON (.json): model, cluster, search, "
                                       "[budget]")
    parser.add_argument("--csv", metavar="OUT", help="where to write the full ranking "
                                                     "(default: <config name>-plans.csv)")
    parser.add_argument("--top", type=int, default=10, help="plans to print (default 10)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes to estimate with (default: all cores)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _search(table: dict) -> tuple[int, dict]:
    unknown = set(table) - SEARCH_KEYS
    if unknown:
        raise ValueError(f"[search] has unknown keys {sorted(unknown)}; allowed: "
                         f"{sorted(SEARCH_KEYS)}")
    if "global_batch" not in table:
        raise ValueError("[search] needs global_batch = <sequences per step>, e.g. 1024")
    space = {k: v for k, v in table.items() if k != "global_batch"}
    for key in LISTS & set(space):
        if not isinstance(space[key], list) or not space[key]:
            raise ValueError(f"[search] {key} = {space[key]!r}: must be a non-empty list, "
                             f"e.g. {key} = [{'1, 2' if key == 'micro_batches' else '...'}]")
        space[key] = tuple(space[key])
    if "fp8" in space:  # TOML has no null: "off" is 16-bit GEMMs
        space["fp8"] = tuple(None if r == "off" else r for r in space["fp8"])
    return table["global_batch"], space


def _budget(table: dict | None) -> dict | None:
    if table is None:
        return None
    unknown = set(table) - BUDGET_KEYS
    if unknown:
        raise ValueError(f"[budget] has unknown keys {sorted(unknown)}; allowed: "
                         f"{sorted(BUDGET_KEYS)}")
    if "tokens" not in table:
        raise ValueError("[budget] needs tokens = <tokens to train on>, e.g. 2e12")
    out = dict(table)
    if "price" in out:
        if "usd_per_gpu_hour" in out:
            raise ValueError("[budget] give price or usd_per_gpu_hour, not both")
        name = out.pop("price")
        if name not in PRICES:
            raise ValueError(f"[budget] price = {name!r}: choose one of {sorted(PRICES)} or "
                             "give usd_per_gpu_hour")
        out["usd_per_gpu_hour"] = PRICES[name]
    for key, value in out.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"[budget] {key} = {value}: must be a finite number")
    return out


def _costs(model: object, cluster: object, budget: dict | None, ranked: RankedPlan) -> dict:
    if budget is None:
        return {}
    b = dict(budget)
    tokens = b.pop("tokens")
    c = run_cost(model, tokens, cluster, cluster.world_size,  # type: ignore[attr-defined]
                 ranked.mfu, dtype=ranked.plan.numerics.compute, **b)
    return {"days": c.days, "gpu_hours": c.gpu_hours, "energy_kWh": c.energy_kWh,
            "usd": c.dollars}


def table(result: PlanSearch, top: int, costs: list[dict]) -> str:
    """The top plans as aligned text."""
    head = (f"{'#':>3} {'dp x tp x pp':<13} {'mb':>3} {'ZeRO':>4} {'recompute':<9} {'SP':<3} "
            f"{'TPov':<4} {'step':>9} {'MFU':>6} {'memory/GPU':>10}  how")
    if costs and costs[0]:
        head += f" {'days':>8} {'GPU-hours':>11} {'MWh':>8} {'dollars':>13}"
    lines = [head]
    for i, r in enumerate(result.ranked[:top]):
        p = r.plan
        mem = fmt_bytes(r.result.peak_memory_bytes) if r.result.memory is not None else "-"
        line = (f"{i + 1:>3} {r.layout:<13} {p.micro_batch:>3} {p.zero_stage:>4} "
                f"{p.recompute:<9} {'yes' if p.sequence_parallel else 'no':<3} "
                f"{'yes' if p.tp_comm_overlap else 'no':<4} {fmt_time(r.step_time_s):>9} "
                f"{r.mfu:>6.1%} {mem:>10}  {'sim' if r.simulated else 'est'}")
        if costs and costs[i]:
            c = costs[i]
            usd = "-" if c["usd"] is None else f"${c['usd']:,.0f}"
            line += (f" {c['days']:>8.3g} {c['gpu_hours']:>11,.0f} "
                     f"{c['energy_kWh'] / 1e3:>8,.1f} {usd:>13}")
        lines.append(line)
    return "\n".join(lines)


def to_csv(rows: list[dict]) -> str:
    """The ranking as CSV text (one row per plan, rank first)."""
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=["rank", *rows[0]])
        writer.writeheader()
        for i, row in enumerate(rows):
            writer.writerow({"rank": i + 1, **row})
    return buf.getvalue()


@guarded("plan")
def run(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise ValueError(f"--top {args.top}: must be >= 1")
    csv_path = output_path(args.csv or f"{Path(args.config).stem}-plans.csv")
    config = load_config(args.config, tables=("model", "cluster", "search"),
                         optional=("budget",))
    model, cluster, _ = build({"model": config["model"], "cluster": config["cluster"],
                               "plan": {}})
    global_batch, space = _search(config["search"])
    budget = _budget(config.get("budget"))
    if budget is not None:  # fail on a bad budget before searching
        run_cost(model, budget["tokens"], cluster, cluster.world_size, 0.5,
                 **{k: v for k, v in budget.items() if k != "tokens"})
    try:
        result = plan_search(model, cluster, global_batch, workers=args.workers,
                             progress=False if args.quiet else "plans", **space)
    except TypeError as exc:  # a wrongly typed [search] value
        raise ValueError(f"[search] {exc}") from None
    print(f"model    {model!r}")
    print(f"cluster  {cluster!r}")
    print(f"plans    {result.considered:,} considered, {len(result.ranked):,} fit; dropped: "
          + (", ".join(f"{k} {v:,}" for k, v in sorted(result.dropped.items())) or "none"))
    if not result.ranked:
        raise ValueError("no plan fits: use more GPUs, recompute = [\"full\"], ZeRO stages or "
                         "a smaller micro-batch")
    costs = [_costs(model, cluster, budget, r) for r in result.ranked]
    print(table(result, args.top, costs))
    print(f"trust    step times {result.ranked[0].result.band.describe()}")
    rows = [row | cost for row, cost in zip(result.rows(), costs)]
    write_atomic(csv_path, to_csv(rows))
    print(f"ranking  {len(rows):,} plans written to {csv_path}")
    return 0
