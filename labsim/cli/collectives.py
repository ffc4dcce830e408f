"""Simulate one collective on a cluster and print its time, algbw, busbw and NCCL's choice.

Example: labsim collective allreduce 1GiB --cluster dgx-h100 --nodes 4 --trace out.json
(the trace opens in Perfetto: https://ui.perfetto.dev).  --algorithm and --protocol restrict
NCCL's choice as NCCL_ALGO and NCCL_PROTO do ("ring", "tree", "nvls", "^tree", ...);
--protocol alpha-beta runs the textbook algorithms instead (ring, tree = binomial,
recursive_doubling, rabenseifner, hierarchical, ...).
"""

from __future__ import annotations

import argparse
import json

from labsim.cli._guard import guarded, output_path, write_atomic
from labsim.cluster import PRESETS, cluster
from labsim.collectives import estimate_collective
from labsim.collectives.schedule import ALGORITHMS
from labsim.sim.collectives import DETAILS, simulate_collective
from labsim.units import fmt_bandwidth, fmt_bytes, fmt_time, parse_bytes


def count(name: str, text: str | None) -> int | None:
    """``text`` as a whole number >= 1 (None passes), or ValueError naming the option."""
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("op", help=f"one of: {', '.join(ALGORITHMS)}")
    parser.add_argument("size", help="message size (nccl-tests convention), e.g. 1GiB, 25MB")
    parser.add_argument("--cluster", default="dgx-h100", help=f"preset: {', '.join(PRESETS)}")
    parser.add_argument("--nodes", default="1", help="number of nodes (default 1)")
    parser.add_argument("--gpus", default=None,
                        help="use only ranks 0..GPUS-1 (default: every GPU)")
    parser.add_argument("--algorithm", default="auto",
                        help="NCCL: auto, ring, tree, nvls, nvls_tree, collnet_chain, pat or an "
                        "NCCL_ALGO list; textbook: ring, tree, rabenseifner, hierarchical, ...")
    parser.add_argument("--protocol", default="auto",
                        help="auto, LL, LL128, Simple (an NCCL_PROTO list), or alpha-beta")
    parser.add_argument("--line-rate", action="store_true",
                        help="links at line rate instead of NCCL-achieved bandwidth")
    parser.add_argument("--detail", default="auto", help=f"trace detail: {', '.join(DETAILS)}")
    parser.add_argument("--trace", default=None, help="write a Chrome-trace JSON here")


@guarded("collective")
def run(args: argparse.Namespace) -> int:
    trace_path = output_path(args.trace) if args.trace else None  # fail before simulating
    c = cluster(args.cluster, count("--nodes", args.nodes))
    gpus = count("--gpus", args.gpus)
    if gpus is not None and gpus > c.world_size:
        raise ValueError(f"--gpus {gpus}: the cluster has {c.world_size} GPUs")
    nbytes = parse_bytes(args.size)
    achieved = not args.line_rate
    r = simulate_collective(args.op, nbytes, c, args.algorithm, gpus,
                            protocol=args.protocol, achieved=achieved, detail=args.detail)
    closed = estimate_collective(args.op, nbytes, c, args.algorithm, gpus,
                                 protocol=args.protocol, achieved=achieved)
    print(f"{r.op} of {fmt_bytes(r.nbytes)} on {r.n} GPUs of {c.name}")
    print(f"  choice      {r.algorithm}/{r.protocol}"
          + (f", {r.channels} channels" if r.channels else ""))
    print(f"  time        {fmt_time(r.time_s)}   (closed form {fmt_time(closed.time_s)})")
    print(f"  algbw       {fmt_bandwidth(r.algbw_Bps)}")
    print(f"  busbw       {fmt_bandwidth(r.busbw_Bps)}")
    print(f"  bandwidth   {'line rate' if args.line_rate else 'NCCL-achieved'}"
          + (f"; {r.steps} steps, {r.transfers} transfers" if r.protocol == "alpha-beta"
             else ""))
    if trace_path is not None:
        write_atomic(trace_path, json.dumps(r.trace.to_chrome()))
        print(f"  trace       {trace_path} ({len(r.trace)} spans, detail {r.trace.detail})")
    return 0
