"""A decode step as two engines: HBM streaming each layer's weights and KV cache, the SMs
computing on what has arrived.

The simulated face of ``labsim.quantization.decode_step_time``.  For every layer the memory
engine moves the layer's weights once plus the KV cache of every sequence in the batch
(``bytes / bandwidth``); the compute engine then spends ``flops / peak`` on it.  The memory
engine runs ahead by up to ``prefetch`` layers (double buffering for ``prefetch=1``), so the
two overlap.  With perfect overlap the step takes the closed form's ``layers x max(memory,
compute)`` plus one layer of the shorter phase that cannot be hidden (the first load, or the
last computation); with ``prefetch=0`` nothing overlaps and it takes the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import simpy

from labsim.hardware import GPU
from labsim.quantization import decode_cost, llama2_7b
from labsim.trace import Trace
from labsim.workload import Transformer


@dataclass(frozen=True)
class DecodeResult:
    """One simulated decode step: ``time_s`` for all layers, one token per sequence."""

    time_s: float
    batch: int
    layers: int
    trace: Trace

    @property
    def per_token_s(self) -> float:
        """Step time per generated token (the step makes ``batch`` tokens)."""
        return self.time_s / self.batch

    def __repr__(self) -> str:
        return (
            f"DecodeResult({self.layers} layers, batch {self.batch}: "
            f"{self.time_s * 1e3:.4g} ms per step, {self.per_token_s * 1e6:.4g} µs per token)"
        )


def simulate_decode_step(
    gpu: GPU | str,
    model: Transformer | None = None,
    *,
    batch: int = 1,
    context: int = 1024,
    weights: str = "fp16",
    kv_cache: str = "fp16",
    compute: str = "fp16",
    layers: int | None = None,
    prefetch: int = 1,
) -> DecodeResult:
    """Simulate one decode step of ``layers`` (default: all of ``model``'s) decoder layers."""
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 layers, got {prefetch}")
    cost = decode_cost(gpu, model, batch=batch, context=context, weights=weights,
                       kv_cache=kv_cache, compute=compute)
    n = layers if layers is not None else (model or llama2_7b()).layers
    if n < 1:
        raise ValueError(f"layers must be >= 1, got {n}")
    load_s = batch * cost.nbytes / cost.roof.bandwidth_Bps  # weights once + every KV cache
    compute_s = batch * cost.flops / cost.roof.peak_flops
    env = simpy.Environment()
    trace = Trace()
    arrived = simpy.Store(env)
    slots = simpy.Resource(env, capacity=prefetch + 1)  # layer buffers: computing + ahead

    def memory() -> simpy.events.Event:
        for i in range(n):
            slot = slots.request()
            yield slot
            start = env.now
            yield env.timeout(load_s)
            trace.add(0, "hbm", "load", start, env.now, f"layer {i}", batch * cost.nbytes)
            yield arrived.put((i, slot))

    def sms() -> simpy.events.Event:
        for _ in range(n):
            i, slot = yield arrived.get()
            start = env.now
            yield env.timeout(compute_s)
            trace.add(0, "sm", "compute", start, env.now, f"layer {i}")
            slots.release(slot)

    env.process(memory())
    done = env.process(sms())
    env.run(until=done)
    return DecodeResult(env.now, batch, n, trace)
