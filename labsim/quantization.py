"""Why int8 speeds up decoding and not training: bytes moved per token on the roofline.

Generating one token with a decoder layer reads every weight of the layer once for the whole
batch, plus each sequence's KV cache, and does ~2 FLOP per weight per token.  At small batch
the arithmetic intensity (FLOP per byte) is far below a GPU's ridge point, so the time is
``bytes / memory_bandwidth``: halving the bytes of the weights (fp16 -> int8) can at best halve
the time, whatever the int8 peak.  A training matmul has thousands of tokens per weight read,
sits far right of the ridge point, and int8 could only help by the ratio of the peaks (and
training needs gradients in floating point anyway).

Closed forms only (``labsim.roofline``: time = max(FLOP / peak, bytes / bandwidth), Williams,
Waterman & Patterson 2009).  Layer shapes come from ``labsim.workload.Transformer``.
"""

from __future__ import annotations

from dataclasses import dataclass

from labsim.hardware import GPU
from labsim.precision import dtype_bytes
from labsim.roofline import Roofline
from labsim.workload import Transformer


def llama2_7b() -> Transformer:
    """Llama-2-7B (Touvron et al. 2023, Table 1): 32 layers of h = 4096, SwiGLU 11008."""
    return Transformer.preset("llama2-7b")


@dataclass(frozen=True)
class DecodeCost:
    """One decode step of one layer, per generated token, on one GPU (roofline bound)."""

    flops: float  # per token
    weight_bytes: float  # per token: the layer's weights read once per step / batch
    kv_bytes: float  # per token: its own KV cache read once
    roof: Roofline  # the GPU at the dtype the layer computes in

    @property
    def nbytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """FLOP per byte moved."""
        return self.flops / self.nbytes

    @property
    def time_s(self) -> float:
        """Roofline lower bound on the time per token: max(compute, memory)."""
        return self.roof.op_time(self.flops, self.nbytes)

    @property
    def bound(self) -> str:
        """"memory" or "compute"."""
        return self.roof.bound(self.flops, self.nbytes)

    def __repr__(self) -> str:
        return (
            f"DecodeCost({self.nbytes / 1e6:.3g} MB/token, {self.flops / 1e6:.3g} MFLOP/token, "
            f"{self.intensity:.3g} FLOP/B, {self.time_s * 1e6:.3g} µs/token, {self.bound}-bound)"
        )


def decode_cost(
    gpu: GPU | str,
    model: Transformer | None = None,
    *,
    batch: int = 1,
    context: int = 1024,
    weights: str = "fp16",
    kv_cache: str = "fp16",
    compute: str = "fp16",
) -> DecodeCost:
    """Bytes and FLOP per generated token of one decoder layer of ``model`` (default
    Llama-2-7B), at ``batch`` sequences decoded together.

    FLOP: 2 per weight, plus 4 x context x hidden for attention scores and their weighted sum.
    Bytes: the layer's parameters once per step shared by the batch (norms and biases, < 0.01 %
    here, counted at the weight dtype too), plus this token's KV cache (2 x context x kv_dim
    values).  ``compute`` picks the catalog peak (``"int8"`` when both
    weights and activations are int8, W8A8; ``"fp16"`` for weight-only int8, W8A16, where the
    weights are widened in registers).  Activations read/written are ignored (O(hidden)).
    """
    if batch < 1 or context < 0:
        raise ValueError("batch must be >= 1 and context >= 0")
    layer = model if model is not None else llama2_7b()
    params = layer.params_per_layer
    flops = 2.0 * params + 4.0 * context * layer.hidden
    weight_bytes = params * dtype_bytes(weights) / batch
    kv_bytes = 2.0 * context * layer.kv_dim * dtype_bytes(kv_cache)
    return DecodeCost(flops, weight_bytes, kv_bytes, Roofline.of(gpu, compute))


def int8_decode_speedup(
    gpu: GPU | str,
    model: Transformer | None = None,
    *,
    batch: int = 1,
    context: int = 1024,
    baseline: str = "fp16",
    activations_int8: bool = False,
) -> float:
    """Upper bound on decode speed-up from int8 weights: baseline time / int8 time.

    The KV cache stays in the baseline dtype.  Without ``activations_int8`` (weight-only) the
    int8 layer computes at the baseline's peak; with it, at the catalog's int8 peak.  It tends
    to bytes(baseline)/1 as batch -> 1 and context -> 0, and to the ratio of peaks once both
    are compute-bound.
    """
    base = decode_cost(
        gpu, model, batch=batch, context=context, weights=baseline,
        kv_cache=baseline, compute=baseline,
    )
    q = decode_cost(
        gpu, model, batch=batch, context=context, weights="int8", kv_cache=baseline,
        compute="int8" if activations_int8 else baseline,
    )
    return base.time_s / q.time_s


def decode_step_time(
    gpu: GPU | str,
    model: Transformer | None = None,
    *,
    batch: int = 1,
    context: int = 1024,
    weights: str = "fp16",
    kv_cache: str = "fp16",
    compute: str = "fp16",
    layers: int | None = None,
) -> float:
    """Roofline time of one decode step (one token for each of ``batch`` sequences) through
    ``layers`` decoder layers (default: all of ``model``'s; Llama-2-7B has 32).

    Closed face of ``labsim.sim.quantization.simulate_decode_step``: per layer max(compute, memory)
    for the whole batch, memory and compute perfectly overlapped.
    """
    layer = model if model is not None else llama2_7b()
    n = layers if layers is not None else layer.layers
    if n < 1:
        raise ValueError(f"layers must be >= 1, got {n}")
    cost = decode_cost(gpu, layer, batch=batch, context=context, weights=weights,
                       kv_cache=kv_cache, compute=compute)
    return n * batch * cost.time_s


@dataclass(frozen=True)
class MatmulCost:
    """An (m x k) @ (k x n) matmul on the roofline."""

    flops: float
    nbytes: float
    roof: Roofline

    @property
    def intensity(self) -> float:
        return self.flops / self.nbytes

    @property
    def time_s(self) -> float:
        return self.roof.op_time(self.flops, self.nbytes)


def matmul_cost(
    gpu: GPU | str, m: int, n: int, k: int, *, dtype: str = "fp16", out_dtype: str | None = None
) -> MatmulCost:
    """2mnk FLOP; bytes = both inputs once in ``dtype`` + output in ``out_dtype``.

    Int8 GEMMs accumulate in int32, so ``out_dtype`` defaults to 4 bytes for int8 and to the
    input dtype otherwise.
    """
    if min(m, n, k) < 1:
        raise ValueError("m, n and k must be >= 1")
    out = out_dtype or ("fp32" if dtype.lower() == "int8" else dtype)
    nbytes = (m * k + k * n) * dtype_bytes(dtype) + m * n * dtype_bytes(out)
    return MatmulCost(2.0 * m * n * k, nbytes, Roofline.of(gpu, dtype))
