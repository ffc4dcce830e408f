"""How fast the planner ranks plans: plans per second, one process and a local process pool.

    python benchmarks/plan.py                  # Llama-2 7B, 8 DGX H100, Megatron-Core
    python benchmarks/plan.py --workers 1 2    # the pool sizes to time
    python benchmarks/plan.py --repeat 3       # best of N
    python benchmarks/plan.py --published      # the planner against published layouts

The goal (lab 15's planner): 10,000 plans in <= 10 s on 2 cores.  "Plans" counts every
candidate looked at: those refused as invalid (cheap), those estimated and dropped for memory,
and those estimated and ranked; the printout gives each, so plans/s can be read either way.
No simulation confirms anything here (``confirm=0``): that is a fixed cost of ~``confirm``
``simulate_step`` calls (``benchmarks/step.py --speed``).
"""

from __future__ import annotations

import argparse
import os
import time

import labsim
from labsim.sim.plan import candidate_plans, plan_search

PUBLISHED = [f"narayanan2021_t1_{s}" for s in ("1.7B", "3.6B", "7.5B", "18.4B", "39.1B",
                                              "76.1B", "145.6B", "310.1B", "529.6B",
                                              "1008.0B")] + [
    "dgxc2411_nemotron4_15b_bf16_16gpu", "dgxc2411_gpt3_175b_bf16_128gpu",
    "dgxc2411_nemotron4_340b_bf16_128gpu"]


def published() -> None:
    """The planner's best layout beside each published one (docs/plan.md's table)."""
    from labsim.published import runs
    from labsim.sim.plan import check_layout

    by_id = {r.id: r for r in runs()}
    print(f"{'run':<40} {'GPUs':>5} {'published':<12} {'planner best':<12} {'rank':>4} "
          f"{'published slower by':>19} {'plans':>6} {'s':>5}")
    for run_id in PUBLISHED:
        t0 = time.perf_counter()
        c = check_layout(by_id[run_id], confirm=3)
        slow = c.slowdown()
        print(f"{run_id:<40} {by_id[run_id].gpus:>5} {c.published:<12} {c.best:<12} "
              f"{'-' if c.rank is None else c.rank + 1:>4} "
              f"{'dropped' if slow is None else f'{slow:.1%}':>19} {c.search.considered:>6} "
              f"{time.perf_counter() - t0:>5.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--published", action="store_true")
    args = ap.parse_args()
    if args.published:
        published()
        return
    model = labsim.Transformer.preset("llama2-7b")
    cluster = labsim.dgx_h100(args.nodes)
    space = dict(micro_batches=(1, 2, 4, 8), software="megatron-core-te")
    n = sum(1 for _ in candidate_plans(model, cluster, 512, **space))
    print(f"{model.params / 1e9:.2f}B parameters on {cluster.world_size} H100, global batch "
          f"512: {n} candidate plans; {os.cpu_count()} cores here")
    for workers in args.workers:
        best = float("inf")
        result = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            result = plan_search(model, cluster, 512, workers=workers, confirm=0, **space)
            best = min(best, time.perf_counter() - t0)
        assert result is not None
        estimated = len(result.ranked) + result.dropped.get("does not fit in memory", 0)
        print(f"workers={workers}: {best:.2f} s for {result.considered} plans = "
              f"{result.considered / best:,.0f} plans/s ({estimated} estimated = "
              f"{estimated / best:,.0f} estimates/s; {len(result.ranked)} fit); "
              f"10,000 plans in {10_000 / (result.considered / best):.1f} s")
    print("dropped:", dict(sorted(result.dropped.items())))
    print("best:", result.best.layout, result.best.plan, f"{result.best.step_time_s:.3f} s",
          f"MFU {result.best.mfu:.1%}")


if __name__ == "__main__":
    main()
