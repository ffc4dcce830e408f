"""Checks for the memory lab: parameter counts, model-state bytes, activations, ZeRO.

References are labsim's own ``Transformer``, ``bytes_per_param``, ``activation_per_layer``
and ``training_memory``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labsim.checks._core import Case, close, raises, run_check
from labsim.memory import activation_per_layer, bytes_per_param, training_memory
from labsim.workload import Transformer


def gpt_params(fn: Callable[[int, int, int, int], Any]) -> None:
    """``fn(layers, hidden, vocab, seq_len)`` = exact parameters of a GPT-2-style model
    (learned positions, LayerNorm, biases, 4h MLP, tied output layer)."""
    specs = [(12, 768, 50257, 1024), (1, 8, 10, 4), (2, 64, 100, 32), (24, 1024, 50257, 1024),
             (96, 12288, 50257, 2048), (4, 256, 8192, 256)]
    cases = []
    for layers, hidden, vocab, seq_len in specs:
        model = Transformer(layers, hidden, max(1, hidden // 64), seq_len, vocab,
                            tied_embeddings=True)
        cases.append(Case(f"layers={layers}, hidden={hidden}, vocab={vocab}, seq_len={seq_len}",
                          (layers, hidden, vocab, seq_len), expected=model.params))
    run_check("gpt_params", fn, cases, compare=close(rtol=0))


def model_state_bytes(fn: Callable[[float, str, str], Any]) -> None:
    """``fn(n_params, precision, optimizer)`` = (weight, gradient, optimizer) bytes, for
    precision "fp32" or "mixed" and optimizer "adam", "sgd" or "sgd-momentum"."""
    specs = [(1, "fp32", "adam"), (1, "mixed", "adam"), (7e9, "fp32", "adam"),
             (7.5e9, "mixed", "adam"), (1000, "fp32", "sgd"), (1000, "mixed", "sgd"),
             (10, "fp32", "sgd-momentum"), (10, "mixed", "sgd-momentum"), (0, "mixed", "adam")]
    cases = [
        Case(f"n={n:g}, {p}, {o}", (n, p, o),
             expected=tuple(n * b for b in bytes_per_param(p, o)))
        for n, p, o in specs
    ]
    run_check("model_state_bytes", fn, cases, compare=close(rtol=1e-12))


def layer_activation_bytes(fn: Callable[..., Any]) -> None:
    """``fn(s, b, h, a, d=2, m=1)`` = bytes one GPT layer saves for backward (Korthikanti et
    al. 2022): values of d bytes, dropout masks of m bytes."""
    specs = [(2048, 1, 12288, 96, 2, 1), (1024, 8, 768, 12, 2, 1), (64, 3, 128, 4, 4, 4),
             (256, 2, 256, 4, 4, 1), (128, 1, 64, 2, 2, 0), (1, 1, 8, 1, 2, 1)]
    cases = []
    for s, b, h, a, d, m in specs:
        model = Transformer(1, h, a, s, 8)
        expected = activation_per_layer(model, micro_batch=b, dtype_bytes=d, mask_bytes=m)
        cases.append(Case(f"s={s}, b={b}, h={h}, a={a}, d={d}, m={m}", (s, b, h, a),
                          {"d": d, "m": m}, expected=expected))
    run_check("layer_activation_bytes", fn, cases, compare=close(rtol=1e-9))


def zero_model_state_bytes(fn: Callable[[float, int, int], Any]) -> None:
    """``fn(n_params, stage, dp)`` = model-state bytes per GPU with mixed-precision Adam under
    ZeRO ``stage`` over ``dp`` ranks (Rajbhandari et al. 2020); stage outside 0..3 raises
    ValueError."""
    specs = [(7.5e9, 0, 64), (7.5e9, 1, 64), (7.5e9, 2, 64), (7.5e9, 3, 64), (1e9, 3, 1),
             (1e9, 2, 8), (175e9, 3, 1024)]
    cases = [
        Case(f"n={n:g}, stage {s}, dp={dp}", (n, s, dp),
             expected=training_memory(n, zero_stage=s, dp=dp).model_states)
        for n, s, dp in specs
    ]
    cases.append(Case("stage 4 raises ValueError", (1e9, 4, 8), compare=raises(ValueError)))
    run_check("zero_model_state_bytes", fn, cases, compare=close(rtol=1e-9))
