"""Kernel launches as a simulated process: a host that issues ops and a device that runs them.

The simulated face of ``labsim.fusion.chain_time``.  The host spends ``launch_s`` issuing each
kernel; the device runs kernels one after another in issue order, each for
``max(flops / peak_flops, nbytes / bandwidth_Bps)``.

- ``async_launch=False`` (eager PyTorch on a CPU): the host waits for each kernel to finish
  before issuing the next, so launch and execution alternate.
- ``async_launch=True`` (a CUDA stream): the host issues kernel k+1 while kernel k runs; the
  device idles whenever the host has not issued the next kernel yet (launch-bound).

The trace has one span per launch on stream "host" and one per kernel on stream "device".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import simpy

from labsim.fusion import Op, chain_bytes, chain_flops
from labsim.trace import Trace


@dataclass(frozen=True)
class LaunchRun:
    """A simulated chain: when the last kernel finished, and the host/device timeline."""

    time_s: float
    launches: int
    device_busy_s: float
    trace: Trace

    @property
    def device_idle_fraction(self) -> float:
        return 1.0 - self.device_busy_s / self.time_s if self.time_s else 0.0


def simulate_chain(
    ops: Sequence[Op],
    numel: int,
    element_bytes: Mapping[str, float],
    *,
    fused: bool,
    launch_s: float,
    bandwidth_Bps: float,
    peak_flops: float = math.inf,
    async_launch: bool = False,
) -> LaunchRun:
    """Run the chain's kernels through a host process and a device process (simpy)."""
    if launch_s < 0 or bandwidth_Bps <= 0 or peak_flops <= 0:
        raise ValueError("launch_s must be >= 0, bandwidth_Bps and peak_flops > 0")
    if not ops:
        raise ValueError("a chain needs at least one op")
    groups = [list(ops)] if fused else [[op] for op in ops]
    kernels = []
    for group in groups:
        nbytes = chain_bytes(group, numel, element_bytes, fused=True)
        run_s = max(chain_flops(group, numel) / peak_flops, nbytes / bandwidth_Bps)
        kernels.append((" + ".join(op.name for op in group), run_s, nbytes))

    env = simpy.Environment()
    queue: simpy.Store = simpy.Store(env)
    trace = Trace()
    busy = [0.0]

    def device():  # noqa: ANN202 - a simpy process
        for _ in kernels:
            name, run_s, nbytes, done = yield queue.get()
            start = env.now
            yield env.timeout(run_s)
            busy[0] += run_s
            trace.add(0, "device", "compute", start, env.now, name, nbytes)
            done.succeed()

    def host():  # noqa: ANN202 - a simpy process
        for name, run_s, nbytes in kernels:
            start = env.now
            yield env.timeout(launch_s)
            trace.add(0, "host", "launch", start, env.now, f"launch {name}")
            done = env.event()
            yield queue.put((name, run_s, nbytes, done))
            if not async_launch:
                yield done

    env.process(host())
    finished = env.process(device())
    env.run(until=finished)
    return LaunchRun(env.now, len(kernels), busy[0], trace)
