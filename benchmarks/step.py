"""How long ``simulate_step`` takes to simulate one training step.

    python benchmarks/step.py [--repeat N]

Prints the two goal cases (GPT-3 175B on 1536 A100, TP8 PP12 DP16, micro-batch 1, batch 1536:
<= 0.5 s; 1T on 3072 A100, TP8 PP64, batch 3072: <= 2 s), then the simulation time against the
pipeline size (pp x micro-batches) and against dp.  One data-parallel replica is simulated, so
the cost grows with pp x m (x v) and not with dp.  Wall and CPU seconds are the best of
``--repeat`` runs (the CPU figure is what a busy shared machine does not inflate); the trace is
built lazily and is not part of the figure.
"""

from __future__ import annotations

import argparse
import time

import labsim
from labsim.plan import Plan
from labsim.sim.step import simulate_step


def timed(model: labsim.Transformer, cluster: labsim.Cluster, plan: Plan,
          repeat: int) -> tuple[float, float, object]:
    best_wall = best_cpu = float("inf")
    result = None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        result = simulate_step(model, cluster, plan)
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    print("Goal cases")
    print(f"{'case':<36} {'ops':>7} {'wall s':>7} {'cpu s':>7} {'goal s':>6} {'step s':>8}")
    gpt3 = labsim.Transformer.preset("gpt3-175b")
    one_t = labsim.Transformer.preset("megatron-1t")
    goals = [
        ("GPT-3 175B, 1536 GPUs, TP8 PP12 DP16", gpt3, 1536,
         Plan(dp=16, tp=8, pp=12, micro_batch=1, global_batch=1536, recompute="full"), 0.5),
        ("1T, 3072 GPUs, TP8 PP64 DP6", one_t, 3072,
         Plan(dp=6, tp=8, pp=64, micro_batch=1, global_batch=3072, recompute="full"), 2.0),
    ]
    for name, model, gpus, plan, goal in goals:
        wall, cpu, r = timed(model, labsim.dgx_a100(gpus // 8), plan, args.repeat)
        ops = 2 * plan.pp * plan.microbatches * plan.virtual_stages
        print(f"{name:<36} {ops:>7} {wall:>7.3f} {cpu:>7.3f} {goal:>6} {r.step_time_s:>8.2f}")

    print("\nSimulation time vs pipeline size (1T model, TP8, DP1, 1F1B)")
    print(f"{'pp':>4} {'m':>6} {'pp x m':>7} {'wall s':>7} {'cpu s':>7} {'us/op':>6}")
    for pp in (4, 16, 64):
        for m in (16, 128, 512):
            plan = Plan(dp=1, tp=8, pp=pp, global_batch=m)
            wall, cpu, _ = timed(one_t, labsim.dgx_a100(pp), plan, args.repeat)
            print(f"{pp:>4} {m:>6} {pp * m:>7} {wall:>7.3f} {cpu:>7.3f} "
                  f"{cpu / (2 * pp * m) * 1e6:>6.1f}")

    print("\nSimulation time vs dp (GPT-3 175B, TP8 PP12, 96 micro-batches per replica)")
    print(f"{'dp':>5} {'GPUs':>6} {'wall s':>7} {'cpu s':>7} {'step s':>8}")
    for dp in (1, 4, 16, 64, 256):
        plan = Plan(dp=dp, tp=8, pp=12, micro_batch=1, global_batch=96 * dp)
        wall, cpu, r = timed(gpt3, labsim.dgx_a100(dp * 12), plan, args.repeat)
        print(f"{dp:>5} {dp * 96:>6} {wall:>7.3f} {cpu:>7.3f} {r.step_time_s:>8.2f}")


if __name__ == "__main__":
    main()
