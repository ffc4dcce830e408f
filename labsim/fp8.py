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
  Transformer Engine 2.x): one more read of the 16-bit tensor before every cast;
* ``"blockwise"`` -- a scale per block, as DeepSeek-V3 trained (DeepSeek-AI 2024,
  arXiv:2412.19437, section 3.3.1 "Fine-Grained Quantization": 1 x 128 tiles of activations
  and gradients, 128 x 128 blocks of weights; Transformer Engine's ``Float8BlockScaling``):
  each block's amax is taken in the cast kernel (a tile fits in registers), which writes an
  fp32 scale per 128 elements beside each FP8 copy; a transposed operand is scaled along the
  other axis, so the fused inputs are quantized again from their 16-bit tensor, not
  transposed.  The GEMM applies the scales as it accumulates (DeepSeek-V3: promotion to CUDA
  cores every 128 elements of K), which costs tensor-core time: the best published
  block-scaled FP8 GEMM, DeepGEMM's "up to 1550 TFLOPS on H800" (deepseek-ai/DeepGEMM
  README, 2025.04.18; the H800's SMs and clocks are the H100 SXM's), against cuBLASLt's
  per-tensor FP8 at 1,609 TFLOP/s on H100 (docs/step.md section 3): ``BLOCKWISE_GEMM_SLOWDOWN``.

Weights are kept in FP8 between steps (NeMo's ``fp8_params: true``), so no weight is cast per
micro-batch.  Not modelled: MXFP8 (Blackwell's 1 x 32 blocks with E8M0 scales), FP8 attention,
FP8 all-gathers of tensor-parallel activations.
"""

from __future__ import annotations

from labsim.devices import GPU

FP8_RECIPES = ("delayed", "current", "blockwise")
BLOCK = 128  # elements per scale along a block's row (DeepSeek-V3's 1 x 128 tiles)
SCALE_BYTES = 4  # an fp32 scale
BLOCKWISE_GEMM_SLOWDOWN = 1609.0 / 1550.0  # per-tensor cuBLASLt over DeepGEMM (module doc)


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
    write the FP8 tensor and its transpose, with current scaling read it once more for its
    amax, with per-block scaling write a scale per block of each copy."""
    check_recipe(recipe)
    extra = {"delayed": 0.0, "current": source_bytes,
             "blockwise": 2 * SCALE_BYTES / BLOCK}[recipe]
    return source_bytes + 2 + extra


TRANSPOSE_BYTES = 2.0  # a fused kernel's FP8 output transposed: read one byte, write one


def fused_input_bytes(recipe: str, source_bytes: float) -> float:
    """Bytes per element of the second copy of an input a norm or activation kernel already
    wrote in FP8: its transpose (``TRANSPOSE_BYTES``), or under per-block scaling a
    quantization along the other axis from the 16-bit tensor (read it, write FP8 and
    scales)."""
    check_recipe(recipe)
    if recipe == "blockwise":
        return source_bytes + 1 + SCALE_BYTES / BLOCK
    return TRANSPOSE_BYTES


def gemm_slowdown(recipe: str | None) -> float:
    """How much longer an FP8 GEMM of ``recipe`` takes than a per-tensor-scaled one (1 for
    per-tensor recipes and for None)."""
    return BLOCKWISE_GEMM_SLOWDOWN if recipe == "blockwise" else 1.0
