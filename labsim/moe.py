"""Which layers of a mixture-of-experts model are MoE layers, and the checks of its expert
fields (``labsim.workload.Transformer``, whose doc gives their meaning).

After ``dense_layers`` leading dense layers (DeepSeek's ``first_k_dense_replace``), every
``moe_every``-th layer is an MoE layer and the others keep a dense MLP: layer ``i`` is an MoE
layer when ``i >= dense_layers`` and ``(i - dense_layers + 1) % moe_every == 0``.  With
``moe_every = 2`` that is Llama 4 Maverick's alternation (Hugging Face ``Llama4TextConfig``:
``moe_layers = range(interleave_moe_layer_step - 1, num_hidden_layers,
interleave_moe_layer_step)``); with 1, every layer after the dense ones.
"""

from __future__ import annotations

from typing import Any


def moe_layers_of(model: Any, layers: int, first_layer: int = 0) -> int:
    """MoE layers among ``layers`` layers from ``first_layer`` (0 for a dense model)."""
    if not model.experts:
        return 0

    def before(x: int) -> int:  # MoE layers with an index below x
        return max(0, x - model.dense_layers) // model.moe_every

    return before(first_layer + layers) - before(first_layer)


def check_experts(model: Any) -> None:
    """Check a model's mixture-of-experts fields; default the widths."""
    for name in ("experts", "top_k", "shared_experts", "dense_layers"):
        value = getattr(model, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    every = model.moe_every
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"moe_every must be an integer >= 1 (1: every layer after the dense "
                         f"ones is an MoE layer), got {every!r}")
    if not model.experts:
        if model.top_k or model.shared_experts or model.dense_layers or every != 1 or (
                model.expert_ffn_hidden is not None or model.shared_ffn_hidden is not None):
            raise ValueError("top_k, shared_experts, dense_layers, moe_every and the expert "
                             "widths describe MoE layers: set experts (the routed experts per "
                             "layer) too, or leave them out for a dense model")
        return
    if not 1 <= model.top_k <= model.experts:
        raise ValueError(f"top_k={model.top_k}: each token goes to 1 to experts="
                         f"{model.experts} routed experts; set top_k in that range")
    if moe_layers_of(model, model.layers) == 0:
        raise ValueError(f"dense_layers={model.dense_layers} with moe_every={every} leaves no MoE "
                         f"layer of layers={model.layers}; use fewer dense layers or experts=0")
    for name, default in (("expert_ffn_hidden", model.ffn_hidden),
                          ("shared_ffn_hidden", model.expert_ffn_hidden or model.ffn_hidden)):
        if getattr(model, name) is None:
            object.__setattr__(model, name, default)
        value = getattr(model, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
