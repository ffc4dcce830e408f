"""Two ``DataLoader`` options measured: ``in_order=False`` against a straggling worker, and
the copy ``pin_memory=True``'s thread makes of every batch.

``straggler_run`` consumes batches that take a fixed time to make, some much longer
(``labsim.lab.datasets.SleepyBatches``), so machine load does not change the lesson;
``pin_copy_cost`` times the pin thread's per-batch copy in a thread of this process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from labsim.experiments.loading import LoopTimes, time_loop


@dataclass(frozen=True)
class OrderRun:
    """One pass over ``SleepyBatches`` by a loop whose step takes a fixed time.

    ``order``: the batch indices in the order the loop received them; ``times``: its waits and
    steps.  ``displaced``: batches that arrived at another position than their index.
    """

    in_order: bool
    order: tuple[int, ...]
    times: LoopTimes

    @property
    def displaced(self) -> int:
        return sum(1 for k, i in enumerate(self.order) if k != i)


def straggler_run(dataset: Any, *, in_order: bool, num_workers: int = 2,
                  prefetch_factor: int = 2, step_s: float = 0.02) -> OrderRun:
    """Consume every batch of ``dataset`` (``batch_size=None``) with a step of ``step_s``.

    ``in_order=False`` (PyTorch >= 2.6, ``torch/utils/data/dataloader.py``,
    ``_MultiProcessingDataLoaderIter._next_data``) hands over a batch that is ready instead of
    holding it until every earlier one came, and gives the next index to a worker with spare
    capacity rather than strictly round robin (``_try_put_index``).
    """
    import multiprocessing as mp

    from torch.utils.data import DataLoader

    context = "fork" if "fork" in mp.get_all_start_methods() else None
    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers,
                        prefetch_factor=prefetch_factor, in_order=in_order,
                        multiprocessing_context=context)
    order: list[int] = []

    def step(batch: Any) -> None:
        order.append(int(batch))
        time.sleep(step_s)

    wait_s, steps = time_loop(loader, step)
    label = "in_order=True" if in_order else "in_order=False"
    return OrderRun(in_order, tuple(order), LoopTimes(tuple(wait_s), tuple(steps), label))


@dataclass(frozen=True)
class CopyCost:
    """Median cost of the copy a pin-memory thread makes of one batch of ``nbytes``.

    ``wall_s``: elapsed; ``cpu_s``: CPU time of the copying thread (``time.thread_time``) --
    time taken from the training process's cores, since the thread lives in it.
    ``pinned``: True when the copy was a real ``Tensor.pin_memory()`` (a GPU is present),
    False when it was a plain copy into a preallocated buffer (the memcpy part only).
    """

    nbytes: int
    wall_s: float
    cpu_s: float
    pinned: bool

    @property
    def bandwidth_Bps(self) -> float:
        return self.nbytes / self.wall_s


def pin_copy_cost(nbytes: int, repeats: int = 5) -> CopyCost:
    """Time, in a thread of this process, the copy PyTorch's pin thread makes per batch.

    PyTorch's ``_pin_memory_loop`` (``torch/utils/data/_utils/pin_memory.py``) runs in a
    thread of the training process with one intra-op thread and calls
    ``tensor.pin_memory()``: a page-locked buffer (from the caching host allocator) and one
    copy of the batch into it.  Without an accelerator ``DataLoader(pin_memory=True)`` warns
    and pins nothing; then only the copy into an ordinary buffer is timed.
    """
    import threading

    pinned = torch.cuda.is_available()
    src = torch.ones(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    walls: list[float] = []
    cpus: list[float] = []

    def work() -> None:
        torch.set_num_threads(1)
        for r in range(repeats + 1):
            t0, c0 = time.perf_counter(), time.thread_time()
            if pinned:
                src.pin_memory()
            else:
                dst.copy_(src)
            if r:  # the first copy faults the destination's pages in
                walls.append(time.perf_counter() - t0)
                cpus.append(time.thread_time() - c0)

    thread = threading.Thread(target=work, name="pin-like copy")
    thread.start()
    thread.join()
    return CopyCost(src.nbytes, float(np.median(walls)), float(np.median(cpus)), pinned)
