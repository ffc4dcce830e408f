"""Which device a lab runs on, and timing that waits for it.

GPU work is asynchronous: a CUDA kernel launch returns before the kernel has run, so a wall
clock read right after it measures the launch, not the work.  ``time_fn`` synchronises the
device before and after every repetition.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def pick_device(prefer: str | None = None) -> torch.device:
    """``prefer`` if given, else CUDA, then Apple's MPS, then the CPU."""
    if prefer is not None:
        device = torch.device(prefer)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "prefer='cuda' but no CUDA GPU is visible; use prefer=None or 'cpu'"
            )
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def rank_device() -> torch.device:
    """The device this process group rank computes on: its own GPU (``LOCAL_RANK``, as torchrun
    and ``labsim.lab.launch`` set it) when the group runs on NCCL, else the CPU (gloo)."""
    import os

    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def device_name(device: torch.device | str | None = None) -> str:
    """A human name: 'NVIDIA H100 80GB HBM3', 'Apple MPS', 'CPU (2 threads)' or 'CPU (1 thread)'."""
    device = torch.device(device) if device is not None else pick_device()
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    threads = torch.get_num_threads()
    return f"CPU ({threads} thread{'s' if threads != 1 else ''})"


def synchronize(device: torch.device | str) -> None:
    """Wait until all queued work on ``device`` has finished (no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class Timing:
    """Seconds per call over ``repeat`` synchronised repetitions (after warm-up)."""

    times_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    def __repr__(self) -> str:
        return (
            f"Timing(median={self.median_s * 1e3:.3f} ms, min={self.min_s * 1e3:.3f} ms, "
            f"n={len(self.times_s)})"
        )


def time_fn(
    fn: Callable[[], Any],
    *,
    device: torch.device | str = "cpu",
    warmup: int = 1,
    repeat: int = 5,
    max_seconds: float | None = None,
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then up to ``repeat`` timed ones.

    ``max_seconds`` stops early (after at least one timed call) so a slow case cannot blow a
    lab's time budget.
    """
    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    start_all = time.perf_counter()
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
        if max_seconds is not None and time.perf_counter() - start_all > max_seconds:
            break
    return Timing(tuple(times))


def time_queued(
    fn: Callable[[], Any],
    *,
    device: torch.device | str = "cpu",
    calls: int = 100,
    warmup: int = 1,
) -> float:
    """Seconds per call of ``fn()`` issued ``calls`` times back to back with one
    synchronisation at the end: the *throughput* of a queue of launches.  ``time_fn``
    synchronises after every call and so measures each call's *latency*, launch and wait
    included; on a GPU, where launches are queued while earlier kernels run, the two differ
    whenever a kernel runs longer than its launch takes."""
    if calls < 1:
        raise ValueError("calls must be >= 1")
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / calls


class AsyncQueue:
    """A stand-in for an asynchronous device, for a CPU: ``launch(seconds)`` queues that much
    work and returns at once, as a CUDA kernel launch does; ``synchronize()`` waits until
    everything queued has run, as ``torch.cuda.synchronize()`` does.  A timer that reads the
    clock without synchronising measures the launches, not the work.

    By default the work runs on a worker thread, in real time.  ``AsyncQueue(virtual=True)``
    keeps a clock of its own instead (``clock()``): launching costs no time, the work runs
    back to back, and ``synchronize()`` moves the clock to the end of the queued work -- a
    timer read through ``clock`` measures the work exactly, however busy the machine is."""

    def __init__(self, virtual: bool = False) -> None:
        import queue
        import threading

        self.virtual = virtual
        self.launches = 0
        self.synchronizes = 0
        self._now = 0.0
        self._done_at = 0.0  # virtual: when the queued work ends
        self._jobs: queue.Queue[float | None] = queue.Queue()
        self._worker = None
        if not virtual:
            self._worker = threading.Thread(target=self._run, daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            seconds = self._jobs.get()
            if seconds is None:
                self._jobs.task_done()
                return
            time.sleep(seconds)
            self._jobs.task_done()

    def launch(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self.launches += 1
        if self.virtual:
            self._done_at = max(self._done_at, self._now) + seconds
        else:
            self._jobs.put(seconds)

    def synchronize(self) -> None:
        self.synchronizes += 1
        if self.virtual:
            self._now = max(self._now, self._done_at)
        else:
            self._jobs.join()

    def clock(self) -> float:
        """Seconds on this device's clock: ``time.perf_counter()``, or the virtual clock."""
        return self._now if self.virtual else time.perf_counter()

    def close(self) -> None:
        """Stop the worker thread (after the queued work)."""
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()


DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8-e5m2": torch.float8_e5m2,
    "fp8-e4m3": torch.float8_e4m3fn,
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``; a ``torch.dtype`` passes through."""
    if isinstance(name, torch.dtype):
        return name
    key = name.lower()
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[key]




def cpu_cache_bytes(level: int = 3) -> int | None:
    """Size in bytes of the CPU's level-``level`` cache as Linux reports it
    (``/sys/devices/system/cpu/cpu0/cache/index*/``, the unified or data cache of that level);
    None where the system does not say (macOS, Windows, some containers)."""
    from pathlib import Path

    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if int((index / "level").read_text()) != level:
                continue
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if size and size[-1] in units and size[:-1].isdigit():
            return int(size[:-1]) * units[size[-1]]
        if size.isdigit():
            return int(size)
    return None


BF16_CPU_UNITS = {"avx512_bf16": "AVX-512 BF16", "amx_bf16": "AMX BF16"}


def cpu_bf16_units() -> list[str] | None:
    """The bf16 arithmetic units this CPU reports (Linux ``/proc/cpuinfo`` flags
    ``avx512_bf16``, ``amx_bf16``), by name; [] when it has none, None where the system does
    not say.  Without them PyTorch runs a bf16 matmul by converting to fp32 in software."""
    from pathlib import Path

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), None)
    if flags is None:
        return None
    return [name for flag, name in BF16_CPU_UNITS.items() if flag in flags]
