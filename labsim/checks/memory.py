"""Checks for the memory lab: parameter counts, model-state bytes, activations, ZeRO.

References are labsim's own ``Transformer``, ``bytes_per_param``, ``activation_per_layer``
and ``training_memory``; the learner's functions must not call them (tripwired).
"""

from __future__ import annotations

from labsim.checks._core import Case, Spec, close, raises
from labsim.memory import activation_per_layer, bytes_per_param, training_memory
from labsim.workload import Transformer

FORBID = ("labsim.memory:*", "labsim.workload:*", "labsim.precision:*")


def _gpt_params_cases() -> list[Case]:
    specs = [(12, 768, 50257, 1024), (1, 8, 10, 4), (2, 64, 100, 32), (24, 1024, 50257, 1024),
             (96, 12288, 50257, 2048), (4, 256, 8192, 256)]
    cases = []
    for layers, hidden, vocab, seq_len in specs:
        model = Transformer(layers, hidden, max(1, hidden // 64), seq_len, vocab,
                            tied_embeddings=True)
        cases.append(Case(f"layers={layers}, hidden={hidden}, vocab={vocab}, seq_len={seq_len}",
                          (layers, hidden, vocab, seq_len), expected=model.params))
    return cases


gpt_params = Spec("gpt_params", _gpt_params_cases, compare=close(rtol=0), forbid=FORBID)
"""``fn(layers, hidden, vocab, seq_len)`` = exact parameters of a GPT-2-style model
(learned positions, LayerNorm, biases, 4h MLP, tied output layer)."""


def _model_state_bytes_cases() -> list[Case]:
    specs = [(1, "fp32", "adam"), (1, "mixed", "adam"), (7e9, "fp32", "adam"),
             (7.5e9, "mixed", "adam"), (1000, "fp32", "sgd"), (1000, "mixed", "sgd"),
             (10, "fp32", "sgd-momentum"), (10, "mixed", "sgd-momentum"), (0, "mixed", "adam")]
    return [Case(f"n={n:g}, {p}, {o}", (n, p, o),
                 expected=tuple(n * b for b in bytes_per_param(p, o)))
            for n, p, o in specs]


model_state_bytes = Spec("model_state_bytes", _model_state_bytes_cases,
                         compare=close(rtol=1e-12), forbid=FORBID)
"""``fn(n_params, precision, optimizer)`` = (weight, gradient, optimizer) bytes, for
precision "fp32" or "mixed" and optimizer "adam", "sgd" or "sgd-momentum"."""


def _layer_activation_bytes_cases() -> list[Case]:
    specs = [(2048, 1, 12288, 96, 2, 1), (1024, 8, 768, 12, 2, 1), (64, 3, 128, 4, 4, 4),
             (256, 2, 256, 4, 4, 1), (128, 1, 64, 2, 2, 0), (1, 1, 8, 1, 2, 1),
             (2048, 1, 4096, 32, 4, 0), (64, 3, 128, 4, 4, 0)]
    cases = []
    for s, b, h, a, d, m in specs:
        model = Transformer(1, h, a, s, 8, dropout=m > 0)  # m = 0: trained without dropout
        expected = activation_per_layer(model, micro_batch=b, dtype_bytes=d, mask_bytes=m)
        cases.append(Case(f"s={s}, b={b}, h={h}, a={a}, d={d}, m={m}", (s, b, h, a),
                          {"d": d, "m": m}, expected=expected))
    return cases


layer_activation_bytes = Spec("layer_activation_bytes", _layer_activation_bytes_cases,
                              compare=close(rtol=1e-9), forbid=FORBID)
"""``fn(s, b, h, a, d=2, m=1)`` = bytes one GPT layer saves for backward (Korthikanti et
al. 2022): values of d bytes, dropout masks of m bytes; m = 0 is a layer trained without
dropout, whose attention keeps the softmax output once (no mask, no separate dropout output).
"""


def _zero_model_state_bytes_cases() -> list[Case]:
    specs = [(7.5e9, 0, 64), (7.5e9, 1, 64), (7.5e9, 2, 64), (7.5e9, 3, 64), (1e9, 3, 1),
             (1e9, 2, 8), (175e9, 3, 1024)]
    cases = [Case(f"n={n:g}, stage {s}, dp={dp}", (n, s, dp),
                  expected=training_memory(n, zero_stage=s, dp=dp).model_states)
             for n, s, dp in specs]
    cases.append(Case("stage 4 raises ValueError", (1e9, 4, 8), compare=raises(ValueError)))
    return cases


zero_model_state_bytes = Spec("zero_model_state_bytes", _zero_model_state_bytes_cases,
                              compare=close(rtol=1e-9), forbid=FORBID)
"""``fn(n_params, stage, dp)`` = model-state bytes per GPU with mixed-precision Adam under
ZeRO ``stage`` over ``dp`` ranks (Rajbhandari et al. 2020); stage outside 0..3 raises
ValueError."""


# -- what is alive during two training steps, judged against a measurement -----------------

def _predict_timeline_cases() -> list[Case]:
    from labsim.experiments.memory import step_timeline

    tiny = {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64, "batch": 1}
    mid = {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 32, "vocab": 256, "batch": 2}
    wide = {"layers": 1, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 512, "batch": 3}
    specs = [(mid, "adam", True), (mid, "adam", False), (tiny, "sgd-momentum", True),
             (wide, "sgd", True), (wide, "adam", True), (tiny, "sgd-momentum", False),
             (mid, "sgd", False)]
    cases = []
    for config, optimizer, set_to_none in specs:
        run = step_timeline(config, optimizer, set_to_none)
        cases.append(Case(
            f"GPT l={config['layers']} h={config['hidden']} s={config['seq_len']} "
            f"b={config['batch']} ({run.n_params:,} parameters, {run.activation_bytes:,} B "
            f"after the forward), {optimizer}, set_to_none={set_to_none}",
            (run.n_params, run.activation_bytes, optimizer, set_to_none),
            expected=list(run.after)))
    cases.append(Case("an unknown optimizer raises ValueError", (1000, 4000, "lion", True),
                      compare=raises(ValueError)))
    return cases


predict_timeline = Spec("predict_timeline", _predict_timeline_cases, compare=close(rtol=0),
                        forbid=(*FORBID, "labsim.experiments.memory:*"))
"""``fn(n_params, activation_bytes, optimizer, set_to_none) -> [6 byte counts]``: the bytes
alive (created since training began) after forward 1, backward 1, step 1, forward 2,
backward 2 and step 2 of fp32 training with ``optimizer`` ("adam", "sgd", "sgd-momentum";
anything else raises ValueError) and ``zero_grad(set_to_none=...)`` before each step, where
``activation_bytes`` is what the first forward leaves alive.  Judged against
``labsim.experiments.memory.step_timeline`` measured on GPTs the learner has not seen."""
