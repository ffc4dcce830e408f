"""List the hardware catalog: GPUs (dense peaks, memory, bandwidth) and links."""

from __future__ import annotations

import argparse

from labsim.cli._guard import guarded
from labsim.hardware import GPUS, LINKS
from labsim.units import fmt_bandwidth, fmt_bytes, fmt_flops


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sources", action="store_true", help="print each entry's source")


@guarded("hardware")
def run(args: argparse.Namespace) -> int:
    print(f"{'GPU':<11} {'bf16/fp16 dense':>16} {'fp32':>15} {'memory':>8} {'bandwidth':>11}")
    for g in GPUS.values():
        half = g.peak_flops.get("bf16", g.peak_flops.get("fp16", 0.0))
        print(
            f"{g.name:<11} {fmt_flops(half):>16} {fmt_flops(g.peak_flops['fp32']):>15} "
            f"{fmt_bytes(g.memory_bytes):>8} {fmt_bandwidth(g.memory_bandwidth_Bps):>11}"
        )
        if args.sources:
            print(f"    source: {g.source}")
            if g.tdp_W is not None:
                print(f"    power: {g.tdp_W:g} W; source: {g.tdp_source}")
    print()
    print(f"{'link':<10} {'kind':<7} {'per direction':>14} {'NCCL achieves':>14} "
          f"{'NCCL topology':>14} {'latency':>9} {'per NCCL channel':>17}")
    for lk in LINKS.values():
        channel = "-" if lk.nccl_channel_Bps is None else fmt_bandwidth(lk.nccl_channel_Bps)
        print(
            f"{lk.name:<10} {lk.kind:<7} {fmt_bandwidth(lk.bandwidth_Bps):>14} "
            f"{fmt_bandwidth(lk.achieved_Bps):>14} {fmt_bandwidth(lk.nccl_Bps):>14} "
            f"{lk.latency_s * 1e6:>6.1f} µs {channel:>17}"
        )
        if args.sources:
            print(f"    source: {lk.source}; NCCL: {lk.efficiency_source}")
    return 0
