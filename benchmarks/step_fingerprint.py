"""Every figure a step's two faces return, printed exactly, to diff before and after a change.

    python benchmarks/step_fingerprint.py > before.txt      # on the old code
    python benchmarks/step_fingerprint.py > after.txt       # on the new code
    diff before.txt after.txt                               # empty: bit-identical

One line per (face, plan): the published runs (``labsim.published.runs()``), the cases of
``benchmarks/step.py --speed`` and ``--n`` sampled plans of each kind of
``benchmarks/step.py``'s ``sample_plans`` (DGX nodes, PCIe boxes).  ``simulate_step`` lines
carry ``repr`` of the step time, bubble, MFU, HFU, memory, the stage-0
breakdown and a SHA-256 of the set of raw spans; with ``--events`` the event simulation too.
``estimate_step`` lines the step time, bubble, MFU and memory.  Floats are printed with
``repr`` (shortest round-trip), so equal text means equal bits.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step import sample_plans, speed_cases  # noqa: E402

import labsim  # noqa: E402
from labsim.published import runs  # noqa: E402
from labsim.sim.step import simulate_step  # noqa: E402


def _sim_line(model, cluster, plan, events: bool) -> str:
    r = simulate_step(model, cluster, plan, events=events)
    # as a set: the event simulation orders spans that end at one instant by the flows'
    # object ids (labsim.sim.network), which any change to what is allocated can reorder
    spans = hashlib.sha256("\n".join(sorted(map(repr, r.spans))).encode()).hexdigest()[:16]
    breakdown = sorted(r.breakdown.items())
    mem = r.memory.total if r.memory is not None else None
    return (f"step {r.step_time_s!r} bubble {r.bubble_fraction!r} mfu {r.mfu!r} "
            f"hfu {r.hfu!r} memory {mem!r} breakdown {breakdown!r} spans {spans}")


def _est_line(model, cluster, plan) -> str:
    r = labsim.estimate_step(model, cluster, plan)
    mem = r.memory.total if r.memory is not None else None
    return (f"step {r.step_time_s!r} bubble {r.bubble_fraction!r} mfu {r.mfu!r} "
            f"memory {mem!r}")


def cases(n: int):
    """(name, model, cluster, plan) of every fingerprinted plan."""
    for run in runs():
        yield run.id, run.model, run.cluster, run.plan
    for name, model, cluster, plan in speed_cases():
        yield name, model, cluster, plan
    for pcie in (False, True):
        for k, (model, cluster, plan) in enumerate(sample_plans(n, seed=0, pcie=pcie)):
            yield f"{'pcie' if pcie else 'dgx'} sample {k}", model, cluster, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="sampled plans of each kind")
    parser.add_argument("--events", action="store_true",
                        help="also fingerprint the event simulation (slower)")
    args = parser.parse_args()
    for name, model, cluster, plan in cases(args.n):
        print(f"{name} | simulate | {_sim_line(model, cluster, plan, False)}")
        if args.events:
            print(f"{name} | events | {_sim_line(model, cluster, plan, True)}")
        print(f"{name} | estimate | {_est_line(model, cluster, plan)}")


if __name__ == "__main__":
    main()
