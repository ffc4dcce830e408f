"""Number formats: the one vocabulary of dtypes and training precisions, and speed by format.

``DTYPE_BYTES`` is the one table of bytes per element by dtype name (the catalog's keys).
A ``Precision`` says how a training run stores and computes its numbers; every part of labsim
that needs it (``labsim.Plan``, ``labsim.training_memory``, the step simulator's compute) takes
a name from ``PRECISIONS`` and derives bytes and peak FLOP/s from it here, once:

====================  ========  =======  =====  ==============================  ======
name                  compute   weights  grads  optimizer (Adam)                total
====================  ========  =======  =====  ==============================  ======
``"fp32"``            fp32/tf32 4        4      m 4 + v 4                       16
``"bf16"``/``"fp16"`` 16-bit    2        2      fp32 master 4 + m 4 + v 4       16
``"mixed"``           = ``"bf16"`` (the ZeRO paper's name, Rajbhandari et al. 2020)
``"mixed-fp32-grads"`` bf16     2        4      12 (Megatron-LM's fp32 gradients) 18
``"autocast-bf16"``   bf16      4        4      m 4 + v 4 (torch.amp keeps fp32  16
``"autocast-fp16"``   fp16                      weights; casts them per op)
``"pure-bf16"``       bf16      2        2      m 2 + v 2 (no fp32 copy)        8
``"pure-fp16"``       fp16      2        2      m 2 + v 2                       8
====================  ========  =======  =====  ==============================  ======

Activations are stored in the compute dtype (4 bytes for fp32, 2 for the 16-bit formats).

``"mixed-fp32-grads-remainders"`` (bf16; weights 2, gradients 4, remainder 2 + m 4 + v 4:
16 bytes) is what NeMo's ``distributed_fused_adam`` (Apex
``DistributedFusedAdam``) keeps by default for a bf16 model: its gradient buffer and reduction
in the optimizer dtype (fp32), and, with ``store_param_remainders``, the fp32 master as the
bf16 weight plus the low 16 bits (NeMo ``megatron_base_model.setup_optimization``; Apex
``StateBucket``).  With the recipe's ``optim.dtype: bf16`` and ``grad_sync_dtype: bf16`` (as
the Nemotron-4 340B recipe sets) the optimizer dtype equals the model's, no copy is stored and
training is ``"pure-bf16"``.

On a GPU the low-precision formats win twice: tensor cores run bf16/fp16 at many times the
fp32 rate (H100 SXM: 989 vs 67 TFLOP/s dense, catalog), and each element is half the bytes, so
memory-bound work also moves half the traffic.  ``layer_gemm_times`` applies the roofline
(``labsim.roofline.Roofline``) to every GEMM of one layer (``Transformer.layer_gemms``) for each
dtype and sums the lower bounds.  It is a bound, not a measurement: real kernels reach 60-80 %
of the peak on large GEMMs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labsim.hardware import GPU
from labsim.roofline import Roofline
from labsim.workload import Transformer

# bytes per element of every dtype labsim names (tf32 is stored as fp32; int4 packs two)
DTYPE_BYTES: dict[str, float] = {
    "fp64": 8, "fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "int4": 0.5,
}


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of ``dtype`` (``DTYPE_BYTES``); an unknown name raises ``ValueError``
    listing the known ones."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}") \
            from None


@dataclass(frozen=True)
class Precision:
    """How a training run stores and computes its numbers (bytes per parameter and element).

    ``compute``: the dtype GEMMs run in and activations are stored in; ``weight_bytes`` and
    ``grad_bytes`` per parameter; ``master_bytes``: the fp32 master copy an optimizer keeps
    beside 16-bit weights (0 when the weights are the master); ``state_bytes``: one optimizer
    state (Adam keeps two: m and v; SGD with momentum one).
    """

    name: str
    compute: str
    weight_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element (the compute dtype)."""
        return int(DTYPE_BYTES[self.compute])

    def peak_dtype(self, gpu: GPU) -> str:
        """The catalog key of the peak this precision's GEMMs run at on ``gpu``: fp32 GEMMs use
        TF32 tensor cores where the GPU has them (what cuBLAS does when TF32 is enabled, as
        Megatron-LM and PyTorch's ``allow_tf32`` do)."""
        if self.compute == "fp32" and "tf32" in gpu.peak_flops:
            return "tf32"
        return self.compute


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", "fp32", 4, 4, 0, 4),
    Precision("bf16", "bf16", 2, 2, 4, 4),
    Precision("fp16", "fp16", 2, 2, 4, 4),
    Precision("mixed", "bf16", 2, 2, 4, 4),
    Precision("mixed-fp32-grads", "bf16", 2, 4, 4, 4),
    Precision("mixed-fp32-grads-remainders", "bf16", 2, 4, 2, 4),
    Precision("autocast-bf16", "bf16", 4, 4, 0, 4),
    Precision("autocast-fp16", "fp16", 4, 4, 0, 4),
    Precision("pure-bf16", "bf16", 2, 2, 0, 2),
    Precision("pure-fp16", "fp16", 2, 2, 0, 2),
)}


def training_precision(name: str | Precision) -> Precision:
    """The ``Precision`` called ``name`` (a ``Precision`` passes through); an unknown name raises
    ``ValueError`` listing the known ones."""
    if isinstance(name, Precision):
        return name
    if not isinstance(name, str) or name.lower() not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; use one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name.lower()]


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
        e = dtype_bytes(dtype)
        roof = Roofline.of(device, dtype)
        out[dtype] = sum(
            roof.op_time(g.flops, g.nbytes(e))
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
        e = dtype_bytes(dtype)
        roof = Roofline.of(device, dtype)
        for g in model.layer_gemms(micro_batch):
            intensity = g.intensity(e)
            points.append((f"{dtype} {g.name}", intensity, roof.attainable_flops(intensity)))
    return points
