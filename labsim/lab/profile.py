"""Count what a piece of PyTorch code launches, with ``torch.profiler``.

On a CUDA GPU every kernel that runs is a profiler event on the device: ``OpCounts.kernels``
counts them exactly.  On a CPU there are no kernels to count; what costs a fixed overhead per
call there is the dispatch of one ATen operator (argument parsing, dtype and device dispatch,
allocating the output, spawning the OpenMP loop).  ``OpCounts.ops`` lists the ATen operators
that do arithmetic or copy data (views, allocations and wrappers such as ``aten::to`` that
only forward to another operator are left out), each with the bytes its operands occupy --
the traffic it causes if every operand crosses main memory once and nothing stays in cache.

A ``torch.compile``d function shows as one "Torch-Compiled Region" whose generated kernels
are not ATen operators; ``compiled_regions`` counts those regions.

``peak_bytes`` measures the most memory a call held at once above what was allocated before
it, on any device: on CUDA from the caching allocator's peak statistic, on a CPU from the
profiler's record of every allocation and free (``profile_memory=True``), replayed in order.

``OpLog`` is what the checks watch a learner's function with: a ``TorchDispatchMode``, so it
sees every ATen and ``c10d`` (``torch.distributed``) operator at the dispatcher, below
``__torch_function__`` -- code run under ``torch._C.DisableTorchFunction()`` or calling a
``ProcessGroup`` directly is seen too.  It records which operators ran, the largest tensor an
operator *created* (views and in-place results are not new tensors) and, by number of
dimensions, the longest last dimension of a created tensor of two or more rows, the dtypes of
created floating-point tensors and of matmul operands, every collective or point-to-point
message with its bytes and whether autograd's backward was running, and how many runs of
autograd's engine the operators ran under (a ``backward`` that calls
``torch.autograd.grad`` starts a second one).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from labsim.precision import DTYPE_BYTES

# Operators that do no arithmetic and move no data (or only forward to another operator).
NON_KERNEL_OPS = frozenset(
    {
        "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::zeros_like",
        "aten::as_strided", "aten::view", "aten::_reshape_alias", "aten::reshape",
        "aten::transpose", "aten::t", "aten::expand", "aten::permute", "aten::slice",
        "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias",
        "aten::resolve_conj", "aten::resolve_neg", "aten::_unsafe_view", "aten::lift_fresh",
        "aten::to", "aten::_to_copy", "aten::contiguous", "aten::result_type",
        "aten::scalar_tensor", "aten::item", "aten::_local_scalar_dense", "aten::split",
        "aten::narrow", "aten::unbind", "aten::matmul", "aten::linear", "aten::dropout",
        "aten::scaled_dot_product_attention", "aten::_fused_sdp_choice", "aten::chunk",
        "aten::is_nonzero", "aten::broadcast_tensors", "aten::clone", "aten::flatten",
    }
)

# the profiler's C++ type names -> labsim's dtype names (bytes from labsim.precision)
_PROFILER_DTYPES = {
    "float": "fp32", "double": "fp64", "c10::Half": "fp16", "c10::BFloat16": "bf16",
    "long int": "int64", "int": "int32", "bool": "bool", "unsigned char": "uint8",
    "signed char": "int8", "short int": "int16",
}


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Silence the native profiler's "USDT ... profiler_start/stop" lines on file descriptor 2.

    Some torch builds print them from C++ on every profiling session; Python-level output
    (exceptions, warnings, ``sys.stderr`` in a notebook) is not affected.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (embedded interpreters)
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass(frozen=True)
class OpRecord:
    """One operator call: its name and the bytes of its tensor operands (output included)."""

    name: str
    nbytes: float


@dataclass(frozen=True)
class OpCounts:
    """What one call of a function launched: ATen ops (CPU view) and device kernels (CUDA)."""

    ops: tuple[OpRecord, ...]
    kernels: int  # device kernel launches; 0 on a CPU
    kernel_names: tuple[str, ...]
    compiled_regions: int

    @property
    def n_ops(self) -> int:
        return len(self.ops)

    @property
    def nbytes(self) -> float:
        """Bytes touched by all ATen ops (each operand once); 0 inside compiled regions."""
        return sum(op.nbytes for op in self.ops)

    def by_name(self) -> dict[str, int]:
        return dict(Counter(op.name for op in self.ops))

    def __repr__(self) -> str:
        names = ", ".join(f"{k} x{v}" for k, v in self.by_name().items()) or "none"
        return (
            f"OpCounts({self.n_ops} ATen ops [{names}], {self.kernels} device kernels, "
            f"{self.compiled_regions} compiled regions, {self.nbytes / 1e6:.4g} MB touched)"
        )


def _tensor_bytes(shape: Any, dtype: str) -> float:
    if not isinstance(shape, (list, tuple)) or dtype not in _PROFILER_DTYPES:
        return 0.0
    if len(shape) == 0 or not all(isinstance(s, int) for s in shape):
        return 0.0  # scalars and non-tensor arguments
    return float(math.prod(shape) * DTYPE_BYTES[_PROFILER_DTYPES[dtype]])


def _broadcast_numel(shapes: list) -> int:
    tensors = [s for s in shapes if isinstance(s, (list, tuple)) and s]
    if not tensors:
        return 0
    try:
        return math.prod(torch.broadcast_shapes(*[tuple(s) for s in tensors]))
    except RuntimeError:
        return max(math.prod(s) for s in tensors)


def _op_bytes(name: str, shapes: list, dtypes: list) -> float:
    """Bytes read plus bytes written by one element-wise-style operator call."""
    read = sum(_tensor_bytes(s, d) for s, d in zip(shapes, dtypes))
    if name == "aten::copy_":  # copy_(dst, src): writes dst, reads src
        return read
    if name.endswith("_"):  # in-place: the first operand is also written
        return read + (_tensor_bytes(shapes[0], dtypes[0]) if shapes else 0.0)
    sizes = [DTYPE_BYTES[_PROFILER_DTYPES[d]] if d in _PROFILER_DTYPES else 0
             for s, d in zip(shapes, dtypes) if s]
    out_elem = max(sizes) if sizes else 0
    return read + _broadcast_numel(shapes) * out_elem


def _input_dtypes(prof: profile) -> Callable[[Any], list]:
    """``event -> its inputs' dtype names`` for the profiler's events.  ``FunctionEvent`` has
    ``input_dtypes`` from torch 2.13; before that the Kineto event it was built from has them
    as ``dtypes()``: the first one with the event's id, its correlation id
    (``torch.autograd.profiler._parse_kineto_results``; later events can share the id)."""
    by_id: dict[int, list] | None = None

    def dtypes(event: Any) -> list:
        nonlocal by_id
        found = getattr(event, "input_dtypes", None)
        if found is not None:
            return list(found)
        if by_id is None:
            by_id = {}
            for k in prof.profiler.kineto_results.events():
                by_id.setdefault(k.correlation_id(), list(k.dtypes()))
        return by_id.get(event.id, [])

    return dtypes


def _counted(event: Any) -> bool:
    return event.name.startswith("aten::") and event.name not in NON_KERNEL_OPS


def _wraps_counted(event: Any) -> bool:
    """Whether a counted op runs inside ``event`` (the profiler's CPU call tree)."""
    todo = list(event.cpu_children)
    while todo:
        child = todo.pop()
        if _counted(child):
            return True
        todo.extend(child.cpu_children)
    return False


def count_ops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> OpCounts:
    """Run ``fn(*args, **kwargs)`` once under the profiler and count what it launched.

    Only the innermost ops that do the work are counted: an op that calls other counted ops
    (``aten::softmax`` calling ``aten::_softmax``, ``aten::masked_fill`` calling ``aten::copy_``
    and ``aten::masked_fill_``) is their wrapper, and counting it too would count its bytes
    twice.  Warm the function up first (a ``torch.compile``d function compiles on its first
    call).
    """
    activities = [ProfilerActivity.CPU]
    cuda = torch.cuda.is_available()
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with quiet_profiler(), profile(activities=activities, record_shapes=True) as prof:
        fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
    ops: list[OpRecord] = []
    kernel_names: list[str] = []
    regions = 0
    input_dtypes = _input_dtypes(prof)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            if not event.name.startswith(("Memcpy", "Memset")):  # copies are not kernels
                kernel_names.append(event.name)
            continue
        if event.name.startswith("Torch-Compiled Region"):
            regions += 1
            continue
        if not _counted(event) or _wraps_counted(event):
            continue
        ops.append(
            OpRecord(
                event.name,
                _op_bytes(event.name, list(event.input_shapes), input_dtypes(event)),
            )
        )
    return OpCounts(tuple(ops), len(kernel_names), tuple(kernel_names), regions)


class _TorchCallLog(torch.overrides.TorchFunctionMode):
    """Records each torch function or method called and the size of every tensor it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.names.append(getattr(func, "__name__", str(func)))
        result = func(*args, **(kwargs or {}))
        stack = [result]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                self.numels.append(item.numel())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
        return result


@dataclass(frozen=True)
class TorchCalls:
    """What one call did at the torch level: its result, the element count of every tensor a
    torch function returned (views included), and the names of the functions called."""

    result: Any
    numels: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def largest(self) -> int:
        return max(self.numels, default=0)


def torch_calls(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> TorchCalls:
    """Call ``fn`` under a ``TorchFunctionMode`` that logs every torch call it makes.

    Used by checks to see whether a function ever built a tensor as large as the N x N
    attention matrix or a full-size intermediate (independently of the allocator), and
    whether it called a function an exercise must not use.
    """
    log = _TorchCallLog()
    with log:
        result = fn(*args, **kwargs)
    return TorchCalls(result, tuple(log.numels), tuple(log.names))


def peak_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Peak bytes allocated during ``fn(*args, **kwargs)`` beyond what was held before it.

    The result counts too while it is alive.  CUDA (when a GPU is present and a tensor argument
    is on it, or there are no tensor arguments): ``torch.cuda.max_memory_allocated``; CPU: the
    running sum of the profiler's allocation (+) and free (-) events.
    """
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if torch.cuda.is_available() and (not tensors or any(t.is_cuda for t in tensors)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
        del result
        return int(peak)
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    del result
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return int(peak)


TOP_CREATED = 16  # how many of the largest created tensors an OpLog remembers
MATMUL_OPS = frozenset({
    "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::mv",
    "aten::addmv", "aten::dot", "aten::vdot", "aten::_int_mm", "aten::matmul", "aten::linear",
})


_POINT_TO_POINT = frozenset({"c10d::send", "c10d::recv_"})  # (tensors, group, peer, tag)


@dataclass(frozen=True)
class Message:
    """One ``c10d`` operator call: its name (``"c10d::send"``), the bytes of the tensors it
    writes or sends (its first argument) and of its input list (reduce-scatter's input),
    whether it was issued while autograd's backward pass was running, and for a point-to-point
    message the peer's rank in its group (``dst`` of a send, ``src`` of a receive; -1 else)."""

    op: str
    nbytes: int
    in_nbytes: int
    in_backward: bool
    peer: int = -1


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


class OpLog(TorchDispatchMode):
    """Record every operator a block of code dispatches (see the module docstring).

    ``keep_created=True`` also remembers a weak reference to the storage of every tensor an
    operator created, with its bytes, so a check can ask later which of them are still alive
    (the state a function holds) -- ``held_bytes()``.
    """

    def __init__(self, keep_created: bool = False) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.largest_new = 0
        self.biggest: list[int] = []  # the TOP_CREATED largest created numels, descending
        self.float_dtypes: set[str] = set()
        self.matmul_dtypes: set[str] = set()
        self.messages: list[Message] = []
        self.created: list[tuple[Any, int]] | None = [] if keep_created else None
        self.widest: dict[int, int] = {}  # ndim -> longest last dim of a created 2+-row one
        self.graph_tasks: set[int] = set()  # autograd engine runs the operators ran under
        self._fresh: dict[Any, tuple[bool, ...]] = {}

    def _returns_fresh(self, func: Any) -> tuple[bool, ...]:
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = tuple(r.alias_info is None for r in func._schema.returns)
            self._fresh[func] = fresh
        return fresh

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        self.counts[name] += 1
        task = torch._C._current_graph_task_id()
        if task != -1:
            self.graph_tasks.add(task)
        if name.startswith("c10d::"):
            second = args[1] if len(args) > 1 else None
            peer = args[2] if name in _POINT_TO_POINT and len(args) > 2 else -1
            self.messages.append(Message(name, _nbytes(args[0]) if args else 0,
                                         _nbytes(second),
                                         torch._C._current_graph_task_id() != -1,
                                         int(peer) if isinstance(peer, int) else -1))
            return out
        if name in MATMUL_OPS:
            self.matmul_dtypes.update(str(t.dtype).replace("torch.", "")
                                      for t in _tensors(args))
        results = out if isinstance(out, (list, tuple)) else (out,)
        for fresh, result in zip(self._returns_fresh(func), results):
            if not fresh:
                continue
            for t in _tensors(result):
                self.largest_new = max(self.largest_new, t.numel())
                if t.dim() >= 2 and t.shape[-2] > 1:
                    self.widest[t.dim()] = max(self.widest.get(t.dim(), 0), t.shape[-1])
                if len(self.biggest) < TOP_CREATED or t.numel() > self.biggest[-1]:
                    self.biggest = sorted([*self.biggest, t.numel()], reverse=True)[
                        :TOP_CREATED]
                if t.is_floating_point():
                    self.float_dtypes.add(str(t.dtype).replace("torch.", ""))
                if self.created is not None and t.numel():
                    storage = t.untyped_storage()
                    self.created.append((StorageWeakRef(storage), storage.nbytes()))
        return out

    def held_bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Bytes of the created storages still alive, each once, leaving out the storages of
        ``exclude`` (parameters, say)."""
        if self.created is None:
            raise ValueError("OpLog(keep_created=True) is needed to ask what is held")
        skip = {StorageWeakRef(t.untyped_storage()) for t in exclude}
        alive = {ref: n for ref, n in self.created if not ref.expired() and ref not in skip}
        return sum(alive.values())

    def settled_held_bytes(self, exclude: Iterable[torch.Tensor] = (), polls: int = 10,
                           wait_s: float = 0.005, enough: int = 0) -> int:
        """``held_bytes(exclude)`` once what is only briefly alive has died: a collective's
        tensors can stay referenced for a moment after the call returns (seen with gloo: the
        last all-gather's buffer on one rank, freed milliseconds later) and a buffer caught in
        a reference cycle lives until the collector runs.  The smallest of ``polls`` readings
        ``wait_s`` apart, a collection before each, stopping once one is ``enough`` or less;
        held bytes only fall, and what is really kept stays."""
        exclude = list(exclude)
        held = None
        for i in range(polls):
            if i:
                time.sleep(wait_s)
            gc.collect()
            reading = self.held_bytes(exclude)
            held = reading if held is None else min(held, reading)
            if held <= enough:
                break
        return int(held or 0)

    def summary(self) -> dict[str, Any]:
        """What was seen, as plain data (names, counts, sizes)."""
        return {
            "ops": dict(self.counts),
            "largest_new": self.largest_new,
            "largest_created": list(self.biggest),
            "widest": {str(n): w for n, w in sorted(self.widest.items())},
            "graph_tasks": len(self.graph_tasks),
            "float_dtypes": sorted(self.float_dtypes),
            "matmul_dtypes": sorted(self.matmul_dtypes),
            "messages": [[m.op, m.nbytes, m.in_nbytes, m.in_backward, m.peer]
                         for m in self.messages],
        }
