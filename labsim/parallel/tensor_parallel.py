"""Tensor parallelism by hand: Megatron-LM's column- then row-parallel MLP (Shoeybi et al. 2019,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism",
section 3, figure 3).

The MLP ``Y = GeLU(X A) B`` is split over the ``t`` ranks of the tensor-parallel group:
``A`` by columns (rank i holds ``A_i``, the i-th block of ``ffn / t`` output columns) and ``B``
by rows (rank i holds ``B_i``, the matching ``ffn / t`` input rows).  Each rank computes
``GeLU(X A_i) B_i`` with no communication in between (GeLU is element-wise, so it commutes
with the column split), and one all-reduce sums the partial outputs.  The two conjugate
operators of the paper make forward and backward right:

* ``f`` (``CopyToParallel``): identity in forward, all-reduce of the input's gradient in
  backward (every rank's copy of ``X`` contributed to the loss);
* ``g`` (``ReduceFromParallel``): all-reduce in forward, identity in backward.

So a layer costs two all-reduces of a ``b s h`` activation in forward (after attention and
after the MLP) and two in backward: the traffic labsim's step model charges per layer
(``labsim.compute.LayerCost.tp_collectives``).

All of this runs under ``torchrun --nproc_per_node=N -m labsim.lab.worker
labsim.parallel.tensor_parallel:demo`` (gloo on CPUs, NCCL on GPUs: the model on the rank's
device); ``demo`` checks outputs and gradients against one process running the whole MLP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsim.lab.device import rank_device

__all__ = ["ColumnParallelLinear", "CopyToParallel", "ParallelMLP", "ReduceFromParallel",
           "RowParallelLinear", "demo", "split_mlp"]


class CopyToParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ColumnParallelLinear(nn.Module):
    """``y_i = x A_i + a_i``: this rank's block of output columns (no communication)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())  # (out / t, in)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(CopyToParallel.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_i x_i B_i + b``: this rank's block of input rows, summed by one all-reduce;
    the bias is added once, after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())  # (out, in / t)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ReduceFromParallel.apply(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class ParallelMLP(nn.Module):
    """The transformer MLP ``GeLU(x A) B`` split column- then row-wise over the group."""

    def __init__(self, up: ColumnParallelLinear, down: RowParallelLinear) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (tokens, h), the same on all ranks
        return self.down(F.gelu(self.up(x)))


def split_mlp(up: nn.Linear, down: nn.Linear, rank: int, world: int) -> ParallelMLP:
    """This rank's ``ParallelMLP`` from a whole MLP ``down(gelu(up(x)))``: ``up``'s rows (its
    output features) and ``down``'s columns (its input features) cut into ``world`` blocks."""
    ffn = up.out_features
    if ffn % world:
        raise ValueError(f"ffn={ffn} is not divisible by the tensor-parallel size {world}")
    block = slice(rank * ffn // world, (rank + 1) * ffn // world)
    up_bias = None if up.bias is None else up.bias[block]
    return ParallelMLP(ColumnParallelLinear(up.weight[block], up_bias),
                       RowParallelLinear(down.weight[:, block], down.bias))


def demo(rank: int, world: int, hidden: int = 16, ffn: int = 64, tokens: int = 8) -> float:
    """torchrun smoke test: the tensor-parallel MLP against the whole MLP in this process;
    returns the largest difference of outputs, input gradients and weight gradients (each
    rank compares its own blocks) — 0.0 up to rounding when right."""
    device = rank_device()
    torch.manual_seed(0)  # every rank builds the same whole MLP and input
    up, down = nn.Linear(hidden, ffn).double(), nn.Linear(ffn, hidden).double()
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    ref_x = x.clone().requires_grad_(True)
    ref = down(F.gelu(up(ref_x)))
    ref.square().sum().backward()
    mlp = split_mlp(up, down, rank, world).to(device)
    px = x.to(device).requires_grad_(True)
    out = mlp(px)
    out.square().sum().backward()
    block = slice(rank * ffn // world, (rank + 1) * ffn // world)
    diffs = [out.cpu() - ref, px.grad.cpu() - ref_x.grad,
             mlp.up.weight.grad.cpu() - up.weight.grad[block],
             mlp.down.weight.grad.cpu() - down.weight.grad[:, block],
             mlp.down.bias.grad.cpu() - down.bias.grad]
    return float(max(d.abs().max() for d in diffs))
