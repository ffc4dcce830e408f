"""The op model's launch-overhead and memory-traffic terms, for chains of element-wise ops.

An element-wise op does one or two FLOPs per element and reads and writes every element, so
its arithmetic intensity is below 1 FLOP/byte, two orders of magnitude under any GPU's ridge
point: its time is the bytes it moves over the memory bandwidth, plus a fixed cost per launch.
Run as separate kernels, a chain of k ops writes every intermediate to memory and reads it
back; fused into one kernel, it reads the chain's inputs once and writes its output once
(intermediates stay in registers), and pays one launch instead of k.

Time of one kernel: ``launch_s + max(flops / peak_flops, nbytes / bandwidth_Bps)`` when the
host waits for each op (eager PyTorch on a CPU: dispatch and execution are serial).  A GPU
queues launches asynchronously (``async_launch=True``): the host issues kernel k at
``(k+1) * launch_s`` and the GPU starts it when it is issued and the previous one is done, so
the chain ends at ``max_k [(k+1) * launch_s + sum_{j>=k} execution_j]`` (the longest path through
the two queues).  In a long stream each kernel costs about ``max(launch_s, execution)``: the GPU
idles, "launch-bound", when kernels are shorter than the launch cost.

The simulated face of this model is ``labsim.sim.fusion.simulate_chain`` (a host process and a
device process in simpy); the tests check that both give the same times.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """One element-wise op: the tensors it reads, the tensor it writes, FLOPs per element."""

    name: str
    reads: tuple[str, ...]
    writes: str
    flops_per_element: float = 1.0

    def __post_init__(self) -> None:
        if not self.reads:
            raise ValueError(f"op {self.name!r} must read at least one tensor")
        if self.flops_per_element < 0:
            raise ValueError(f"op {self.name!r}: flops_per_element must be >= 0")


# Bias + GELU + dropout + residual, as eager PyTorch runs it with a given keep-mask:
#   y = (gelu(x + bias) * keep) * (1 / (1 - p)) + residual
# FLOPs count each arithmetic primitive once (erf as one); the chain is memory-bound whatever
# the exact count.
BIAS_GELU_DROPOUT_RESIDUAL: tuple[Op, ...] = (
    Op("add bias", ("x", "bias"), "t1", 1),
    Op("gelu", ("t1",), "t2", 5),  # x * 0.5 * (1 + erf(x / sqrt 2)): 4 arithmetic + erf
    Op("apply mask", ("t2", "keep"), "t3", 1),
    Op("scale 1/(1-p)", ("t3",), "t4", 1),
    Op("add residual", ("t4", "residual"), "y", 1),
)


def _check_sizes(ops: Sequence[Op], element_bytes: Mapping[str, float]) -> None:
    if not ops:
        raise ValueError("a chain needs at least one op")
    names = {t for op in ops for t in (*op.reads, op.writes)}
    missing = sorted(names - set(element_bytes))
    if missing:
        raise ValueError(
            f"element_bytes has no size for {missing}; give bytes per element of each tensor "
            "(0 for a broadcast operand such as a bias, which stays in cache)"
        )


def chain_launches(ops: Sequence[Op], *, fused: bool) -> int:
    """Kernel launches: one per op, or one for the fused chain."""
    if not ops:
        raise ValueError("a chain needs at least one op")
    return 1 if fused else len(ops)


def chain_bytes(
    ops: Sequence[Op], numel: int, element_bytes: Mapping[str, float], *, fused: bool
) -> float:
    """Bytes the chain moves to and from memory for tensors of ``numel`` elements.

    Unfused: every op reads all its operands and writes its result.  Fused: the chain's
    external inputs (read by some op, written by none) are read once and the tensors no op
    reads (the outputs) are written once.  ``element_bytes`` maps tensor names to bytes per
    element (4 for fp32, 1 for a bool mask, 0 for a broadcast bias).
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    _check_sizes(ops, element_bytes)
    if not fused:
        per_element = sum(
            sum(element_bytes[t] for t in op.reads) + element_bytes[op.writes] for op in ops
        )
        return float(per_element * numel)
    written = {op.writes for op in ops}
    read = {t for op in ops for t in op.reads}
    inputs = read - written
    outputs = written - read
    return float(sum(element_bytes[t] for t in inputs | outputs) * numel)


def chain_flops(ops: Sequence[Op], numel: int) -> float:
    """FLOPs of the chain (fusion does not change them)."""
    return float(sum(op.flops_per_element for op in ops) * numel)


@dataclass(frozen=True)
class ChainCost:
    """Predicted time of an element-wise chain, split into its launch and traffic terms."""

    launches: int
    nbytes: float
    flops: float
    launch_s: float  # total launch (dispatch) cost
    traffic_s: float  # total execution time, max(compute, memory) per kernel
    time_s: float

    @property
    def launch_bound(self) -> bool:
        """True when launches, not memory traffic, take most of the time."""
        return self.launch_s > self.traffic_s


def chain_time(
    ops: Sequence[Op],
    numel: int,
    element_bytes: Mapping[str, float],
    *,
    fused: bool,
    launch_s: float,
    bandwidth_Bps: float,
    peak_flops: float = math.inf,
    async_launch: bool = False,
) -> ChainCost:
    """Launch-overhead + memory-traffic model of an element-wise chain.

    Serial host (``async_launch=False``): ``time = launches * launch_s + sum(execution)``.
    Asynchronous launches (a GPU stream): the GPU runs kernel k once the host has issued it
    and kernel k-1 has finished; ``time = max_k [(k+1) launch_s + sum_{j>=k} execution_j]``.
    Execution of a kernel is ``max(flops / peak_flops, nbytes / bandwidth_Bps)``; an unfused
    chain's kernels are costed one by one.
    """
    if launch_s < 0:
        raise ValueError(f"launch_s must be >= 0, got {launch_s}")
    if bandwidth_Bps <= 0 or peak_flops <= 0:
        raise ValueError("bandwidth_Bps and peak_flops must be > 0")
    _check_sizes(ops, element_bytes)
    groups = [list(ops)] if fused else [[op] for op in ops]
    executions = []
    for group in groups:
        nbytes = chain_bytes(group, numel, element_bytes, fused=True)
        flops = chain_flops(group, numel)
        executions.append(max(flops / peak_flops, nbytes / bandwidth_Bps))
    launches = len(groups)
    traffic_s = sum(executions)
    if async_launch:
        time_s = max(
            (k + 1) * launch_s + sum(executions[k:]) for k in range(len(executions))
        )
    else:
        time_s = launches * launch_s + traffic_s
    return ChainCost(
        launches=launches,
        nbytes=chain_bytes(ops, numel, element_bytes, fused=fused),
        flops=chain_flops(ops, numel),
        launch_s=launches * launch_s,
        traffic_s=traffic_s,
        time_s=time_s,
    )


def fit_launch_model(nbytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``time = launch_s + nbytes / bandwidth_Bps`` to measurements.

    Returns ``(launch_s, bandwidth_Bps)``.  Needs at least two distinct sizes; a fit whose
    slope is not positive (time does not grow with bytes) raises ValueError.
    """
    if len(nbytes) != len(times_s):
        raise ValueError("nbytes and times_s must have the same length")
    if len(set(nbytes)) < 2:
        raise ValueError("need measurements at two or more distinct sizes")
    n = len(nbytes)
    mx = sum(nbytes) / n
    my = sum(times_s) / n
    sxx = sum((x - mx) ** 2 for x in nbytes)
    sxy = sum((x - mx) * (y - my) for x, y in zip(nbytes, times_s))
    slope = sxy / sxx
    if slope <= 0:
        raise ValueError("time does not grow with size: the fit has no bandwidth term")
    return my - slope * mx, 1.0 / slope
