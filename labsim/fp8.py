"""FP8 training: which GEMMs run in FP8 and what its casts move (Transformer Engine's recipes).

Transformer Engine runs the three GEMMs of every linear layer (forward, data gradient, weight
gradient) in FP8 at the GPU's FP8 tensor-core peak: E4M3 for activations and weights, E5M2
for gradients ("HYBRID", NeMo's ``fp8_hybrid: true``; Micikevicius et al. 2022, "FP8 Formats
for Deep Learning", arXiv:2209.05433).  The attention core, the output layer and every
element-wise kernel stay in 16 bit.  GEMM operands are one byte.

An FP8 operand is cast from its 16-bit tensor, and the weight gradient needs the transposed
one: Transformer Engine's fused kernels write both (``cast_transpose``).  Where a norm or the
MLP activation feeds a linear layer, its kernel writes the FP8 tensor itself
(``LayerNormLinear``, ``LayerNormMLP``); the attention output projection's input needs a cast
of its own, and every linear layer's output gradient one in backward.  Bytes moved per element
(``cast_bytes``): read the 16-bit tensor, write the FP8 tensor and its transpose; a transpose
alone (the fused inputs): read and write one byte.  Recipes (``FP8_RECIPES``):

* ``"delayed"`` -- per-tensor scales from the history of past amax values (``DelayedScaling``;
  NeMo 24.11's recipes: ``fp8_amax_history_len: 1024``, ``fp8_amax_compute_algo: max``): the
  amax is taken inside the cast kernel, no extra pass;
* ``"current"`` -- per-tensor scale from the tensor's own amax (``Float8CurrentScaling``,
  Transformer Engine 2.x): one more read of the 16-bit tensor before every cast.

Weights are kept in FP8 between steps (NeMo's ``fp8_params: true``), so no weight is cast per
micro-batch.  Not modelled: per-block scaling (DeepSeek-V3's 1 x 128 / 128 x 128 tiles,
MXFP8), FP8 attention, FP8 all-gathers of tensor-parallel activations.
"""

from __future__ import annotations

from labsim.devices import GPU

FP8_RECIPES = ("delayed", "current")


def check_recipe(recipe: str) -> str:
    """``recipe`` if it is one of ``FP8_RECIPES``, else ``ValueError`` naming them."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8={recipe!r}: choose one of {FP8_RECIPES}, or None for no FP8")
    return recipe


def check_gpu(recipes: tuple[str | None, ...], gpu: GPU) -> None:
    """``ValueError`` naming the fix when any of ``recipes`` (None: no FP8) is asked of a GPU
    without FP8 tensor cores; each recipe checked (``check_recipe``)."""
    wanted = tuple(check_recipe(r) for r in recipes if r is not None)
    if wanted and "fp8" not in gpu.peak_flops:
        raise ValueError(f"fp8={wanted[0]!r} on {gpu.name}, which has no FP8 tensor cores: use "
                         "an H100, H200 or B200, or no FP8 (fp8=None)")


def cast_bytes(recipe: str, source_bytes: float) -> float:
    """Bytes a cast-transpose moves per element of a ``source_bytes``-wide tensor: read it,
    write the FP8 tensor and its transpose, and with current scaling read it once more for
    its amax."""
    check_recipe(recipe)
    return source_bytes + 2 + (source_bytes if recipe == "current" else 0)


TRANSPOSE_BYTES = 2.0  # a fused kernel's FP8 output transposed: read one byte, write one
