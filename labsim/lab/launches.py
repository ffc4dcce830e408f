"""Triton kernel launches, recorded: which kernel, how many programs, and (in Triton's
interpreter) whether every load and store stayed inside the tensors the launch was given.

``kernel[grid](...)`` ends in the ``run`` method of the jitted function (``JITFunction.run``
when Triton compiles for a GPU, ``InterpretedFunction.run`` when ``TRITON_INTERPRET=1``
runs the kernel in numpy on the CPU; Triton 3.9, ``triton/runtime/jit.py`` and
``runtime/interpreter.py``).  ``LaunchLog`` wraps both for the duration of a block:

* every launch is noted as a ``Launch`` (the kernel's name, its programs: the grid's axes
  multiplied);
* the interpreter's own copying of the arguments to and from the host
  (``GridExecutor._init_args_hst`` / ``_restore_args_dev``) and a compiled launch run with
  torch's dispatch modes switched off, so an operator recorder (``labsim.lab.profile.OpLog``)
  sees the operators of the code around the launch and of an interpreted kernel's body, not
  Triton's plumbing;
* an interpreted launch runs without the thread's ``sys.setprofile`` hook: the interpreter
  makes thousands of Python calls per program, and a hook on each (the checks' reference
  tripwire, ``labsim.checks._observe``) would make a small kernel take seconds; the operator
  recorders stay on, so torch work in a kernel's body is still seen;
* with ``bounds=True`` the interpreter's loads and stores
  (``InterpreterBuilder.create_masked_load`` / ``create_masked_store``, through which every
  ``tl.load`` and ``tl.store`` goes) are checked against the memory of the launch's tensor
  arguments *before* they touch memory (one ``tl.load`` or ``tl.store`` must stay inside one
  tensor); an access outside raises ``OutOfBounds`` instead of reading or overwriting
  whatever lies there -- what a kernel that forgets the tail's mask does.

A compiled kernel runs on the GPU, out of Python's sight: there only launches are recorded.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes


class OutOfBounds(IndexError):
    """A kernel's load or store reached memory outside every tensor it was given."""


@dataclass(frozen=True)
class Launch:
    """One launch: the jitted function's name and its number of programs (grid product)."""

    kernel: str
    programs: int
    interpreted: bool


@dataclass
class LaunchLog:
    """Record Triton launches while the block runs (see the module docstring)::

        with LaunchLog(bounds=True) as log:
            y = my_wrapper(x)
        log.launches      # [Launch(kernel='my_kernel', programs=4, interpreted=True)]
        log.out_of_bounds  # [] or what the first bad access did, in words
    """

    bounds: bool = False
    launches: list[Launch] = field(default_factory=list)
    out_of_bounds: list[str] = field(default_factory=list)
    _stack: contextlib.ExitStack | None = field(default=None, init=False, repr=False)
    _extents: list[tuple[int, int]] = field(default_factory=list, init=False, repr=False)
    _kernel: str = field(default="", init=False, repr=False)

    def __enter__(self) -> LaunchLog:
        import triton.runtime.interpreter as interp
        import triton.runtime.jit as jit

        stack = contextlib.ExitStack()
        stack.enter_context(_patched(jit.JITFunction, "run", self._wrap_run(False)))
        stack.enter_context(_patched(interp.InterpretedFunction, "run", self._wrap_run(True)))
        executor = interp.GridExecutor
        stack.enter_context(_patched(executor, "_init_args_hst", self._wrap_to_host))
        stack.enter_context(_patched(executor, "_restore_args_dev", _unrecorded))
        if self.bounds:
            builder = interp.InterpreterBuilder
            stack.enter_context(_patched(builder, "create_masked_load",
                                         self._wrap_access("loaded", mask_at=1)))
            stack.enter_context(_patched(builder, "create_masked_store",
                                         self._wrap_access("stored", mask_at=2)))
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def clear(self) -> None:
        self.launches.clear()
        self.out_of_bounds.clear()

    # -- the wrappers ------------------------------------------------------------------------

    def _wrap_run(self, interpreted: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        log = self

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def run(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
                if warmup:
                    return original(fn, *args, grid=grid, warmup=warmup, **kwargs)
                name = getattr(getattr(fn, "fn", None), "__name__", "a kernel")
                log.launches.append(Launch(name, _programs(fn, grid, args, kwargs),
                                           interpreted))
                log._kernel = name
                if interpreted:  # the kernel's body is Python: its operators stay in sight
                    with _profile_paused():
                        return original(fn, *args, grid=grid, warmup=warmup, **kwargs)
                with _disable_current_modes():  # a compiled launch runs no torch operator
                    return original(fn, *args, grid=grid, warmup=warmup, **kwargs)
            return run
        return wrap

    def _wrap_to_host(self, original: Callable[..., Any]) -> Callable[..., Any]:
        log = self

        @functools.wraps(original)
        def to_host(executor: Any, args_dev: Any, kwargs: Any) -> Any:
            with _disable_current_modes():
                args_hst, kwargs_hst = original(executor, args_dev, kwargs)
            log._extents = [_extent(t) for t in _tensors((args_hst, kwargs_hst))]
            return args_hst, kwargs_hst
        return to_host

    def _wrap_access(self, verb: str, *, mask_at: int
                     ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """``create_masked_load(ptrs, mask, ...)`` / ``create_masked_store(ptrs, value, mask,
        ...)``: the pointers are the first argument, the mask at ``mask_at``."""
        log = self

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def access(builder: Any, *args: Any) -> Any:
                ptrs, mask = args[0], args[mask_at]
                log._check_inside(builder, verb, ptrs, mask)
                return original(builder, *args)
            return access
        return wrap

    def _check_inside(self, builder: Any, verb: str, ptrs: Any, mask: Any) -> None:
        import numpy as np

        addresses = np.broadcast_to(ptrs.data, np.shape(mask.data))[np.asarray(mask.data,
                                                                               dtype=bool)]
        if addresses.size == 0:
            return
        width = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        # one tl.load or tl.store reads or writes one tensor: the one its first element falls
        # in (a block that runs past the end starts inside), else the one holding most of its
        # elements; an address in a neighbouring tensor (they may lie side by side in memory)
        # counts as outside
        counts = {(start, stop): int(((addresses >= start) & (addresses + width <= stop)).sum())
                  for start, stop in self._extents}
        first = int(addresses[0])
        home = [ext for ext in counts if ext[0] <= first and first + width <= ext[1]]
        inside = counts[home[0]] if home else max(counts.values(), default=0)
        outside = int(addresses.size) - inside
        if outside:
            program = getattr(builder, "grid_idx", ("?",))[0]
            text = (f"program {program} of {self._kernel} {verb} {outside} element(s) outside "
                    "the tensor it was reading or writing")
            if len(self.out_of_bounds) < 10:
                self.out_of_bounds.append(text)
            raise OutOfBounds(text)


@contextlib.contextmanager
def _profile_paused() -> Iterator[None]:
    """No ``sys.setprofile`` hook on this thread while the block runs: Triton's interpreter
    makes thousands of Python calls per program, and a hook on each (the checks' reference
    tripwire) slows a kernel several times over.  The dispatcher's recorders are unaffected."""
    saved = sys.getprofile()
    sys.setprofile(None)
    try:
        yield
    finally:
        sys.setprofile(saved)


def _unrecorded(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` run with torch's dispatch modes off (Triton's copies, not the learner's)."""

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return original(*args, **kwargs)
    return call


@contextlib.contextmanager
def _patched(owner: type, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
             ) -> Iterator[None]:
    original = owner.__dict__.get(name)
    if original is None:  # another Triton version: nothing to wrap here
        yield
        return
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    base = getattr(value, "base", None)  # triton's TensorWrapper
    if isinstance(base, torch.Tensor):
        return [base]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` spans: from its first element to the end of its last."""
    if t.numel() == 0:
        return (0, 0)
    last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


def _programs(fn: Any, grid: Any, args: tuple, kwargs: dict) -> int:
    """The number of programs ``grid`` launches (a tuple, or a function of the arguments as
    Triton calls it: ``grid(meta)`` with every argument by name); -1 if it cannot be told."""
    try:
        if callable(grid):
            params = inspect.signature(fn.fn).parameters
            bound = inspect.signature(fn.fn).bind_partial(
                *args, **{k: v for k, v in kwargs.items() if k in params})
            bound.apply_defaults()
            grid = grid(dict(bound.arguments))
        return math.prod(int(g) for g in grid)
    except Exception:  # noqa: BLE001 - a grid we cannot evaluate is reported, not raised
        return -1


def interpreting() -> bool:
    """Whether ``@triton.jit`` makes interpreted functions now (``TRITON_INTERPRET=1``)."""
    import triton

    return bool(triton.knobs.runtime.interpret)


def library_interpreted() -> bool:
    """Whether Triton's own jitted helpers (``tl.rand``'s Philox and the like) were made for the
    interpreter: they are decorated once, when ``triton`` is first imported, so
    ``TRITON_INTERPRET=1`` must be set before that import for an interpreted kernel to call
    them."""
    import triton.language.random as random
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(random.rand, InterpretedFunction)


__all__ = ["Launch", "LaunchLog", "OutOfBounds", "interpreting", "library_interpreted"]
