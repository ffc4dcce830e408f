"""Two parallel axes at once: FSDP2 over "dp" and tensor parallelism over "tp" on one 2-D
device mesh, as torchtitan composes them (Liang et al. 2024, "TorchTitan", arXiv:2410.06511:
FSDP2 on the data-parallel dimension, Megatron-style tensor parallelism inside it) and as
pytorch/examples' ``distributed/tensor_parallelism/fsdp_tp_example.py`` lays them out.

The world's ``dp * tp`` ranks form a ``(dp, tp)`` grid, ``tp`` the inner dimension: ranks
``0 .. tp - 1`` are the first tensor-parallel group (on a GPU cluster: GPUs of one node, on
NVLink), and each column of the grid is a data-parallel group.  In every block the
attention's Q, K, V and the MLP's up projection are split by output features
(``ColwiseParallel``: whole heads per rank), the attention's output projection and the MLP's
down projection by input features (``RowwiseParallel``: their partial sums all-reduced), the
split Shoeybi et al. 2019 (Megatron-LM, section 3) give; then ``fully_shard`` shards every
parameter, split or not, over the rank's "dp" group (ZeRO-3: Rajbhandari et al. 2020).  Each
data-parallel replica trains on its rows of the global batch; FSDP2 averages the gradients
over the replicas, so one step equals one process's step on the whole batch.

``MeshGPT(cfg)`` is a GPT-2-style decoder built from a ``labsim.Transformer`` (learned
positions, LayerNorm, biases, GeLU MLP, output layer not tied) with exactly ``cfg.params``
parameters, whose Q, K and V are separate linears so that a column split keeps whole heads;
its attention reads how many heads it holds from Q's output width, so the same module runs
whole or split.

Runs under ``torchrun --nproc_per_node=4 -m labsim.lab.worker labsim.parallel.mesh:demo``
(gloo on CPUs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn

from labsim.parallel.tensor_parallel import MLP  # down(GeLU(up(x))), up cfg.ffn_hidden wide
from labsim.workload import Transformer

__all__ = ["COLWISE", "ROWWISE", "MeshGPT", "demo", "full_parameters", "global_batch",
           "parallelize_2d", "serial_step", "train_step_2d"]

# the linears of a block that tensor parallelism splits, by how (module path in a Block)
COLWISE = ("attn.q", "attn.k", "attn.v", "mlp.up")  # by output features (weight rows)
ROWWISE = ("attn.o", "mlp.down")  # by input features (weight columns)


class Attention(nn.Module):
    """Causal self-attention with Q, K, V and the output projection as four linears.  The
    number of heads is Q's output width over ``head_dim``: all of them whole, ``heads / tp``
    on a tensor-parallel rank."""

    def __init__(self, hidden: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm layer: ``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``."""

    def __init__(self, cfg: Transformer) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.head_dim)
        self.mlp = MLP(cfg.hidden, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MeshGPT(nn.Module):
    """Token ids (B, T) and targets -> mean cross-entropy.  ``cfg`` must describe a GPT-2-style
    model (learned positions, LayerNorm, biases, GeLU, untied output layer, no grouped-query
    attention); weights are drawn from ``seed`` (normal, std 0.02, GPT-2's initialisation)."""

    def __init__(self, cfg: Transformer, seed: int = 0) -> None:
        super().__init__()
        if (cfg.positions, cfg.norm, cfg.bias, cfg.swiglu, cfg.tied_embeddings,
                cfg.kv_heads) != ("learned", "layernorm", True, False, False, cfg.heads):
            raise ValueError("MeshGPT builds GPT-2-style models: learned positions, "
                             "LayerNorm, biases, GeLU, untied output layer, kv_heads = heads")
        self.cfg = cfg
        torch.manual_seed(seed)
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def global_batch(cfg: Transformer, rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` sequences of ``cfg.seq_len`` random token ids and their targets (the same on
    every rank for a given seed)."""
    g = torch.Generator().manual_seed(seed)
    shape = (rows, cfg.seq_len)
    return (torch.randint(0, cfg.vocab, shape, generator=g),
            torch.randint(0, cfg.vocab, shape, generator=g))


def parallelize_2d(model: MeshGPT, dp: int, tp: int) -> Any:
    """Shard ``model`` in place over a ``(dp, tp)`` mesh of this process group's ranks and
    return the mesh: tensor parallelism on each block's linears over "tp" (``COLWISE``,
    ``ROWWISE``), then FSDP2 over "dp" on every block and on the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {**{name: ColwiseParallel() for name in COLWISE},
            **{name: RowwiseParallel() for name in ROWWISE}}
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh


def train_step_2d(model: MeshGPT, mesh: Any, optimizer: torch.optim.Optimizer,
                  tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """One optimizer step of ``model`` (sharded by ``parallelize_2d``) on this rank's share of
    the global batch ``tokens`` (B, T): data-parallel replica ``i`` of ``dp`` takes rows
    ``[i B / dp, (i + 1) B / dp)``; every rank of its tensor-parallel group takes the same rows.
    Returns the replica's mean loss (before the update)."""
    replica, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    rows = tokens.shape[0] // dp
    mine = slice(replica * rows, (replica + 1) * rows)
    optimizer.zero_grad()
    loss = model(tokens[mine], targets[mine])
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def serial_step(model: MeshGPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
                targets: torch.Tensor) -> float:
    """One optimizer step of the whole model on the whole batch in one process (the oracle);
    returns the loss before the update."""
    optimizer.zero_grad()
    loss = model(tokens, targets)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor gathered with ``full_tensor``), by name; a collective
    on sharded models, so every rank must call it."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def demo(rank: int, world: int, steps: int = 2) -> float:
    """torchrun smoke test (4 ranks on CPUs, 8 on a GPU node; tp = 2): ``steps`` SGD steps of
    a tiny float64 MeshGPT sharded by ``parallelize_2d`` on the rank's device against one
    process on the whole batch; returns the largest difference of a parameter after training
    (0.0 up to rounding when right)."""
    from labsim.lab.device import rank_device

    device = rank_device()
    cfg = Transformer(layers=2, hidden=32, heads=4, seq_len=16, vocab=64, dropout=False)
    tokens, targets = (t.to(device) for t in global_batch(cfg, 2 * world))
    serial = MeshGPT(cfg).double().to(device)
    opt = torch.optim.SGD(serial.parameters(), lr=0.1)
    for _ in range(steps):
        serial_step(serial, opt, tokens, targets)
    model = MeshGPT(cfg).double().to(device)
    tp = 2 if world % 2 == 0 else 1
    mesh = parallelize_2d(model, world // tp, tp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        train_step_2d(model, mesh, opt, tokens, targets)
    want = dict(serial.named_parameters())
    got = full_parameters(model)
    worst = max(float((got[n] - want[n].detach()).abs().max()) for n in want)
    dist.barrier()
    return worst
