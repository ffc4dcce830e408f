"""Record the communication a piece of PyTorch code issues, where the dispatcher sees it.

Every ``torch.distributed`` call ends in a dispatcher operator: ``dist.all_reduce`` in
``c10d.allreduce_``, ``dist.isend`` in ``c10d.send``, the functional collectives that DTensor
uses in ``_c10d_functional.all_reduce`` and so on.  ``CommRecorder`` is a
``TorchDispatchMode``: inside ``with CommRecorder() as rec:`` each of those operators is
recorded as a ``CommOp`` (its kind, the elements it moves and the phase the caller set), and
the FLOPs of every matrix product are counted with PyTorch's own ``FlopCounterMode``.  Code
cannot hide a collective from it by calling ``torch.distributed`` through another name, and it
sees the backward pass as well (autograd runs CPU backward on the calling thread with the
caller's dispatch modes; CommDebugMode, ``torch.distributed.tensor.debug``, works the same
way and is the yardstick the labs compare with).

Payload (``CommOp.numel``): the elements of the whole tensor the operation is about: an
all-reduce's tensor, an all-gather's gathered output, a reduce-scatter's unreduced input, a
send's or receive's buffer.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommOp", "CommRecorder", "comm_kind", "count_by_kind"]

# dispatcher operator name (without overload) -> kind of communication
_KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "barrier": "barrier", "monitored_barrier_": "barrier",
}
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def comm_kind(func: Any) -> str | None:
    """The kind of communication a dispatcher operator is ("all_reduce", "send", ...), or
    None for an operator that does not communicate (``wait_tensor`` included)."""
    schema = getattr(func, "_schema", None)
    name = str(schema.name) if schema is not None else str(func)
    namespace, _, op = name.partition("::")
    if namespace not in _NAMESPACES:
        return None
    return _KINDS.get(op)


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _payload(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(elements, bytes) of the largest argument (a tensor or a list of them, summed): the
    gathered output of a c10d all-gather, the input of a reduce-scatter, the tensor of an
    all-reduce or a send."""
    best = (0, 0)
    for arg in (*args, *kwargs.values()):
        tensors = list(_tensors(arg))
        size = (sum(t.numel() for t in tensors),
                sum(t.numel() * t.element_size() for t in tensors))
        best = max(best, size)
    return int(best[0]), int(best[1])


@dataclass(frozen=True)
class CommOp:
    """One communication operation: ``kind`` ("all_reduce", "all_gather", "reduce_scatter",
    "send", "recv", ...), ``numel`` elements of its whole tensor, ``nbytes`` the same in
    bytes, the ``phase`` the recorder was in (set by the caller: "forward", "backward") and
    the dispatcher operator's name."""

    kind: str
    numel: int
    nbytes: int
    phase: str
    op: str


class CommRecorder(TorchDispatchMode):
    """Record every communication operator and count matrix-product FLOPs in a block.

    ``phase`` labels what is recorded from now on (set it between forward and backward);
    ``comms`` lists the ``CommOp``s in issue order; ``flops`` is the total of PyTorch's
    ``FlopCounterMode`` (matmuls, convolutions, attention) over the block.
    (The list is not called ``ops``: cloudpickle, which ships notebook functions to workers,
    mistakes ``torch`` + an attribute ``ops`` in a function for the module ``torch.ops``.)
    """

    def __init__(self, phase: str = "forward") -> None:
        # imported here, not with this module: torch.utils.flop_counter imports Triton, whose
        # interpreter must be chosen (TRITON_INTERPRET) before its first import, and a lab or
        # test that imports labsim.lab.comm early must not choose it
        from torch.utils.flop_counter import FlopCounterMode

        super().__init__()
        self.phase = phase
        self.comms: list[CommOp] = []
        self._flops = FlopCounterMode(display=False)
        self.flops = 0
        # DTensor exists only once its module is loaded; importing it here would cost a
        # second in every process that never uses it
        tensor_module = sys.modules.get("torch.distributed.tensor")
        self._dtensor = getattr(tensor_module, "DTensor", None)

    def __enter__(self) -> CommRecorder:
        self._flops.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._flops.__exit__(*exc)
        self.flops = int(self._flops.get_total_flops())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if self._dtensor is not None and any(t is self._dtensor for t in types):
            # DTensor first turns the op into local ops and collectives, which come back
            # through this mode: count those (as CommDebugMode does)
            return NotImplemented
        kind = comm_kind(func)
        if kind is not None:
            name = str(func._schema.name)
            numel, nbytes = _payload(args, kwargs or {})
            if kind == "all_gather" and not name.startswith("c10d::"):
                # functional all-gather: (input, group_size, group_name) -> the gathered size
                group = next((a for a in args if isinstance(a, int)), 1)
                numel, nbytes = numel * group, nbytes * group
            self.comms.append(CommOp(kind, numel, nbytes, self.phase, name))
        return func(*args, **(kwargs or {}))

    def count(self, phase: str | None = None) -> dict[str, int]:
        """How many operations of each kind (in ``phase`` only, if given)."""
        return count_by_kind(op for op in self.comms if phase is None or op.phase == phase)


def count_by_kind(ops: Iterable[CommOp]) -> dict[str, int]:
    """{kind: number of operations}, kinds sorted by name."""
    counts = Counter(op.kind for op in ops)
    return dict(sorted(counts.items()))
