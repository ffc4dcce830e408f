"""Real DataLoader against simulate_dataloader on this machine; prints a table.

    PYTHONPATH=. python benchmarks/dataloader.py [--steps 40] [--repeat 1]

For each setting: the steady-state busy fraction of the training step measured on a real
``DataLoader`` (decoding synthetic JPEGs, an MLP step on one thread), the trace-driven
simulation of that run (its own per-batch times), the simulation from its mean load and step
times, and -- for every worker count -- the prediction from an isolated calibration with the
cores shared (``cores=os.cpu_count()``, ``step_uses_cpu=True``), with steps per second.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from labsim.experiments.loading import HEADER, calibrate, compare, measure_loader
from labsim.lab.datasets import SyntheticImages
from labsim.lab.models import TrainStep
from labsim.sim.loading import simulate_dataloader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    slow = SyntheticImages(n_items=4096, side_px=256, timed=True)
    fast = SyntheticImages(n_items=4096, side_px=64, timed=True)
    step = TrainStep(width=1024)
    cores = os.cpu_count() or 1
    settings = [(0, 2, slow, "main process, slow decode"),
                (1, 2, slow, "1 worker, slow decode"),
                (1, 2, fast, "1 worker, fast decode"),
                (1, 1, slow, "1 worker, prefetch 1"),
                (2, 2, slow, "2 workers, slow decode"),
                (3, 2, slow, "3 workers, slow decode")]
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {cores} cores, torch {torch.__version__}, "
          f"batch {args.batch}, {args.steps} steps, load average {os.getloadavg()[0]:.1f}")
    for _ in range(args.repeat):
        cal = {id(d): calibrate(d, step, args.batch) for d in (slow, fast)}
        print(HEADER + "   calib-sim  real/s  sim/s")
        for n, pf, data, label in settings:
            times = measure_loader(data, step, batch_size=args.batch, num_workers=n,
                                   prefetch_factor=pf, steps=args.steps, label=label)
            c = compare(times, n, pf)
            k = cal[id(data)]
            pred = simulate_dataloader(n, pf, k.load_time_s, k.step_time_s, args.steps,
                                       cores=cores, step_uses_cpu=True)
            skip = min(args.steps // 2, n * pf + 2)
            print(f"{c.row()}   {pred.steady_busy_fraction(skip):9.1%} "
                  f"{times.steps_per_s:7.1f} {pred.steps_per_s:6.1f}")


if __name__ == "__main__":
    main()
