"""Measure where a real PyTorch training step's memory goes, on CUDA and on a CPU.

``MemoryMeter`` is a context manager around a forward pass (and, if you like, the backward
and optimizer step)::

    with MemoryMeter(model, optimizer) as meter:
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
    meter.breakdown()     # MemoryBreakdown(params, grads, optimizer, activations) in bytes
    meter.peak_bytes      # CUDA: allocator peak during the block; CPU: None

What it counts:

- **activations**: every tensor autograd saves for the backward pass, seen through
  ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage (a view and its base
  are counted once) and excluding the model's own parameters (a linear layer saves its weight,
  which is not an activation).  This works on every device, the CPU included.
- **params / grads / optimizer**: the bytes of ``model.parameters()``, their ``.grad`` and the
  tensors in ``optimizer.state`` (Adam's ``exp_avg``, ``exp_avg_sq`` and ``step``), read
  when ``breakdown()`` is called, shared storages counted once.
- **peak_bytes** (CUDA only): ``torch.cuda.max_memory_allocated`` over the block minus what
  was allocated on entry, i.e. what the block added at its worst moment, which includes
  temporaries that an estimate leaves out.  The CPU allocator keeps no such statistic.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from labsim.memory import MemoryBreakdown


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2 parameters, gradients and Adam state are
    DTensors whose storage is the local shard); any other tensor unchanged."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    t = _local(t)
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return (str(t.device), -id(t))


def _storage_nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once (None skipped);
    for a DTensor (FSDP2) the bytes of this rank's shard."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        seen[_storage_key(t)] = _storage_nbytes(t)
    return sum(seen.values())


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (tied weights counted once)."""
    return tensor_bytes(model.parameters())


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters' ``.grad`` tensors that exist now (0 before backward)."""
    return tensor_bytes(p.grad for p in model.parameters())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (moments, momentum buffers, step counts).
    An optimizer keeps its state lazily: it is empty until the first ``step()``."""
    return tensor_bytes(
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


class MemoryMeter:
    """Count saved-for-backward bytes (any device) and the CUDA allocator peak in a block.

    ``model`` (optional) lets the meter leave its parameters out of the activations and
    report parameter and gradient bytes; ``optimizer`` (optional) its state bytes.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self._saved: dict[tuple[str, int], int] = {}
        self._copies: dict[tuple[str, int], int] = {}
        self._by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self._param_keys: set[tuple[str, int]] = set()
        self._hooks: Any = None
        self._cuda: torch.device | None = None
        self._start_bytes = 0
        self.peak_bytes: int | None = None

    # --------------------------------------------------------------- context manager
    def __enter__(self) -> MemoryMeter:
        if self.model is not None:
            self._param_keys = {_storage_key(p) for p in self.model.parameters()}
            device = next((p.device for p in self.model.parameters()), None)
            if device is not None and device.type == "cuda":
                self._cuda = device
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
            torch.cuda.reset_peak_memory_stats(self._cuda)
            self._start_bytes = torch.cuda.memory_allocated(self._cuda)
        self._saved.clear()
        self._copies.clear()
        self._by_shape = {}
        for p in self.model.parameters() if self.model is not None else ():
            self._by_shape.setdefault(tuple(p.shape), []).append(p)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
            self.peak_bytes = torch.cuda.max_memory_allocated(self._cuda) - self._start_bytes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # Record sizes only (keeping the tensors would keep them alive).  While the graph
        # lives its saved storages stay allocated, so their addresses cannot be reused.
        key = _storage_key(t)
        if key not in self._param_keys:
            self._saved[key] = _storage_nbytes(t)
            if key not in self._copies and self._is_weight_copy(t):
                self._copies[key] = self._saved[key]
        return t

    def _is_weight_copy(self, t: torch.Tensor) -> bool:
        if not t.is_floating_point():
            return False
        with torch.no_grad():
            for p in self._by_shape.get(tuple(t.shape), ()):
                if p.dtype != t.dtype and torch.equal(p.to(t.dtype), t):
                    return True
            for p in self._by_shape.get(tuple(t.shape)[::-1], ()):
                if p.dim() == 2 and p.dtype != t.dtype and torch.equal(p.to(t.dtype).t(), t):
                    return True
        return False

    # --------------------------------------------------------------- results
    @property
    def saved_bytes(self) -> int:
        """Bytes autograd saved for backward in the block, parameters excluded."""
        return sum(self._saved.values())

    def weight_copies(self) -> tuple[int, int]:
        """(count, bytes) of saved tensors that are one of the model's parameters (or its
        transpose) cast to another dtype, value for value: the low-precision copies of the
        weights that ``torch.autocast`` makes in the forward pass and autograd keeps for
        backward."""
        return len(self._copies), sum(self._copies.values())

    def breakdown(self) -> MemoryBreakdown:
        """Measured bytes now: params, grads, optimizer state, and the block's activations."""
        params = param_bytes(self.model) if self.model is not None else 0
        grads = grad_bytes(self.model) if self.model is not None else 0
        opt = optimizer_state_bytes(self.optimizer) if self.optimizer is not None else 0
        return MemoryBreakdown(params, grads, opt, self.saved_bytes)

    def __repr__(self) -> str:
        peak = "" if self.peak_bytes is None else f", peak_bytes={self.peak_bytes}"
        return f"MemoryMeter(saved_bytes={self.saved_bytes}{peak})"


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def saved_activation_bytes(fn: Any, *args: Any, model: torch.nn.Module | None = None,
                           **kwargs: Any) -> int:
    """Bytes autograd saves for backward while ``fn(*args, **kwargs)`` runs (parameters of
    ``model`` excluded).  The result of ``fn`` is dropped afterwards."""
    with MemoryMeter(model) as meter:
        out = fn(*args, **kwargs)
    del out
    return meter.saved_bytes


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created inside the mode and still alive, and their peak.

    Storages that alias an input of the op (views, in-place results) are not new memory and
    are not counted; tensors made before the mode (weights, the batch) are never counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = {
            id(a.untyped_storage())
            for a in tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._sizes:
                continue
            self._sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, key)
            self.peak = max(self.peak, self.live)
        return out


