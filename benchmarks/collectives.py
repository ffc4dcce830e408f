"""Simulation speed of collectives against the number of GPUs (DGX H100 nodes of 8).

Prints, for a 1 GiB all-reduce, the wall time of ``simulate_collective``, the simpy events
the network scheduled, events per second, and the simulated busbw; run it alone on an idle
machine for stable figures:  python benchmarks/collectives.py [--algorithm ring]
"""

from __future__ import annotations

import argparse
import time

from labsim import dgx_h100, simulate_collective


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--algorithm", default="ring")
    parser.add_argument("--size", type=float, default=2**30)
    parser.add_argument("--max-gpus", type=int, default=4096)
    args = parser.parse_args()
    print(f"{'GPUs':>6} {'steps':>6} {'transfers':>10} {'events':>7} {'wall s':>8} "
          f"{'events/s':>9} {'transfers/s':>12} {'busbw GB/s':>10}")
    n = 8
    while n <= args.max_gpus:
        cluster = dgx_h100(n // 8)
        t0 = time.perf_counter()
        r = simulate_collective("allreduce", args.size, cluster, args.algorithm)
        wall = time.perf_counter() - t0
        print(f"{n:>6} {r.steps:>6} {r.transfers:>10} {r.events:>7} {wall:>8.3f} "
              f"{r.events / wall:>9.0f} {r.transfers / wall:>12.0f} {r.busbw_Bps / 1e9:>10.1f}")
        n *= 2


if __name__ == "__main__":
    main()
