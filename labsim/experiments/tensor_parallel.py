"""Count the collectives of tensor-parallel layers on real processes: the learner's, labsim's
and PyTorch's own (DTensor), each counted twice, by ``labsim.lab.comm.CommRecorder`` and by
PyTorch's ``CommDebugMode``.

``comm_count_worker`` (inside ``labsim.lab.launch`` workers) builds one GPT layer (float64,
``labsim.parallel.tensor_parallel.Block``), splits it over the ranks four ways (the learner's
attention and MLP, labsim's ``ParallelBlock`` with sequence parallelism, DTensor's
``ColwiseParallel`` / ``RowwiseParallel`` plan with and without ``SequenceParallel``), adds
the learner's sequence-parallel MLP half and vocabulary-parallel cross-entropy beside
DTensor's ``loss_parallel``, runs forward and backward once under both counters and compares
each output and input gradient with the whole layer in one process.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from labsim.lab.comm import CommRecorder
from labsim.parallel.tensor_parallel import Block, CopyToParallel, ParallelBlock, dtensor_block


@dataclass(frozen=True)
class CommCount:
    """One split run on one rank: collectives by kind in forward and in backward
    (``CommRecorder``), all of them by kind as ``CommDebugMode`` counted them, and the
    largest difference of the output and the input gradient from one process."""

    setup: str
    forward: dict[str, int]
    backward: dict[str, int]
    comm_debug_mode: dict[str, int]
    max_error: float


def _count(setup: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
           want: torch.Tensor, want_grad: torch.Tensor,
           around: Callable[[], Any] = contextlib.nullcontext) -> CommCount:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    x = x.detach().clone().requires_grad_(True)
    with around(), CommRecorder() as rec, CommDebugMode() as cdm:
        y = fn(x)
        rec.phase = "backward"
        y.square().sum().backward()
    if isinstance(y, DTensor):
        y = y.full_tensor()
    error = max(float((y - want).abs().max()), float((x.grad - want_grad).abs().max()))
    names = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "_allgather_base_": "all_gather",
             "allreduce_": "all_reduce", "_reduce_scatter_base_": "reduce_scatter"}
    debug: dict[str, int] = {}
    for op, n in cdm.get_comm_counts().items():
        kind = names.get(str(op).rsplit(".", 1)[-1], str(op))
        debug[kind] = debug.get(kind, 0) + n
    return CommCount(setup, rec.count("forward"), rec.count("backward"), dict(sorted(
        debug.items())), error)


def _serial(fn: Callable[[torch.Tensor], torch.Tensor],
            x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    y.square().sum().backward()
    return y.detach(), x.grad


class _Split(nn.Module):
    """A fresh module around one split (CommDebugMode's module tracker needs every module it
    sees to be called inside its own parent): the layer's norms copied, this rank's weight
    shards as parameters, ``run(self, x)`` the learner's code over them."""

    def __init__(self, block: Block, shards: ParallelBlock,
                 run: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.shards, self.run = copy.deepcopy(shards), run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self, x)


class _Logits(nn.Module):
    """The output layer and the loss: this rank's rows of the head's weight (vocabulary
    slice) and the learner's cross-entropy, or a DTensor head under ``loss_parallel``."""

    def __init__(self, head: nn.Module, loss: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.head, self.loss = head, loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss(self.head(x))


def comm_count_worker(rank: int, world: int, attention: Callable[..., torch.Tensor],
                      mlp: Callable[..., torch.Tensor], sp_mlp: Callable[..., torch.Tensor],
                      cross_entropy: Any, seq: int = 8, batch: int = 2, hidden: int = 16,
                      heads: int = 4, vocab: int = 16) -> list[CommCount]:
    """The collectives of one forward and backward of each split, on this rank (see the
    module docstring); the learner's functions have the contracts of lab 10's exercises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    block = Block(hidden, heads).double()
    x = torch.randn(seq, batch, hidden, dtype=torch.float64)
    part = slice(rank * seq // world, (rank + 1) * seq // world)
    full_out, full_grad = _serial(copy.deepcopy(block), x)
    d = hidden // heads
    shards = ParallelBlock(block, rank, world)  # this rank's shards of every weight

    def yours(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        qkv, o, up, down = m.shards.qkv, m.shards.o, m.shards.mlp.up, m.shards.mlp.down
        t = t + attention(m.ln1(t), qkv.weight, qkv.bias, o.weight, o.bias, d)
        return t + mlp(m.ln2(t), up.weight, up.bias, down.weight, down.bias)

    def yours_sp(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        up, down = m.shards.mlp.up, m.shards.mlp.down
        return sp_mlp(t, m.ln2.weight, m.ln2.bias, up.weight, up.bias, down.weight, down.bias)

    half = copy.deepcopy(nn.Sequential(block.ln2, block.mlp))  # the layer's MLP half
    half_out, half_grad = _serial(lambda t: t + half(t), x)
    rows = [_count("yours: attention + MLP", _Split(block, shards, yours), x, full_out,
                   full_grad),
            _count("labsim ParallelBlock, sequence parallel",
                   ParallelBlock(block, rank, world, True), x[part], full_out[part],
                   full_grad[part]),
            _count("yours: sequence-parallel MLP half", _Split(block, shards, yours_sp),
                   x[part], half_out[part], half_grad[part])]
    for sp in (False, True):
        split = dtensor_block(copy.deepcopy(block), mesh, sp)
        rows.append(_count(f"DTensor {'SequenceParallel' if sp else 'Colwise/Rowwise'}",
                           split, x[part] if sp else x, full_out[part] if sp else full_out,
                           full_grad[part] if sp else full_grad))

    torch.manual_seed(1)
    head = nn.Linear(hidden, vocab, bias=False).double()
    tokens = x.reshape(-1, hidden)
    target = torch.randint(0, vocab, (tokens.shape[0],))
    ce_out, ce_grad = _serial(lambda t: F.cross_entropy(head(t), target, reduction="none"),
                              tokens)
    v = vocab // world
    mine = nn.Linear(hidden, v, bias=False).double()
    mine.weight.data.copy_(head.weight[rank * v:(rank + 1) * v])
    rows.append(_count("yours: vocab-parallel cross-entropy",
                       _Logits(_Column(mine), lambda z: cross_entropy.apply(z, target,
                                                                             rank * v)),
                       tokens, ce_out, ce_grad))
    split_head = parallelize_module(copy.deepcopy(head), mesh, ColwiseParallel(
        output_layouts=Shard(-1), use_local_output=False))

    def dtensor_loss(z: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(z, target, reduction="none")

    rows.append(_count("DTensor loss_parallel", _Logits(split_head, dtensor_loss), tokens,
                       ce_out, ce_grad, around=loss_parallel))
    return rows


class _Column(nn.Module):
    """A column-parallel output layer: ``f`` (identity forward, all-reduce of the input's
    gradient backward), then this rank's vocabulary slice of the logits."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(CopyToParallel.apply(x))
