"""Memory checks: the lab's solutions and honest variants pass; every shortcut fails.

Each cheat is a way to skip the skill an exercise teaches (reading the model and the
optimizer, measuring what autograd keeps): a closed form instead of the walk, a table instead
of the tensors, a meter that double counts or counts what was not kept, labsim's own answer.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from labsim.checks import CheckFailed
from labsim.checks import memory as check
from labsim.checks.memory import held_bytes
from labsim.experiments.memory import recipe_step

from .solution_cells import exercises

REFERENCE = "calls labsim's own reference"
LAB = exercises("01_memory")


def _stub(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    raise NotImplementedError


def _passes(name: str, fn, capsys: pytest.CaptureFixture) -> None:  # noqa: ANN001
    getattr(check, name)(fn)
    assert capsys.readouterr().out.startswith(f"PASS {name}: ")


@pytest.mark.parametrize("name", ["param_breakdown", "model_state_bytes",
                                  "layer_activation_bytes", "saved_bytes"])
def test_the_solution_passes_and_the_stub_is_not_done(name: str,
                                                      capsys: pytest.CaptureFixture) -> None:
    _passes(name, LAB[name], capsys)
    with pytest.raises(CheckFailed, match="not implemented"):
        getattr(check, name)(_stub)


# -- param_breakdown --------------------------------------------------------------------------

def _by_named_parameters(model):  # noqa: ANN001, ANN202
    """Honest: named_parameters() drops duplicates itself; the owner is looked up by name."""
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        key = f"{type(model.get_submodule(owner)).__name__}.{attr}"
        counts[key] = counts.get(key, 0) + p.numel()
    return counts


def test_a_walk_through_named_parameters_passes(capsys: pytest.CaptureFixture) -> None:
    _passes("param_breakdown", _by_named_parameters, capsys)


def _walk(model, *, dedupe, leaves_only=False):  # noqa: ANN001, ANN202
    counts: dict[str, int] = {}
    seen: set = set()
    for module in model.modules():
        if leaves_only and any(True for _ in module.children()):
            continue
        for name, p in module.named_parameters(recurse=False):
            key = dedupe(p)
            if key is not None and key in seen:
                continue
            seen.add(key)
            kind = f"{type(module).__name__}.{name}"
            counts[kind] = counts.get(kind, 0) + p.numel()
    return counts


def _state_dict(model):  # noqa: ANN001, ANN202
    counts: dict[str, int] = {}
    for name, t in model.state_dict().items():
        owner, _, attr = name.rpartition(".")
        key = f"{type(model.get_submodule(owner)).__name__}.{attr}"
        counts[key] = counts.get(key, 0) + t.numel()
    return counts


def _closed_form(model):  # noqa: ANN001, ANN202
    from labsim.checks.memory import expected_breakdown

    return expected_breakdown(model.cfg)


@pytest.mark.parametrize(("cheat", "why"), [
    (lambda m: {"parameters": sum(p.numel() for p in m.parameters())}, "keys"),
    (_state_dict, "tied|Linear.weight|Embedding.weight"),
    (lambda m: _walk(m, dedupe=lambda p: p.untyped_storage().data_ptr()), "instead of"),
    (lambda m: _walk(m, dedupe=lambda p: None), "instead of"),
    (lambda m: _walk(m, dedupe=id, leaves_only=True), "Gated.gain|keys"),
    (_closed_form, REFERENCE),
    (lambda m: {"Linear.weight": m.cfg.params}, REFERENCE),
], ids=["total-only", "state-dict-double-counts-tied", "data-ptr-on-meta", "no-dedupe",
        "leaf-modules-only", "closed-form-oracle", "labsim-config"])
def test_param_breakdown_shortcuts_fail(cheat, why: str) -> None:  # noqa: ANN001
    with pytest.raises(CheckFailed, match=why):
        check.param_breakdown(cheat)


# -- model_state_bytes ------------------------------------------------------------------------

def _by_storage(model, optimizer):  # noqa: ANN001, ANN202
    """Honest: every tensor keyed by its storage's address instead of its identity."""
    def key(t):  # noqa: ANN001, ANN202
        return t.untyped_storage().data_ptr()

    def total(tensors):  # noqa: ANN001, ANN202
        return sum(t.untyped_storage().nbytes() for t in {key(t): t for t in tensors}.values())

    params = list(model.parameters())
    mine = {key(p) for p in params}
    extra = [p for g in optimizer.param_groups for p in g["params"] if key(p) not in mine]
    extra += [p.grad for p in extra if p.grad is not None]
    extra += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"weights": total(params),
            "gradients": total(p.grad for p in params if p.grad is not None),
            "optimizer": total(extra)}


def test_a_walk_by_storage_passes(capsys: pytest.CaptureFixture) -> None:
    _passes("model_state_bytes", _by_storage, capsys)


def _table(model, optimizer):  # noqa: ANN001, ANN202
    """The bytes-per-parameter table instead of the tensors."""
    n = sum(p.numel() for p in model.parameters())
    size = next(model.parameters()).element_size()
    per = {"Adam": 8, "AdamW": 8, "SGD": 4, "Adagrad": 4}[type(optimizer).__name__]
    return {"weights": size * n, "gradients": size * n, "optimizer": per * n}


def _state_only(model, optimizer):  # noqa: ANN001, ANN202
    """Reads optimizer.state and nothing else: misses fp32 master copies."""
    out = LAB["model_state_bytes"](model, optimizer)
    out["optimizer"] = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                           for v in s.values() if torch.is_tensor(v))
    return out


def _every_gradient(model, optimizer):  # noqa: ANN001, ANN202
    """A gradient assumed for every parameter, like the weights."""
    out = LAB["model_state_bytes"](model, optimizer)
    out["gradients"] = out["weights"]
    return out


def _library_meters(model, optimizer):  # noqa: ANN001, ANN202
    from labsim.lab.memory import grad_bytes, optimizer_state_bytes, param_bytes

    return {"weights": param_bytes(model), "gradients": grad_bytes(model),
            "optimizer": optimizer_state_bytes(optimizer)}


@pytest.mark.parametrize(("cheat", "why"), [
    (_table, "instead of"),
    (_state_only, "master"),
    (_every_gradient, "None|frozen"),
    (_library_meters, REFERENCE),
    (held_bytes, REFERENCE),
], ids=["bytes-per-parameter-table", "optimizer-state-only", "a-gradient-for-everything",
        "labsim-meters", "reference-walk"])
def test_model_state_bytes_shortcuts_fail(cheat, why: str) -> None:  # noqa: ANN001
    with pytest.raises(CheckFailed, match=why):
        check.model_state_bytes(cheat)


@pytest.mark.parametrize(("precision", "optimizer", "per_param", "buffers"), [
    ("fp32", "adam", (4, 4, 8), 1), ("fp32", "adam-amsgrad", (4, 4, 12), 1),
    ("fp32", "adagrad", (4, 4, 4), 1), ("fp32", "sgd", (4, 4, 0), 0),
    ("fp32", "sgd-momentum", (4, 4, 4), 0), ("autocast-bf16", "adam", (4, 4, 8), 1),
    ("mixed-bf16", "adam", (2, 2, 12), 1), ("mixed-bf16", "sgd-momentum", (2, 2, 8), 0),
    ("pure-bf16", "adamw", (2, 2, 4), 1),
])
def test_the_reference_walk_is_each_recipes_bytes_per_parameter(
        precision: str, optimizer: str, per_param: tuple[int, int, int], buffers: int) -> None:
    """The oracle of ``model_state_bytes`` against what each recipe is defined to keep:
    bytes per parameter, plus one fp32 ``step`` scalar per tensor for Adam and Adagrad."""
    model, opt = recipe_step({"layers": 1, "hidden": 16, "heads": 2, "seq_len": 8, "vocab": 24},
                             precision, optimizer)
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    w, g, o = per_param
    assert held_bytes(model, opt) == {"weights": w * n, "gradients": g * n,
                                      "optimizer": o * n + 4 * tensors * buffers}


def test_frozen_and_released_gradients_leave_no_bytes() -> None:
    cfg = {"layers": 1, "hidden": 16, "heads": 2, "seq_len": 8, "vocab": 24,
           "tied_embeddings": False}
    model, opt = recipe_step(cfg, "fp32", "adam", freeze=("wte",))
    frozen = model.wte.weight.numel()
    n = sum(p.numel() for p in model.parameters())
    held = held_bytes(model, opt)
    assert held["gradients"] == 4 * (n - frozen)
    assert held["optimizer"] == 8 * (n - frozen) + 4 * (len(list(model.parameters())) - 1)
    model, opt = recipe_step(cfg, "fp32", "adam", zero_grad=True)
    assert held_bytes(model, opt)["gradients"] == 0


# -- layer_activation_bytes -------------------------------------------------------------------

def _tensor_by_tensor(s, b, h, a, d=2, m=1):  # noqa: ANN001, ANN202
    """Honest: the layer's kept tensors listed one by one, as the lab asks."""
    sbh, ass = s * b * h, a * s * s * b
    values = {"ln1 input": sbh, "QKV input": sbh, "Q, K, V": 3 * sbh, "projection input": sbh,
              "ln2 input": sbh, "MLP input": sbh, "4h matmul output": 4 * sbh,
              "GeLU output": 4 * sbh}
    scores = {"softmax output": ass} if m == 0 else {"softmax output": ass,
                                                      "dropout output": ass}
    masks = {} if m == 0 else {"softmax mask": ass, "projection mask": sbh, "MLP mask": sbh}
    return d * (sum(values.values()) + sum(scores.values())) + m * sum(masks.values())


def test_a_tensor_by_tensor_count_passes(capsys: pytest.CaptureFixture) -> None:
    _passes("layer_activation_bytes", _tensor_by_tensor, capsys)


def _activation_library(s, b, h, a, d=2, m=1):  # noqa: ANN001, ANN202
    import labsim

    model = labsim.Transformer(1, h, a, s, 8, dropout=m > 0)
    return labsim.memory.activation_per_layer(model, micro_batch=b, dtype_bytes=d, mask_bytes=m)


@pytest.mark.parametrize(("cheat", "why"), [
    (lambda s, b, h, a, d=2, m=1: s * b * h * 34, "instead of"),
    (lambda s, b, h, a, d=2, m=1: s * b * h * (34 + 5 * a * s / h), "d=4|d=1"),
    (_activation_library, REFERENCE),
], ids=["no-attention", "korthikanti-16-bit-only", "labsim-formula"])
def test_layer_activation_shortcuts_fail(cheat, why: str) -> None:  # noqa: ANN001
    with pytest.raises(CheckFailed, match=why):
        check.layer_activation_bytes(cheat)


# -- saved_bytes ------------------------------------------------------------------------------

def _meter(module, inputs, key, exclude_params=True, dedupe=True):  # noqa: ANN001, ANN202
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict = {}
    count: list[int] = []

    def pack(t):  # noqa: ANN001, ANN202
        if exclude_params and t.untyped_storage().data_ptr() in params:
            return t
        k, nbytes = key(t)
        if dedupe:
            kept[k] = nbytes
        else:
            count.append(nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    del out
    return sum(kept.values()) + sum(count)


def _by_device_and_address(module, *inputs):  # noqa: ANN001, ANN202
    """Honest: storages keyed by (device, address)."""
    return _meter(module, inputs, lambda t: ((t.device, t.untyped_storage().data_ptr()),
                                             t.untyped_storage().nbytes()))


def test_a_meter_keyed_by_device_and_address_passes(capsys: pytest.CaptureFixture) -> None:
    _passes("saved_bytes", _by_device_and_address, capsys)


def _params_by_identity(module, *inputs):  # noqa: ANN001, ANN202
    """Leaves out a saved tensor only if it *is* a parameter: a Linear saves a transposed
    view of its weight, which is a parameter's storage all the same."""
    params = [p for p in module.parameters()]
    kept: dict = {}

    def pack(t):  # noqa: ANN001, ANN202
        if not any(t is p for p in params):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    del out
    return sum(kept.values())


class _Allocated(TorchDispatchMode):
    """Every tensor the forward makes, kept or not."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.nbytes += sum(t.untyped_storage().nbytes() for t in tree_leaves(out)
                           if isinstance(t, torch.Tensor))
        return out


def _allocated(module, *inputs):  # noqa: ANN001, ANN202
    with _Allocated() as mode:
        module(*inputs)
    return mode.nbytes


def _library_meter(module, *inputs):  # noqa: ANN001, ANN202
    from labsim.lab.memory import saved_activation_bytes

    return saved_activation_bytes(module, *inputs, model=module)


@pytest.mark.parametrize(("cheat", "why"), [
    (lambda m, *x: _meter(m, x, lambda t: (None, t.untyped_storage().nbytes()), dedupe=False),
     "instead of"),
    (lambda m, *x: _meter(m, x, lambda t: (t.data_ptr(), t.numel() * t.element_size())),
     "instead of"),
    (lambda m, *x: _meter(m, x, lambda t: (t.untyped_storage().data_ptr(),
                                           t.untyped_storage().nbytes()),
                          exclude_params=False), "instead of"),
    (_params_by_identity, "instead of"),
    (_allocated, "instead of"),
    (_library_meter, REFERENCE),
], ids=["every-save-counted", "view-bytes-not-storage", "parameters-counted",
        "parameters-by-identity", "everything-allocated", "labsim-meter"])
def test_saved_bytes_shortcuts_fail(cheat, why: str) -> None:  # noqa: ANN001
    with pytest.raises(CheckFailed, match=why):
        check.saved_bytes(cheat)
