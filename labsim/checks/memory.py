"""Checks for the memory lab: counting a model's parameters by walking it, measuring what a
training recipe keeps, the activations of a layer (predicted, then measured with the
learner's own meter) and what is alive through two training steps.

Every check runs the learner's function on models and recipes built here, on inputs the lab
does not show: the walk on the ``meta`` device (a 70B model costs nothing there), the recipes
with optimizers the lab does not use, the meter on layers of shapes it has not seen.
Expected values come from labsim's closed forms (``Transformer``, ``activation_per_layer``),
from the reference walk ``held_bytes`` or from ``labsim.lab.MemoryMeter``, always computed in
the grader's process; the learner's code may call none of them (tripwired, withheld when
grading).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from labsim.checks._core import Case, Outcome, Spec, close, plain_outcome, raises
from labsim.checks._observe import watch
from labsim.memory import activation_per_layer
from labsim.workload import Transformer

FORMULAS = ("labsim.memory:*", "labsim.workload:*", "labsim.precision:*")
METERS = ("labsim.lab.memory:*",)
_GPT = "labsim.workload:Transformer"  # the drivers build GPTs in the learner's process


# -- 1. counting parameters by walking a model ----------------------------------------------

def expected_breakdown(cfg: Transformer) -> dict[str, int]:
    """Parameters of ``labsim.lab.GPT(cfg)`` by ``"<module class>.<parameter>"``, from the
    config's shapes alone (the oracle: it never looks at a built model).  A tied output
    layer is the word embedding, met first as an ``Embedding``."""
    layers, h, kv, f, m = cfg.layers, cfg.hidden, cfg.kv_dim, cfg.ffn_hidden, cfg.mlp_matrices
    out = {"Embedding.weight": cfg.embedding_params,
           "Linear.weight": layers * (h * (h + 2 * kv) + h * h + m * h * f)
           + (0 if cfg.tied_embeddings else cfg.vocab * h)}
    if cfg.bias:  # QKV, output projection, MLP up (2f wide for SwiGLU), MLP down
        out["Linear.bias"] = layers * ((h + 2 * kv) + h + (m - 1) * f + h)
    norms = 2 * layers + 1
    if cfg.norm == "layernorm":
        out["LayerNorm.weight"] = out["LayerNorm.bias"] = norms * h
    else:
        out["RMSNorm.weight"] = norms * h
    return out


class Gated(nn.Module):
    """A module with a parameter of its own beside its children (``gain``): a walk that
    looks only at leaf modules misses it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.inner = nn.Linear(width, width, bias=False)
        self.norm = nn.LayerNorm(width)


def _tied_head_first(vocab: int, width: int) -> nn.Module:
    """An output layer registered before the embedding it shares its weight with."""
    head = nn.Linear(width, vocab)
    embed = nn.Embedding(vocab, width)
    embed.weight = head.weight
    return nn.Sequential(head, nn.ReLU(), embed)


def _tied_embedding_first(vocab: int, width: int) -> nn.Module:
    embed = nn.Embedding(vocab, width)
    head = nn.Linear(width, vocab, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, nn.Linear(width, width), nn.LayerNorm(width), head)


_SMALL_MODELS: dict[str, tuple[Callable[[], nn.Module], dict[str, int]]] = {
    "an output layer registered before the embedding it shares its weight with": (
        lambda: _tied_head_first(50, 12),
        {"Linear.weight": 600, "Linear.bias": 50}),
    "an embedding tied to an output layer, with a LayerNorm between": (
        lambda: _tied_embedding_first(40, 16),
        {"Embedding.weight": 640, "Linear.weight": 256, "Linear.bias": 16,
         "LayerNorm.weight": 16, "LayerNorm.bias": 16}),
    "a module with a parameter of its own (Gated.gain) beside its children": (
        lambda: Gated(24),
        {"Gated.gain": 24, "Linear.weight": 576, "LayerNorm.weight": 24,
         "LayerNorm.bias": 24}),
}

_GPT_CASES: dict[str, dict[str, Any]] = {
    "GPT-2 small (preset gpt2-124m): tied output layer, learned positions, biases": {
        "preset": "gpt2-124m"},
    "LLaMA-2 70B (preset llama2-70b): SwiGLU, grouped-query attention (8 KV heads), RMSNorm, "
    "no biases, untied output layer": {"preset": "llama2-70b"},
    "a GPT with untied output layer, no biases, learned positions, LayerNorm": {
        "layers": 3, "hidden": 96, "heads": 6, "seq_len": 40, "vocab": 500,
        "tied_embeddings": False, "bias": False},
    "a SwiGLU GPT with biases, grouped-query attention and RMSNorm": {
        "layers": 2, "hidden": 64, "heads": 8, "kv_heads": 2, "seq_len": 16, "vocab": 300,
        "ffn_hidden": 176, "swiglu": True, "norm": "rmsnorm", "tied_embeddings": True},
}


def _config(desc: Mapping[str, Any]) -> Transformer:
    if "preset" in desc:
        return Transformer.preset(str(desc["preset"]))
    return Transformer(**{"tied_embeddings": True, **dict(desc)})


def _meta_model(desc: Mapping[str, Any]) -> nn.Module:
    """The model a breakdown case describes, built on the meta device (shapes, no data)."""
    from labsim.lab.models import GPT

    with torch.device("meta"):
        if "small" in desc:
            return _SMALL_MODELS[str(desc["small"])][0]()
        return GPT(_config(desc))


def _param_breakdown_cases() -> list[Case]:
    cases = [Case(name, ({"small": name},), expected=dict(expected))
             for name, (_, expected) in _SMALL_MODELS.items()]
    cases += [Case(name, (desc,), expected=expected_breakdown(_config(desc)))
              for name, desc in _GPT_CASES.items()]
    return cases


def _drive_on_models(build: Callable[[Any], tuple]) -> Callable[..., list[Outcome]]:
    """A driver that builds each case's inputs with ``build(case.args[0])`` outside the
    watch, then calls the learner's function on them under it."""

    def drive(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
              ) -> list[Outcome]:
        outcomes = []
        for case in cases:
            args = build(case.args[0])
            with watch(spec.forbid, ops=False, processes=spec.processes) as seen:
                try:
                    value = fns[0](*args)
                except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                    error: BaseException | None = exc
                else:
                    error = None
            del args
            outcomes.append(Outcome.of_error(error, seen.summary()) if error is not None
                            else plain_outcome(value, seen.summary()))
        return outcomes

    return drive


param_breakdown = Spec(
    "param_breakdown", _param_breakdown_cases,
    drive=_drive_on_models(lambda desc: (_meta_model(desc),)), compare=close(rtol=0),
    forbid=(*FORMULAS, "labsim.checks.memory:expected_breakdown"), gives=(_GPT,))
"""``fn(model) -> {"<module class>.<parameter name>": count}``: every parameter of
``model`` counted once (a tied weight under the first module that holds it, in
``model.modules()`` order), on models built on the meta device."""


# -- 2. what a training recipe keeps, measured -----------------------------------------------

def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The reference walk: bytes of the model's parameters, of their ``.grad``, and of
    everything else the optimizer holds (its ``state`` tensors, and the tensors it updates
    that are not the model's parameters -- fp32 master copies -- with their ``.grad``).
    Each tensor is counted once, by identity."""
    params = {id(p): p for p in model.parameters()}
    held: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in params:
                held[id(p)] = p
                if p.grad is not None:
                    held[id(p.grad)] = p.grad
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                held[id(value)] = value

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    return {"weights": nbytes(params.values()),
            "gradients": nbytes(p.grad for p in params.values() if p.grad is not None),
            "optimizer": nbytes(held.values())}


_RECIPE_MODEL = {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 96}
_UNTIED = {**_RECIPE_MODEL, "tied_embeddings": False, "swiglu": True, "ffn_hidden": 80,
           "bias": False, "norm": "rmsnorm"}
_RECIPES: dict[str, dict[str, Any]] = {
    "fp32 Adam, tied output layer": {"precision": "fp32", "optimizer": "adam"},
    "fp32 SGD without momentum": {"precision": "fp32", "optimizer": "sgd"},
    "fp32 SGD with momentum": {"precision": "fp32", "optimizer": "sgd-momentum"},
    "fp32 Adam with amsgrad=True": {"precision": "fp32", "optimizer": "adam-amsgrad"},
    "fp32 Adagrad": {"precision": "fp32", "optimizer": "adagrad"},
    "bf16 weights and gradients, fp32 master copies in the optimizer, Adam": {
        "precision": "mixed-bf16", "optimizer": "adam"},
    "bf16 everything, AdamW": {"precision": "pure-bf16", "optimizer": "adamw"},
    "torch.autocast (bf16) forward, fp32 weights, Adam": {
        "precision": "autocast-bf16", "optimizer": "adam"},
    "fp32 Adam, gradients set to None after the step": {
        "precision": "fp32", "optimizer": "adam", "zero_grad": True},
    "fp32 Adam, untied SwiGLU model, word embedding frozen": {
        "model": _UNTIED, "precision": "fp32", "optimizer": "adam", "freeze": ["wte"]},
    "bf16 master-copy recipe with SGD momentum, untied model, word embedding frozen": {
        "model": _UNTIED, "precision": "mixed-bf16", "optimizer": "sgd-momentum",
        "freeze": ["wte"]},
}


def _recipe(desc: Mapping[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
    from labsim.experiments.memory import recipe_step

    return recipe_step(desc.get("model", _RECIPE_MODEL), desc["precision"], desc["optimizer"],
                       zero_grad=bool(desc.get("zero_grad", False)),
                       freeze=tuple(desc.get("freeze", ())))


def _model_state_bytes_cases() -> list[Case]:
    return [Case(name, (desc,), expected=held_bytes(*_recipe(desc)))
            for name, desc in _RECIPES.items()]


model_state_bytes = Spec(
    "model_state_bytes", _model_state_bytes_cases, drive=_drive_on_models(_recipe),
    compare=close(rtol=0),
    forbid=(*FORMULAS, *METERS, "labsim.checks.memory:held_bytes"),
    gives=(_GPT, "labsim.experiments.memory:recipe_step"))
"""``fn(model, optimizer) -> {"weights", "gradients", "optimizer"}`` in bytes, read from the
tensors after one training step of recipes the lab does not run (amsgrad, Adagrad, AdamW,
frozen parameters, fp32 master copies kept by the optimizer)."""


# -- 3. one layer's activations: predicted ------------------------------------------------

def _layer_activation_bytes_cases() -> list[Case]:
    # (s, b, h, a, d, m): shapes no paper tabulates; m = 0 is a layer trained without dropout
    specs = [(96, 3, 80, 5, 2, 1), (200, 1, 48, 3, 4, 4), (40, 7, 24, 6, 2, 1),
             (1, 1, 8, 1, 2, 1), (300, 5, 120, 10, 2, 2), (40, 7, 24, 6, 2, 0),
             (512, 2, 96, 12, 4, 0), (33, 2, 56, 7, 1, 1)]
    cases = []
    for s, b, h, a, d, m in specs:
        model = Transformer(1, h, a, s, 8, dropout=m > 0)
        expected = activation_per_layer(model, micro_batch=b, dtype_bytes=d, mask_bytes=m)
        cases.append(Case(f"s={s}, b={b}, h={h}, a={a}, d={d}, m={m}", (s, b, h, a),
                          {"d": d, "m": m}, expected=expected))
    return cases


layer_activation_bytes = Spec("layer_activation_bytes", _layer_activation_bytes_cases,
                              compare=close(rtol=1e-9), forbid=FORMULAS)
"""``fn(s, b, h, a, d=2, m=1)`` = bytes one GPT layer saves for backward (the count of
Korthikanti et al. 2022, Sec. 4.1, for values of d bytes and dropout masks of m bytes); m = 0
is a layer trained without dropout, whose attention keeps the softmax output once."""


# -- 4. one layer's activations: measured with the learner's meter ---------------------------

_METER_CASES: dict[str, dict[str, Any]] = {
    "a GPT-2 layer (s=20, b=3, h=48, a=3) training with dropout 0.1": {
        "block": {"layers": 1, "hidden": 48, "heads": 3, "seq_len": 20, "vocab": 8},
        "dropout": 0.1, "batch": 3},
    "the same layer in eval mode (no dropout)": {
        "block": {"layers": 1, "hidden": 48, "heads": 3, "seq_len": 20, "vocab": 8},
        "dropout": 0.1, "eval": True, "batch": 3},
    "a LLaMA-style layer: rotary positions, grouped-query attention (4 heads, 2 K/V heads), "
    "SwiGLU, RMSNorm": {
        "block": {"layers": 1, "hidden": 32, "heads": 4, "kv_heads": 2, "seq_len": 12,
                  "vocab": 8, "swiglu": True, "ffn_hidden": 88, "bias": False,
                  "norm": "rmsnorm", "positions": "rotary", "dropout": False}, "batch": 2},
    "a whole GPT with its loss (token ids in, cross-entropy out)": {
        "gpt": {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 80},
        "batch": 2},
    "a linear layer whose input needs no gradient": {"linear": [24, 40], "batch": 5},
    "an MLP whose ReLU output serves two backward functions": {"mlp": [16, 64], "batch": 6},
    "a classifier that keeps a slice of a larger tensor (each sequence's last token)": {
        "last_token": [24, 5, 30], "batch": 4},
    "a layer whose parameters are frozen, input needing no gradient: nothing is saved": {
        "block": {"layers": 1, "hidden": 16, "heads": 2, "seq_len": 8, "vocab": 8},
        "frozen": True, "batch": 2},
}


class LastToken(nn.Module):
    """A sequence classifier that reads each sequence's last token: its head keeps a slice
    ``h[:, -1]`` whose storage is all of ``h``."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        h = torch.nn.functional.gelu(self.body(x))
        return self.head(h[:, -1])


def _meter_case(desc: Mapping[str, Any]) -> tuple[Any, ...]:
    """``(module, *inputs)`` of a meter case, built the same way in every process."""
    from labsim.lab.datasets import random_batch
    from labsim.lab.models import GPT, Block

    torch.manual_seed(11)
    b = int(desc["batch"])
    if "linear" in desc:
        n_in, n_out = desc["linear"]
        return nn.Linear(n_in, n_out), torch.randn(b, n_in)
    if "last_token" in desc:
        width, classes, t = desc["last_token"]
        return LastToken(width, classes), torch.randn(b, t, width)
    if "mlp" in desc:
        width, hidden = desc["mlp"]
        mlp = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
        return mlp, torch.randn(b, width, requires_grad=True)
    if "gpt" in desc:
        cfg = Transformer(**{"tied_embeddings": True, **desc["gpt"]})
        return (GPT(cfg), *random_batch(cfg, batch=b, seed=3))
    cfg = Transformer(**desc["block"])
    block = Block(cfg, dropout=float(desc.get("dropout", 0.0)))
    block.train(not desc.get("eval", False))
    frozen = bool(desc.get("frozen", False))
    block.requires_grad_(not frozen)
    x = torch.randn(b, cfg.seq_len, cfg.hidden, requires_grad=not frozen)
    if cfg.positions == "rotary":  # the cos and sin tables the GPT hands its blocks
        return block, x, GPT(cfg).rope(cfg.seq_len, x.device, x.dtype)
    return block, x


def _reference_saved_bytes(desc: Mapping[str, Any]) -> int:
    from labsim.lab.memory import MemoryMeter

    module, *inputs = _meter_case(desc)
    with MemoryMeter(module) as meter:
        out = module(*inputs)
    del out
    return meter.saved_bytes


def _saved_bytes_cases() -> list[Case]:
    return [Case(name, (desc,), expected=_reference_saved_bytes(desc))
            for name, desc in _METER_CASES.items()]


saved_bytes = Spec("saved_bytes", _saved_bytes_cases, drive=_drive_on_models(_meter_case),
                   compare=close(rtol=0), forbid=METERS, gives=(_GPT,))
"""``fn(module, *inputs) -> int``: bytes of the storages autograd keeps for backward while
``module(*inputs)`` runs, each storage once, the module's parameters left out; judged
against ``labsim.lab.MemoryMeter`` on layers and models the lab does not measure."""


# -- 5. what is alive during two training steps, judged against a measurement -------------

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
                        forbid=(*FORMULAS, "labsim.experiments.memory:*"))
"""``fn(n_params, activation_bytes, optimizer, set_to_none) -> [6 byte counts]``: the bytes
alive (created since training began) after forward 1, backward 1, step 1, forward 2,
backward 2 and step 2 of fp32 training with ``optimizer`` ("adam", "sgd", "sgd-momentum";
anything else raises ValueError) and ``zero_grad(set_to_none=...)`` before each step, where
``activation_bytes`` is what the first forward leaves alive.  Judged against
``labsim.experiments.memory.step_timeline`` measured on GPTs the learner has not seen."""
