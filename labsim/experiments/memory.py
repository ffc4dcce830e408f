"""Where a real training step's memory goes, measured on the lab GPT (``labsim.lab.GPT``).

- ``step_timeline``: two fp32 training steps (``zero_grad``, forward, backward, optimizer
  step) under ``labsim.lab.LiveBytes``: the bytes alive after each phase and the peak.  It
  shows what a "model states + activations" estimate leaves out: activations are freed as
  the backward writes gradients, ``zero_grad(set_to_none=True)`` frees the gradients, and
  PyTorch's optimizers create their state (Adam's two moments, SGD's momentum buffer)
  lazily, inside the first ``step()`` (``torch.optim.Adam._init_group``).
- ``recipe_step``: the model and its optimizer after one step of a training recipe (fp32,
  ``torch.autocast``, bf16 with fp32 master copies, pure bf16; Adam, AdamW, amsgrad,
  Adagrad, SGD), for reading what each recipe keeps per parameter.
- ``memory_timeline``: the same steps under ``torch.profiler`` with its memory profile: bytes
  alive through time by category (parameters, gradients, optimizer state, activations,
  ...), with the phases marked; on a GPU, ``dump_snapshot`` writes the CUDA allocator's
  history for https://pytorch.org/memory_viz.

The models are small, so each run uses one CPU thread (``labsim.lab.timing.one_thread``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PHASES = ("forward 1", "backward 1", "step 1", "forward 2", "backward 2", "step 2")
OPTIMIZERS = ("adam", "sgd", "sgd-momentum")


@dataclass(frozen=True)
class StepTimeline:
    """Bytes alive after each of ``PHASES`` (created since training started: the weights
    and the batch, made before, are not counted), and the peak of each of the two steps."""

    n_params: int
    activation_bytes: int  # alive after the first forward
    after: tuple[int, ...]  # one per PHASES
    peaks: tuple[int, int]  # the most bytes alive at once during step 1, during step 2


def step_timeline(config: Mapping[str, Any], optimizer: str = "adam",
                  set_to_none: bool = True) -> StepTimeline:
    """Two fp32 steps of the GPT of ``config`` (``layers``, ``hidden``, ``heads``,
    ``seq_len``, ``vocab``, ``batch``; tied embeddings, seed 0) with ``optimizer`` (one of
    ``OPTIMIZERS``), ``zero_grad(set_to_none=set_to_none)`` before each."""
    import torch

    from labsim.lab.datasets import random_batch
    from labsim.lab.memory import LiveBytes
    from labsim.lab.models import GPT
    from labsim.lab.timing import one_thread
    from labsim.workload import Transformer

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}; use one of {OPTIMIZERS}")
    cfg = Transformer(config["layers"], config["hidden"], config["heads"], config["seq_len"],
                      config["vocab"], tied_embeddings=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    params = list(model.parameters())
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=1e-3)
    else:
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9 if optimizer != "sgd" else 0.0)
    idx, targets = random_batch(cfg, batch=config["batch"], seed=0)
    after, peaks = [], []
    with one_thread(), LiveBytes() as live:
        for _ in range(2):
            live.peak = live.live
            opt.zero_grad(set_to_none=set_to_none)
            loss = model(idx, targets)[1]
            after.append(live.live)
            loss.backward()
            del loss
            after.append(live.live)
            opt.step()
            after.append(live.live)
            peaks.append(live.peak)
    return StepTimeline(sum(p.numel() for p in params), after[0], tuple(after),
                        (peaks[0], peaks[1]))


# -- what a training recipe keeps: the model and its optimizer after one step ---------------

PRECISIONS = ("fp32", "autocast-bf16", "mixed-bf16", "pure-bf16")
RECIPE_OPTIMIZERS = ("adam", "adamw", "adam-amsgrad", "adagrad", "sgd", "sgd-momentum")


def _gpt_config(config: Mapping[str, Any]) -> Any:
    """A ``Transformer`` from a plain config: ``layers``, ``hidden``, ``heads``, ``seq_len``,
    ``vocab`` and any other field of ``Transformer`` (``tied_embeddings`` defaults to True)."""
    from labsim.workload import Transformer

    fields = {k: v for k, v in config.items() if k not in ("batch",)}
    fields.setdefault("tied_embeddings", True)
    return Transformer(**fields)


def _optimizer(name: str, params: list[Any]) -> Any:
    """The torch optimizer ``name`` (one of ``RECIPE_OPTIMIZERS``) over ``params``."""
    import torch

    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "adam-amsgrad":
        return torch.optim.Adam(params, lr=1e-3, amsgrad=True)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-2)
    if name in ("sgd", "sgd-momentum"):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if name == "sgd-momentum" else 0.0)
    raise ValueError(f"optimizer={name!r}; use one of {RECIPE_OPTIMIZERS}")


def recipe_step(config: Mapping[str, Any], precision: str = "fp32", optimizer: str = "adam",
                *, zero_grad: bool = False, freeze: tuple[str, ...] = (), batch: int = 1,
                seed: int = 0) -> tuple[Any, Any]:
    """``(model, optimizer)`` after one training step of the GPT of ``config`` (seed
    ``seed``, ``batch`` sequences) with a training recipe, on the CPU:

    - ``precision="fp32"``: weights, gradients and optimizer state in fp32;
    - ``"autocast-bf16"``: the forward under ``torch.autocast(dtype=bfloat16)`` (PyTorch's
      automatic mixed precision): the weights, their gradients and the state stay fp32;
    - ``"mixed-bf16"``: bf16 weights and gradients, and an fp32 master copy of every weight
      that the optimizer updates and copies back (Micikevicius et al. 2018, Sec. 3.1; the
      "2 + 2 + K" of Rajbhandari et al. 2020, Sec. 3.1): the masters live in the
      optimizer's ``param_groups``, not in the model; their fp32 gradients are made for the
      update and dropped after it;
    - ``"pure-bf16"``: everything in bf16, the optimizer's state included.

    ``optimizer`` is one of ``RECIPE_OPTIMIZERS``; ``zero_grad=True`` sets the gradients to
    None after the step; ``freeze`` names top-level modules (``"wte"``, ``"blocks"``) whose
    parameters do not train (no gradient, not given to the optimizer).
    """
    import torch

    from labsim.lab.datasets import random_batch
    from labsim.lab.models import GPT
    from labsim.lab.timing import one_thread

    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; use one of {PRECISIONS}")
    cfg = _gpt_config(config)
    torch.manual_seed(seed)
    model = GPT(cfg)
    for name in freeze:
        getattr(model, name).requires_grad_(False)
    if precision in ("mixed-bf16", "pure-bf16"):
        model.to(torch.bfloat16)
    trained = [p for p in model.parameters() if p.requires_grad]
    masters = ([p.detach().float().requires_grad_(True) for p in trained]
               if precision == "mixed-bf16" else [])
    opt = _optimizer(optimizer, masters or trained)
    idx, targets = random_batch(cfg, batch=batch, seed=seed)
    with one_thread():  # a small model: a second thread only waits on a busy machine
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast-bf16"):
            loss = model(idx, targets)[1]
        loss.backward()
        for master, p in zip(masters, trained):
            master.grad = p.grad.float()  # fp32 gradient for the update
        opt.step()
        with torch.no_grad():
            for master, p in zip(masters, trained):
                p.copy_(master)  # the updated weights, rounded back to bf16
                master.grad = None
    if zero_grad:
        model.zero_grad(set_to_none=True)
    return model, opt


# -- the memory timeline of training steps, from torch.profiler's memory profile ---------------

CATEGORIES = ("parameters", "optimizer state", "inputs", "temporary", "activations",
              "gradients", "autograd detail", "unknown")
"""The profiler's categories (``torch.profiler._memory_profiler.Category``, in the order of
its ``_CATEGORY_TO_INDEX``), named in words: ``autograd detail`` is memory the backward pass
makes that is no parameter's gradient (the gradients of activations on their way back);
``unknown`` is memory the profiler could not attribute."""
_TORCH_CATEGORIES = ("PARAMETER", "OPTIMIZER_STATE", "INPUT", "TEMPORARY", "ACTIVATION",
                     "GRADIENT", "AUTOGRAD_DETAIL", None)


@dataclass(frozen=True)
class MemoryTimeline:
    """Bytes alive on ``device`` through profiled training steps, by category.

    ``times_ms[i]`` is a moment (ms from the profiler's start) and ``by_category[c][i]`` the
    bytes of category ``c`` (``CATEGORIES``) alive from then until the next moment;
    ``phases`` are the steps' phases as (label, start ms, end ms).
    """

    device: str
    times_ms: tuple[float, ...]
    by_category: dict[str, tuple[int, ...]]
    phases: tuple[tuple[str, float, float], ...]

    @property
    def totals(self) -> tuple[int, ...]:
        """Bytes alive at each moment, all categories together."""
        return tuple(sum(col) for col in zip(*self.by_category.values()))

    @property
    def peak_index(self) -> int:
        """The first moment at which the most bytes are alive."""
        totals = self.totals
        return max(range(len(totals)), key=totals.__getitem__)

    def at(self, index: int) -> dict[str, int]:
        """Bytes by category at moment ``index``."""
        return {c: values[index] for c, values in self.by_category.items()}

    def phase_at(self, time_ms: float) -> str:
        """The label of the phase running at ``time_ms`` ("between phases" if none)."""
        for label, start, end in self.phases:
            if start <= time_ms <= end:
                return label
        return "between phases"


def _run_steps(model: Any, opt: Any, idx: Any, targets: Any, steps: int) -> None:
    """``steps`` training steps, each phase a ``record_function`` range named as ``PHASES``
    are (``zero_grad`` before every forward)."""
    from torch.profiler import record_function

    for step in range(1, steps + 1):
        with record_function(f"zero_grad {step}"):
            opt.zero_grad(set_to_none=True)
        with record_function(f"forward {step}"):
            loss = model(idx, targets)[1]
        with record_function(f"backward {step}"):
            loss.backward()
        del loss
        with record_function(f"step {step}"):
            opt.step()


def _training_setup(config: Mapping[str, Any], device: Any) -> tuple[Any, Any, Any, Any]:
    """The fp32 GPT of ``config`` (seed 0) on ``device``, its Adam and a batch."""
    import torch

    from labsim.lab.datasets import random_batch
    from labsim.lab.models import GPT

    cfg = _gpt_config(config)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx, targets = random_batch(cfg, batch=config["batch"], seed=0, device=device)
    return model, opt, idx, targets


def memory_timeline(config: Mapping[str, Any], steps: int = 2,
                    device: str = "cpu") -> MemoryTimeline:
    """Profile ``steps`` fp32 Adam steps of the GPT of ``config`` (``layers``, ``hidden``,
    ``heads``, ``seq_len``, ``vocab``, ``batch``) with ``torch.profiler.profile(
    profile_memory=True, record_shapes=True, with_stack=True)`` (the three options the
    memory profile needs) and read the profiler's memory timeline
    (``profile.export_memory_timeline``: bytes alive by category at every allocation and
    free on ``device``).  The profiler works out the categories from what it saw: tensors
    the optimizer holds, gradients of parameters, tensors the forward made that the
    backward used, and so on (``torch/profiler/_memory_profiler.py``)."""
    import json
    import tempfile
    import warnings
    from pathlib import Path

    import torch
    from torch.profiler import ProfilerActivity, profile

    from labsim.lab.profile import quiet_profiler
    from labsim.lab.timing import one_thread

    _check_categories()
    dev = torch.device(device)
    model, opt, idx, targets = _training_setup(config, dev)
    activities = [ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with one_thread(), quiet_profiler(), profile(
            activities=activities, profile_memory=True, record_shapes=True,
            with_stack=True) as prof:
        _run_steps(model, opt, idx, targets, steps)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    device_str = f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        # export_memory_timeline is deprecated in favour of CUDA's memory snapshots, which
        # do not exist on a CPU
        warnings.simplefilter("ignore", FutureWarning)
        path = Path(folder) / "timeline.json"
        prof.export_memory_timeline(str(path), device_str)
        times_us, sizes = json.loads(path.read_text())
    start_us = prof.profiler.kineto_results.trace_start_ns() / 1e3
    phases = tuple((e.name, e.time_range.start / 1e3, e.time_range.end / 1e3)
                   for e in prof.events() if e.name in _phase_names(steps))
    columns = list(zip(*sizes))[1:]  # column 0 is unused; then one per category
    return MemoryTimeline(
        device=device_str,
        times_ms=tuple((t - start_us) / 1e3 for t in times_us),
        by_category={c: tuple(int(v) for v in col) for c, col in zip(CATEGORIES, columns)},
        phases=tuple(sorted(phases, key=lambda p: p[1])),
    )


def _check_categories() -> None:
    """Raise if this torch orders the profiler's categories otherwise than ``CATEGORIES``."""
    from torch.profiler import _memory_profiler

    order = tuple(None if c is None else c.name for c in _memory_profiler._CATEGORY_TO_INDEX)
    if order != _TORCH_CATEGORIES:
        raise RuntimeError(f"torch.profiler's memory categories are {order}; labsim reads "
                           f"{_TORCH_CATEGORIES}")


def _phase_names(steps: int) -> set[str]:
    return {f"{phase} {s}" for s in range(1, steps + 1)
            for phase in ("zero_grad", "forward", "backward", "step")}


def dump_snapshot(config: Mapping[str, Any], path: str, steps: int = 2) -> str:
    """On a CUDA GPU: run ``steps`` fp32 Adam steps of the GPT of ``config`` while the CUDA
    caching allocator records its history (``torch.cuda.memory._record_memory_history``)
    and write the snapshot (``torch.cuda.memory._dump_snapshot``) to ``path``: open it at
    https://pytorch.org/memory_viz to see every allocation with the Python stack that made
    it.  Returns ``path``."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("memory snapshots record the CUDA caching allocator: no GPU here")
    model, opt, idx, targets = _training_setup(config, torch.device("cuda"))
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        _run_steps(model, opt, idx, targets, steps)
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path
