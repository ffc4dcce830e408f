"""Host seconds per rank of a DeepSpeed 0.3.x ZeRO-3 gather that a CPU can time.

    python benchmarks/zero3_gather_host.py [--ranks 1536]

DeepSpeed 0.3.16 ``partition_parameters.py`` ``_allgather_param`` builds the all-gather's
output as a Python list of one ``narrow`` view per rank; PyTorch 1.8's
``ProcessGroupNCCL::allgather`` then runs one ``copy_`` per list element.  This times both
loops on CPU tensors: the narrow loop as DeepSpeed runs it, and the dispatch of ``copy_``
without its CUDA launch -- a lower bound on ``SoftwareProfile.zero3_host_s_per_rank``
(the profile's value is fitted on published runs, ``docs/step.md``).  Prints microseconds per
rank, best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import time

import torch


def narrow_loop_s(flat: torch.Tensor, ranks: int, size: int) -> float:
    t0 = time.perf_counter()
    parts = []
    for i in range(ranks):
        parts.append(flat.narrow(0, size * i, size))
    return (time.perf_counter() - t0) / ranks


def copy_loop_s(parts: list[torch.Tensor], src: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for part in parts:
        part.copy_(src, non_blocking=True)
    return (time.perf_counter() - t0) / len(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1536)
    parser.add_argument("--elements", type=int, default=1000, help="per rank")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    n, k = args.ranks, args.elements
    flat = torch.empty(n * k, dtype=torch.float16)
    src = torch.empty(k, dtype=torch.float16)
    parts = [flat.narrow(0, k * i, k) for i in range(n)]
    narrow = min(narrow_loop_s(flat, n, k) for _ in range(args.repeat))
    copy = min(copy_loop_s(parts, src) for _ in range(args.repeat))
    print(f"torch {torch.__version__}, {n} ranks: narrow {narrow * 1e6:.2f} us + copy_ "
          f"dispatch {copy * 1e6:.2f} us = {(narrow + copy) * 1e6:.2f} us per rank per gather")


if __name__ == "__main__":
    main()
