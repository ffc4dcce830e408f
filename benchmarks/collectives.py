"""The NCCL model against published nccl-tests curves, and the speed of simulating collectives.

    python benchmarks/collectives.py            # calibration and validation tables
    python benchmarks/collectives.py --curves   # every point of every curve
    python benchmarks/collectives.py --fit      # refit the physical constants (calibration)
    python benchmarks/collectives.py --speed    # simulate_collective wall time vs GPUs

Error = measured / predicted - 1 in time, which equals predicted / measured - 1 in busbw.
The ``--fit`` search is deterministic (fixed seed): it minimises the mean squared log error
over the calibration curves only, and prints constants to paste into
``labsim.collectives.nccl.NcclPhysics`` and ``labsim.published``.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace

import numpy as np

from labsim import dgx_h100, simulate_collective
from labsim.collectives.nccl import PHYSICS, NcclPhysics, _frozen
from labsim.published import SINGLE_PROCESS_OVERHEAD_S, nccl_tests, predict_curve
from labsim.units import fmt_bytes


def errors(curve, physics=PHYSICS, single=SINGLE_PROCESS_OVERHEAD_S) -> np.ndarray:
    return np.array([m / p - 1 for _, m, p, _ in predict_curve(curve, physics, single)])


def table(physics=PHYSICS, single=SINGLE_PROCESS_OVERHEAD_S) -> None:
    print(f"{'role':<12} {'curve':<36} {'system':<16} {'launch':<15} {'n':>3} "
          f"{'median':>7} {'max':>7} {'<=15 %':>7}")
    for role in ("calibration", "validation"):
        for c in nccl_tests():
            if c.role != role:
                continue
            e = np.abs(errors(c, physics, single))
            print(f"{role:<12} {c.id:<36} {c.system + ' x' + str(c.nodes):<16} "
                  f"{c.launch:<15} {len(e):>3} {np.median(e):>7.1%} {e.max():>7.1%} "
                  f"{np.mean(e <= 0.15):>7.0%}")


def curves() -> None:
    for c in nccl_tests():
        print(f"\n{c.id} ({c.role}; {c.op} on {c.system} x{c.nodes}, {c.launch}; NCCL "
              f"{c.nccl})\n  source: {c.url or c.source}")
        print(f"  {'size':>10} {'measured':>11} {'predicted':>11} {'busbw meas':>10} "
              f"{'pred':>7} {'error':>7}  NCCL choice")
        from labsim.collectives.cost import busbw
        for size, m, p, choice in predict_curve(c):
            print(f"  {fmt_bytes(size, binary=True):>10} {m * 1e6:>9.1f}us {p * 1e6:>9.1f}us "
                  f"{busbw(c.op, size, c.gpus, m) / 1e9:>10.2f} "
                  f"{busbw(c.op, size, c.gpus, p) / 1e9:>7.2f} {m / p - 1:>+7.1%}  {choice}")


KEYS = ("ampere", "hopper", "LL", "LL128", "Simple", "ring_fill", "tree_fill", "nvls_fill",
        "single_us")


def _physics(x: np.ndarray) -> tuple[NcclPhysics, float]:
    d = dict(zip(KEYS, x))
    scale = dict(PHYSICS.latency_scale, ampere=d["ampere"], hopper=d["hopper"],
                 blackwell=d["hopper"])
    p = replace(PHYSICS, latency_scale=_frozen(scale),
                saturation=_frozen({k: d[k] for k in ("LL", "LL128", "Simple")}),
                ring_fill=d["ring_fill"], tree_fill=d["tree_fill"], nvls_fill=d["nvls_fill"])
    return p, d["single_us"] * 1e-6


def fit(iterations: int) -> None:
    calibration = [c for c in nccl_tests() if c.role == "calibration"]

    def loss(x: np.ndarray) -> float:
        p, single = _physics(x)
        return float(np.mean(np.concatenate(
            [np.log1p(errors(c, p, single)) ** 2 for c in calibration])))

    lo = np.array([0.3, 0.3, 0.05, 0.05, 0.05, 0, 0, 0, 0.0])
    hi = np.array([3.0, 3.0, 1.0, 1.0, 1.0, 10, 3, 20, 40.0])
    x = np.array([1.5, 1.2, 0.6, 0.6, 0.8, 0.5, 0.25, 0.5, 14.0])
    best = loss(x)
    rng = np.random.default_rng(0)
    for i in range(iterations):
        step = (0.3 if i < iterations // 3 else 0.05) * (hi - lo)
        y = np.clip(x + rng.normal(0, 0.05, len(x)) * step, lo, hi)
        value = loss(y)
        if value < best:
            best, x = value, y
    print(f"mean squared log error on the calibration curves: {best:.4f} "
          f"(rms {math.sqrt(best):.1%})")
    for k, v in zip(KEYS, x):
        print(f"  {k:<10} {v:.3g}")
    p, single = _physics(x)
    table(p, single)


def speed(max_gpus: int) -> None:
    print(f"{'GPUs':>6} {'wall s (NCCL model)':>20} {'wall s (alpha-beta ring)':>25}")
    n = 8
    while n <= max_gpus:
        cluster = dgx_h100(n // 8)
        t0 = time.perf_counter()
        simulate_collective("allreduce", 2**30, cluster)
        t1 = time.perf_counter()
        if n <= 1024:
            simulate_collective("allreduce", 2**30, cluster, "ring", protocol="alpha-beta")
        t2 = time.perf_counter()
        print(f"{n:>6} {t1 - t0:>20.4f} {t2 - t1 if n <= 1024 else float('nan'):>25.4f}")
        n *= 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curves", action="store_true", help="print every point")
    parser.add_argument("--fit", action="store_true", help="refit the physical constants")
    parser.add_argument("--iterations", type=int, default=1500)
    parser.add_argument("--speed", action="store_true", help="simulation speed vs GPUs")
    parser.add_argument("--max-gpus", type=int, default=4096)
    args = parser.parse_args()
    if args.fit:
        fit(args.iterations)
    elif args.curves:
        curves()
    elif args.speed:
        speed(args.max_gpus)
    else:
        table()


if __name__ == "__main__":
    main()
