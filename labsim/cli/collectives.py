"""Simulate one collective on a cluster and print its time, algbw and busbw.

Example: labsim collective allreduce 1GiB --cluster dgx-h100 --nodes 4 --algorithm ring
--trace out.json  (the trace opens in Perfetto: https://ui.perfetto.dev).
"""

from __future__ import annotations

import argparse

from labsim.cluster import PRESETS, cluster
from labsim.collectives import collective_time_on
from labsim.collectives.schedule import ALGORITHMS
from labsim.sim.collectives import DETAILS, simulate_collective
from labsim.units import fmt_bandwidth, fmt_bytes, fmt_time, parse_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("op", help=f"one of: {', '.join(ALGORITHMS)}")
    parser.add_argument("size", help="message size (nccl-tests convention), e.g. 1GiB, 25MB")
    parser.add_argument("--cluster", default="dgx-h100", help=f"preset: {', '.join(PRESETS)}")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="use only ranks 0..GPUS-1 (default: every GPU)")
    parser.add_argument("--algorithm", default="ring",
                        help="ring, tree, recursive_doubling, rabenseifner, hierarchical, ...")
    parser.add_argument("--line-rate", action="store_true",
                        help="links at line rate instead of NCCL-achieved bandwidth")
    parser.add_argument("--detail", default="auto", choices=DETAILS, help="trace detail")
    parser.add_argument("--trace", default=None, help="write a Chrome-trace JSON here")


def run(args: argparse.Namespace) -> int:
    if args.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
    if args.gpus is not None and args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    c = cluster(args.cluster, args.nodes)
    nbytes = parse_bytes(args.size)
    achieved = not args.line_rate
    r = simulate_collective(args.op, nbytes, c, args.algorithm, args.gpus,
                            achieved=achieved, detail=args.detail)
    closed = collective_time_on(c, args.op, nbytes, args.gpus, args.algorithm,
                                achieved=achieved)
    print(f"{r.op} ({r.algorithm}) of {fmt_bytes(r.nbytes)} on {r.n} GPUs of {c.name}")
    print(f"  time        {fmt_time(r.time_s)}   (closed form {fmt_time(closed)})")
    print(f"  algbw       {fmt_bandwidth(r.algbw_Bps)}")
    print(f"  busbw       {fmt_bandwidth(r.busbw_Bps)}")
    print(f"  bandwidth   {'line rate' if args.line_rate else 'NCCL-achieved'}; "
          f"{r.steps} steps, {r.transfers} transfers")
    if args.trace:
        r.trace.to_chrome(args.trace)
        print(f"  trace       {args.trace} ({len(r.trace)} spans, detail {r.trace.detail})")
    return 0
