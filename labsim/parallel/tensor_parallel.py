"""Tensor parallelism by hand: Megatron-LM's split of a transformer layer (Shoeybi et al. 2019,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", section
3, figure 3), sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", section 4.2.2) and vocabulary-parallel cross-entropy.

Layout: activations are ``(s, b, h)``, sequence first, as in Megatron-LM (Narayanan et al.
2021, section 4.2), so a sequence shard is a contiguous slice of dimension 0.

* MLP ``Y = GeLU(X A) B``: ``A`` split by columns (rank i holds ``A_i``, ``ffn / t`` output
  features), ``B`` by rows; GeLU is element-wise, so ``GeLU(X A_i) B_i`` needs no
  communication, and one all-reduce sums the partial outputs.
* Attention: Q, K, V column-parallel (rank i holds ``heads / t`` whole heads), the output
  projection row-parallel: again one all-reduce.
* The conjugate operators (figure 3 of the paper): ``f`` (``CopyToParallel``) is the identity
  forward and all-reduces the gradient backward; ``g`` (``ReduceFromParallel``) all-reduces
  forward and is the identity backward.  A layer costs two all-reduces of ``s b h`` elements
  forward and two backward: what ``labsim.simulate_step`` charges per layer.
* Sequence parallelism: layer norms run on ``s / t`` rows per rank; ``f`` becomes an
  all-gather of the sequence (``GatherFromSequence``: reduce-scatter backward) and ``g`` a
  reduce-scatter (``ScatterToSequence``: all-gather backward), the same bytes on the wire.
* Vocabulary-parallel cross-entropy (Megatron-LM ``vocab_parallel_cross_entropy``): each rank
  holds ``V / t`` logits per token; three all-reduces of one number per token (the maximum,
  the sum of exponentials, the target's logit) give the loss without gathering the logits.

``Block`` is the serial layer (the oracle), ``ParallelBlock`` its split; ``dtensor_block``
builds the same split with PyTorch's own API (DTensor ``ColwiseParallel`` /
``RowwiseParallel`` / ``SequenceParallel``).  All of it runs under ``torchrun
--nproc_per_node=N -m labsim.lab.worker labsim.parallel.tensor_parallel:demo`` (gloo on CPUs,
NCCL on GPUs, the model on the rank's device).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsim.lab.device import rank_device

__all__ = ["Block", "ColumnParallelLinear", "CopyToParallel", "GatherFromSequence",
           "ParallelBlock", "ParallelMLP", "ReduceFromParallel", "RowParallelLinear",
           "ScatterToSequence", "VocabParallelCrossEntropy", "causal_attention", "demo",
           "dtensor_block", "split_mlp"]


class CopyToParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class GatherFromSequence(torch.autograd.Function):
    """Sequence parallelism's ``f``: all-gather the sequence shards (dimension 0) forward,
    reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((x.shape[0] * world, *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class ScatterToSequence(torch.autograd.Function):
    """Sequence parallelism's ``g``: reduce-scatter forward (the sum, each rank keeping its
    slice of dimension 0), all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] * world, *grad.shape[1:]))
        dist.all_gather_into_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy per token from this rank's ``(tokens, V / t)`` slice of the logits
    (vocabulary ids ``vocab_start .. vocab_start + V / t``); ``target`` holds ids in
    ``0 .. V``.  Forward: all-reduce MAX of the local maxima, SUM of the local sums of
    ``exp(logit - max)`` and SUM of the target's logit (zero where this rank does not hold
    it); backward: ``softmax - onehot`` on the local slice, no communication."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                group: Any = None) -> torch.Tensor:
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        local = target - vocab_start
        mine = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1) * mine
        dist.all_reduce(picked, group=group)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), index, mine)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, index, mine = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, index, mine.unsqueeze(-1).to(
            softmax.dtype))
        return (softmax - onehot) * grad.unsqueeze(-1), None, None, None


def causal_attention(qkv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Causal softmax attention from a fused ``(s, b, n * 3 * head_dim)`` projection whose
    features are laid out head by head, ``[head, (q, k, v), head_dim]`` (Megatron-LM's
    ``query_key_value`` layout: a contiguous block of features is whole heads); returns the
    ``n`` heads' outputs side by side, ``(s, b, n * head_dim)``."""
    s, b, width = qkv.shape
    n = width // (3 * head_dim)
    q, k, v = (t.permute(1, 2, 0, 3)  # (b, n, s, d)
               for t in qkv.reshape(s, b, n, 3, head_dim).unbind(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, n * head_dim)


class Attention(nn.Module):
    """Multi-head causal self-attention: one fused QKV projection (head-major features, see
    ``causal_attention``) and an output projection."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.qkv, self.o = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (s, b, h)
        return self.o(causal_attention(self.qkv(x), self.head_dim))


class MLP(nn.Module):
    """``down(GeLU(up(x)))``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-norm GPT layer on ``(s, b, h)``: ``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``.
    The serial model every split is compared with."""

    def __init__(self, hidden: int = 16, heads: int = 4, ffn: int | None = None) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn, self.mlp = Attention(hidden, heads), MLP(hidden, ffn or 4 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _rows(linear: nn.Linear, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's block of output features (rows of the weight) and of the bias."""
    n = linear.out_features
    if n % world:
        raise ValueError(f"{n} features are not divisible by the tensor-parallel size {world}")
    part = slice(rank * n // world, (rank + 1) * n // world)
    return linear.weight[part], linear.bias[part]


def _cols(linear: nn.Linear, rank: int, world: int) -> torch.Tensor:
    """This rank's block of input features (columns of the weight)."""
    n = linear.in_features
    if n % world:
        raise ValueError(f"{n} features are not divisible by the tensor-parallel size {world}")
    return linear.weight[:, rank * n // world:(rank + 1) * n // world]


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach().clone())


class ColumnParallelLinear(nn.Module):
    """``y_i = x A_i + a_i``: this rank's block of output columns (no communication); with
    ``gather_input`` the input is this rank's sequence shard, all-gathered first."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 gather_input: bool = False) -> None:
        super().__init__()
        self.weight, self.bias = _param(weight), _param(bias)  # (out / t, in), (out / t,)
        self.gather_input = gather_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = GatherFromSequence.apply(x) if self.gather_input else CopyToParallel.apply(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_i x_i B_i + b``: this rank's block of input rows, summed by one all-reduce
    (or reduce-scattered over the sequence with ``scatter_output``); the bias is added once,
    after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 scatter_output: bool = False) -> None:
        super().__init__()
        self.weight, self.bias = _param(weight), _param(bias)  # (out, in / t), (out,)
        self.scatter_output = scatter_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        reduce = ScatterToSequence if self.scatter_output else ReduceFromParallel
        y = reduce.apply(partial)
        return y if self.bias is None else y + self.bias


class ParallelMLP(nn.Module):
    """The transformer MLP ``GeLU(x A) B`` split column- then row-wise over the group."""

    def __init__(self, up: ColumnParallelLinear, down: RowParallelLinear) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def split_mlp(up: nn.Linear, down: nn.Linear, rank: int, world: int,
              sequence_parallel: bool = False) -> ParallelMLP:
    """This rank's ``ParallelMLP`` from a whole MLP ``down(gelu(up(x)))``: ``up``'s rows (its
    output features) and ``down``'s columns (its input features) cut into ``world`` blocks."""
    if up.out_features % world:
        raise ValueError(f"ffn={up.out_features} is not divisible by the tensor-parallel "
                         f"size {world}")
    weight, bias = _rows(up, rank, world)
    return ParallelMLP(ColumnParallelLinear(weight, bias, sequence_parallel),
                       RowParallelLinear(_cols(down, rank, world), down.bias,
                                         sequence_parallel))


class ParallelBlock(nn.Module):
    """This rank's part of a ``Block``: heads and MLP features split over the group; with
    ``sequence_parallel`` its input and output are the rank's slice of the sequence."""

    def __init__(self, block: Block, rank: int, world: int,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        heads = block.attn.o.in_features // block.attn.head_dim
        if heads % world:
            raise ValueError(f"heads={heads} are not divisible by the tensor-parallel size "
                             f"{world}")
        sp = sequence_parallel
        self.head_dim = block.attn.head_dim
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)  # replicated
        self.qkv = ColumnParallelLinear(*_rows(block.attn.qkv, rank, world), sp)  # whole heads
        self.o = RowParallelLinear(_cols(block.attn.o, rank, world), block.attn.o.bias, sp)
        self.mlp = split_mlp(block.mlp.up, block.mlp.down, rank, world, sp)
        self.sequence_parallel = sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.o(causal_attention(self.qkv(self.ln1(x)), self.head_dim))
        return x + self.mlp(self.ln2(x))


def dtensor_block(block: Block, mesh: Any, sequence_parallel: bool = False) -> Block:
    """``block`` parallelised in place with PyTorch's own tensor parallelism on ``mesh``
    (``torch.distributed.tensor.parallel``): the fused QKV and ``up`` ``ColwiseParallel``, ``o``
    and ``down`` ``RowwiseParallel``; with ``sequence_parallel`` the norms run
    ``SequenceParallel`` on dimension 0 and the row-parallel outputs are reduce-scattered
    (torchtitan's plan).  The attention reads its local head count from Q's output."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {"attn.qkv": ColwiseParallel(), "mlp.up": ColwiseParallel()}
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(0),),
                                    desired_input_layouts=(Replicate(),))
        plan.update({"ln1": SequenceParallel(sequence_dim=0),
                     "ln2": SequenceParallel(sequence_dim=0), "attn": gather, "mlp": gather,
                     "attn.o": RowwiseParallel(output_layouts=Shard(0)),
                     "mlp.down": RowwiseParallel(output_layouts=Shard(0))})
    else:
        plan.update({"attn.o": RowwiseParallel(), "mlp.down": RowwiseParallel()})
    return parallelize_module(block, mesh, plan)


def demo(rank: int, world: int, hidden: int = 16, heads: int = 4, seq: int = 8,
         batch: int = 2) -> float:
    """torchrun smoke test: the split layer, without and with sequence parallelism, against
    the whole layer in this process; returns the largest difference of outputs, input
    gradients and this rank's weight gradients (0.0 up to rounding when right)."""
    device = rank_device()
    torch.manual_seed(0)  # every rank builds the same whole layer and input
    block = Block(hidden, heads).double()
    x = torch.randn(seq, batch, hidden, dtype=torch.float64)
    ref_x = x.clone().requires_grad_(True)
    ref = block(ref_x)
    ref.square().sum().backward()
    worst = 0.0
    part = slice(rank * seq // world, (rank + 1) * seq // world)
    for sp in (False, True):
        layer = ParallelBlock(block, rank, world, sp).to(device)
        px = (x[part] if sp else x).clone().to(device).requires_grad_(True)
        out = layer(px)
        out.square().sum().backward()
        want_out, want_grad = (ref[part], ref_x.grad[part]) if sp else (ref, ref_x.grad)
        ffn = block.mlp.up.out_features
        rows = slice(rank * ffn // world, (rank + 1) * ffn // world)
        cols = slice(rank * hidden // world, (rank + 1) * hidden // world)
        diffs = [out.cpu() - want_out, px.grad.cpu() - want_grad,
                 layer.mlp.up.weight.grad.cpu() - block.mlp.up.weight.grad[rows],
                 layer.o.weight.grad.cpu() - block.attn.o.weight.grad[:, cols]]
        worst = max(worst, float(max(d.detach().abs().max() for d in diffs)))
    return worst
