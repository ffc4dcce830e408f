"""What the output layer and the loss hold at the start of backward, by the loss kernel a
framework runs (``labsim.software``'s ``cross_entropy``; ``labsim.memory.step_memory``
counts it on the last pipeline stage)."""

from __future__ import annotations

from labsim.workload import Transformer

CROSS_ENTROPY = ("eager", "megatron", "flash-attn")


def loss_memory(model: Transformer, *, micro_batch: int, tp: int = 1,
                dtype_bytes: float = 2, kernel: str = "eager") -> float:
    """Bytes the output layer and the cross-entropy hold at their peak, the start of
    backward, on the last pipeline stage (the vocabulary split over ``tp``), by the loss
    ``kernel`` (``labsim.software``'s ``cross_entropy``), with ``d = dtype_bytes`` the compute
    dtype's size, per logit:

    * ``"eager"``: the logits, their fp32 copy, the fp32 log-softmax that ``F.cross_entropy``
      keeps for backward, and the fp32 gradient its backward writes: ``s b V/t (d + 3 x 4)``;
    * ``"megatron"``: the logits and the fp32 copy that ``_VocabParallelCrossEntropy`` turns
      into the softmax in place, saves, and overwrites with the gradient:
      ``s b V/t (d + 4)`` (``megatron/core/tensor_parallel/cross_entropy.py``; Korthikanti et
      al. 2022, Sec. 4.3, count the fp32 logits);
    * ``"flash-attn"``: the saved logits and the gradient flash-attn's fused kernel writes in
      their dtype: ``s b V/t 2d`` (``flash_attn/losses/cross_entropy.py``; the per-row
      log-sum-exp is negligible).

    The eager figure is the loss of torchtitan's ``train.py`` at 9dec370
    (``cross_entropy(pred.flatten(0, 1).float(), labels)``) in eager PyTorch:
    ``aten._log_softmax`` saves its output, the ``nll_loss`` backward writes a gradient as
    large, and ``_log_softmax_backward_data`` a third.  The compute-dtype logits are freed
    before backward (torchtitan's ``del pred``), but the caching allocator keeps their block
    (``torch.cuda.memory_reserved``) and cannot serve the fp32 gradient from it (too small;
    the fp32 copy's block serves the first gradient), so the reserved peak holds all four.
    Korthikanti et al. 2022 (Sec. 4.3) count the fp32 logits alone, ``4 s b V/t``.
    """
    if kernel not in CROSS_ENTROPY:
        raise ValueError(f"kernel={kernel!r}: choose one of {CROSS_ENTROPY}")
    model.check_tp(tp)
    logits = model.seq_len * micro_batch * -(-model.vocab // tp)
    per_logit = {"eager": dtype_bytes + 3 * 4, "megatron": dtype_bytes + 4,
                 "flash-attn": 2 * dtype_bytes}[kernel]
    return logits * per_logit
