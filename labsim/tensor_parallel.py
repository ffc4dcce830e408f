"""Closed forms of tensor parallelism: how much a layer communicates, and how long a
collective takes when it is cut into pieces that overlap the GEMM it feeds.

* Megatron-LM's split (Shoeybi et al. 2019) all-reduces the ``b s h`` layer output twice in
  forward and twice in backward; a ring all-reduce sends ``2 (t-1)/t`` of its payload from each
  device, so a layer sends ``8 b s h (t-1)/t`` elements per device per micro-batch (Narayanan et
  al. 2021, section 3.2).  Sequence parallelism (Korthikanti et al. 2022) replaces every
  all-reduce by a reduce-scatter plus an all-gather: the same elements on the wire.
* Collective matmul (Wang et al. 2023, "Overlap Communication with Dependent Computation via
  Decomposition in Large Deep Learning Models", ASPLOS; PyTorch's async tensor parallelism and
  Megatron-Core's TP communication overlap do the same): the all-gather before a
  column-parallel GEMM is cut into its ``t - 1`` ring steps, and each GEMM on the shard that has
  arrived runs while the next shard travels.  With ``g = gemm_s / t`` per shard and
  ``c = comm_s / (t - 1)`` per ring step, the pair takes ``max(t g, (t - 1) c + g)`` instead of
  ``gemm_s + comm_s``: the communication hides completely when a step's transfer is shorter
  than a shard's GEMM, and never more than one shard's GEMM is exposed otherwise.  A GEMM
  followed by a reduce-scatter is the same chain run backwards.
"""

from __future__ import annotations

__all__ = ["collective_matmul_s", "layer_gemm_flops", "tp_comm_elements"]


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value >= 0:
            raise ValueError(f"{name}={value!r} must be a number >= 0")


def tp_comm_elements(micro_batch: int, seq: int, hidden: int, tp: int) -> float:
    """Elements one device sends per layer and micro-batch for Megatron tensor parallelism,
    forward and backward: ``8 b s h (t - 1) / t`` (four ring all-reduces of ``b s h``)."""
    for name, value in (("micro_batch", micro_batch), ("seq", seq), ("hidden", hidden),
                        ("tp", tp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    return 8.0 * micro_batch * seq * hidden * (tp - 1) / tp


def collective_matmul_s(gemm_s: float, comm_s: float, tp: int,
                        overlap_slowdown: float = 0.0) -> float:
    """Seconds of a GEMM and its all-gather (or reduce-scatter) over ``tp`` devices, cut into
    ``tp`` shards whose GEMMs overlap the ring steps: ``max(t g, (t - 1) c + g)`` with
    ``g = gemm_s / t`` and ``c = comm_s / (t - 1)`` (``gemm_s`` when ``tp`` = 1).

    ``overlap_slowdown``: the fraction by which a GEMM shard slows while a ring step runs
    beside it (the communication kernels hold SMs and HBM bandwidth; 0.189 on average in Lee
    et al. 2025, ``labsim.compute.OVERLAP_SLOWDOWN``): the ``t - 1`` shards under the ring
    then take ``g (1 + slowdown)`` each.  Smaller GEMMs also run less efficiently than the
    whole one; that is not charged, so the result stays a lower bound on the time."""
    _positive(gemm_s=gemm_s, comm_s=comm_s)
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive integer")
    if not 0 <= overlap_slowdown < 1:
        raise ValueError(f"overlap_slowdown={overlap_slowdown!r} must be in [0, 1)")
    if tp == 1:
        return gemm_s
    g, c = gemm_s / tp, comm_s / (tp - 1)
    return max((tp - 1) * g * (1 + overlap_slowdown) + g, (tp - 1) * c + g)


def layer_gemm_flops(micro_batch: int, seq: int, hidden: int, ffn: int | None = None
                     ) -> dict[str, float]:
    """Forward FLOPs of one GPT layer's parts for ``b`` sequences of ``s`` tokens (the whole
    layer; a tensor-parallel rank does 1/t of each): the fused QKV GEMM ``6 b s h^2``, the
    attention core ``4 b s^2 h``, the output projection ``2 b s h^2``, the MLP's two GEMMs
    ``2 b s h f`` each (Narayanan et al. 2021, appendix)."""
    f = ffn or 4 * hidden
    tokens = micro_batch * seq
    return {"qkv": 6.0 * tokens * hidden ** 2, "core": 4.0 * tokens * seq * hidden,
            "out": 2.0 * tokens * hidden ** 2, "up": 2.0 * tokens * hidden * f,
            "down": 2.0 * tokens * hidden * f}
