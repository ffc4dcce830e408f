"""Speed by number format: what the roofline predicts for a transformer layer's matmuls.

On a GPU the low-precision formats win twice: tensor cores run bf16/fp16 at many times the
fp32 rate (H100 SXM: 989 vs 67 TFLOP/s dense, catalog), and each element is half the bytes, so
memory-bound work also moves half the traffic.  ``layer_gemm_times`` applies the roofline
(``labsim.roofline.Roofline``) to every GEMM of one layer (``Transformer.layer_gemms``) for each
dtype and sums the lower bounds.  It is a bound, not a measurement: real kernels reach 60-80 %
of the peak on large GEMMs.
"""

from __future__ import annotations

from collections.abc import Sequence

from labsim.hardware import GPU
from labsim.roofline import Roofline
from labsim.workload import Transformer

DTYPE_BYTES = {"fp64": 8, "fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}


def layer_gemm_times(
    model: Transformer,
    device: str | GPU,
    *,
    micro_batch: int = 1,
    dtypes: Sequence[str] = ("fp32", "tf32", "bf16"),
) -> dict[str, float]:
    """Roofline lower bound (seconds) of one layer's forward GEMMs, per dtype.

    ``tf32`` reads fp32 operands (4 bytes) on the tensor cores.  A dtype the GPU has no
    unit for raises ``ValueError`` (from the catalog).
    """
    out: dict[str, float] = {}
    for dtype in dtypes:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
        roof = Roofline.of(device, dtype)
        out[dtype] = sum(
            roof.op_time(g.flops, g.nbytes(DTYPE_BYTES[dtype]))
            for g in model.layer_gemms(micro_batch)
        )
    return out


def layer_gemm_points(
    model: Transformer,
    device: str | GPU,
    *,
    micro_batch: int = 1,
    dtypes: Sequence[str] = ("fp32", "bf16"),
) -> list[tuple[str, float, float]]:
    """(``"<dtype> <gemm>"``, intensity FLOP/byte, roofline-attainable FLOP/s) for each GEMM of
    one layer and each dtype: points for ``labsim.plots.roofline`` (predicted, not measured)."""
    points = []
    for dtype in dtypes:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
        roof = Roofline.of(device, dtype)
        for g in model.layer_gemms(micro_batch):
            intensity = g.intensity(DTYPE_BYTES[dtype])
            points.append((f"{dtype} {g.name}", intensity, roof.attainable_flops(intensity)))
    return points
