"""torchtitan's op-level selective activation checkpointing (``recompute="op-sac"``).

A block runs under PyTorch's non-reentrant checkpoint with a selective policy: it keeps its
input and the outputs of the ops on torchtitan's save list (every other matmul, the SDPA
kernel), and its backward recomputes the rest.  ``op_sac_matmuls`` says which matmuls are
saved, ``op_sac_per_layer`` what a block keeps (``labsim.memory``), and
``labsim.compute`` prices what the backward runs again.
"""

from __future__ import annotations

from labsim.workload import Transformer

# torchtitan's op-level SAC save list (``torchtitan/parallelisms/parallelize_llama.py``,
# ``_save_list`` and ``_apply_ac_to_transformer_block`` at commit 9dec370, 2024-12-26, the
# version of its Llama 3.1 benchmarks, ``benchmarks/llama3_h100_202412_torchtitan.md``).
OP_SAC_SOURCE = ("pytorch/torchtitan 9dec370ad26b5f8e9a7333a0e36165018262644b, "
                 "torchtitan/parallelisms/parallelize_llama.py: _save_list, "
                 "_apply_ac_to_transformer_block(selective_ac_option='op')")


def op_sac_matmuls(model: Transformer) -> tuple[tuple[str, int, int, bool], ...]:
    """The block's ``aten.mm`` calls in forward order as torchtitan's Llama runs them, each
    ``(name, out_features, in_features, saved)`` before any tensor-parallel split: ``wq``,
    ``wk``, ``wv``, ``wo``, then ``w1`` (gate), ``w3`` (up), ``w2`` (down) for SwiGLU
    (``w2(silu(w1(x)) * w3(x))``, ``torchtitan/models/llama/model.py``) or ``fc1``, ``fc2``
    for a GeLU MLP.  torchtitan's policy saves an ``aten.mm`` output unless it is the 2nd,
    4th, ... of the block (its ``mm_count % 2 == 0`` test): wq, wv, w1, w2 saved; wk, wo, w3
    recomputed.  A linear layer with a bias runs ``aten.addmm``, which the save list does not
    name and the count skips: a biased model saves none of its projections."""
    h, kv, f = model.hidden, model.kv_dim, model.ffn_hidden
    calls = [("wq", h, h), ("wk", kv, h), ("wv", kv, h), ("wo", h, h)]
    calls += ([("w1", f, h), ("w3", f, h), ("w2", h, f)] if model.swiglu
              else [("fc1", f, h), ("fc2", h, f)])
    if model.bias:
        return tuple((name, out, inp, False) for name, out, inp in calls)
    return tuple((name, out, inp, i % 2 == 0) for i, (name, out, inp) in enumerate(calls))


def op_sac_per_layer(model: Transformer, *, micro_batch: int, tp: int = 1,
                     sequence_parallel: bool = False, dtype_bytes: float = 2,
                     attention: str = "flash") -> float:
    """Bytes one block keeps for backward under torchtitan's op-level selective activation
    checkpointing (``OP_SAC_SOURCE``).

    The block runs under PyTorch's non-reentrant ``torch.utils.checkpoint`` with a
    ``create_selective_checkpoint_contexts`` policy: autograd's saved tensors are dropped
    (the checkpoint's pack hook keeps a handle only), the checkpoint keeps its input, and the
    caching dispatch mode keeps the outputs of every ``MUST_SAVE`` op for the backward's
    recomputation to reuse.  torchtitan's ``_save_list`` names ``aten.mm``,
    ``aten._scaled_dot_product_flash_attention`` / ``_efficient_attention``,
    ``_c10d_functional.reduce_scatter_tensor`` and (for float8) ``aten.abs`` / ``aten.max``,
    and every other ``aten.mm`` is recomputed (``op_sac_matmuls``).  With s, b, h, t, d =
    ``dtype_bytes``, kv = K/V width, f = MLP width, a = heads, for a Llama (SwiGLU, no bias,
    FlashAttention):

        ``d sb (h + h + kv/t + h/t + f/t + h) + 4 a s b / t``

    the block input (sbh; sbh/t with sequence parallelism), wq's output (h/t wide), wv's
    (kv/t), the SDPA output (h/t) and its fp32 log-sum-exp (4 bytes per head and token), w1's
    output (f/t) and w2's (the row-parallel output before its reduction: h wide on every TP
    rank); with sequence parallelism the two reduce-scatter outputs (sbh/t each) are kept
    too.  With ``attention="standard"`` the attention core runs as ``aten.bmm`` and softmax,
    none of which the list saves.  For Llama 3.1 8B (h 4096, kv 1024, f 14336, a 32) that is
    ``2 (4h + kv + f) + 4a`` = 63,616 bytes a token, against 167,936 for ``recompute="none"``
    (``activation_per_layer``).
    """
    model.check_tp(tp)
    if sequence_parallel and tp == 1:
        sequence_parallel = False
    s, b, h, t, d = model.seq_len, micro_batch, model.hidden, tp, dtype_bytes
    sb = s * b
    width = h / t if sequence_parallel else h  # the block input
    for name, out, _inp, saved in op_sac_matmuls(model):
        if saved:
            row_parallel = name in ("wo", "w2", "fc2")
            width += out if row_parallel else out / t
    if sequence_parallel:
        width += 2 * h / t  # the attention's and the MLP's reduce-scatter outputs
    lse = 0.0
    if attention == "flash":
        width += h / t  # the SDPA output
        lse = 4 * model.heads * sb / t  # its fp32 log-sum-exp
    return d * sb * width + lse
