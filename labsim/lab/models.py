"""The models the labs really train, small enough for a CPU.

* ``GPT(config)``: a decoder-only transformer built from a ``labsim.Transformer`` config with
  exactly ``config.params`` parameters (the test suite checks it over many configs), so a lab
  can compare labsim's closed forms with a model it trains: GPT-2 style (learned positions,
  LayerNorm, biases, GeLU MLP, tied output layer) or LLaMA style (rotary positions, RMSNorm,
  no biases, SwiGLU, grouped-query attention).  Attention is written out (scores, causal mask,
  softmax, dropout, weighted values) so that the tensors autograd saves are the ones
  Korthikanti et al. 2022 count; ``flash=True`` uses ``F.scaled_dot_product_attention``.
  Shapes are commented as (B, T, C) = (batch, sequence, channels), (B, nh, T, hd) per head.
* ``residual_mlp``: a stack of pre-LayerNorm MLP blocks (the checkpointing lab's network).
* ``TrainStep``: one SGD step of an image MLP (the data-loading lab's "GPU work").
* ``mlp``, ``train_classifier``, ``accuracy``: the student network of the quantization lab and
  a seeded Adam loop that trains it on a ``labsim.lab.datasets.teacher_task``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.checkpoint import checkpoint

from labsim.lab.datasets import Split
from labsim.workload import Transformer


def _norm(cfg: Transformer) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.hidden)  # weight + bias: 2h
    return nn.RMSNorm(cfg.hidden, eps=1e-5)  # weight only: h


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021), the half-split form used by LLaMA."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(nn.Module):
    """Pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: Transformer, dropout: float = 0.0, flash: bool = False) -> None:
        super().__init__()
        h, kv, f = cfg.hidden, cfg.kv_dim, cfg.ffn_hidden
        self.cfg, self.dropout, self.flash = cfg, dropout, flash
        self.ln1, self.ln2 = _norm(cfg), _norm(cfg)
        self.qkv = nn.Linear(h, h + 2 * kv, bias=cfg.bias)
        self.proj = nn.Linear(h, h, bias=cfg.bias)
        self.up = nn.Linear(h, 2 * f if cfg.swiglu else f, bias=cfg.bias)  # gate and up fused
        self.down = nn.Linear(f, h, bias=cfg.bias)

    def attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                  mask: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, h = x.shape
        nh, nkv, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
        q, k, v = self.qkv(x).split([h, nkv * hd, nkv * hd], dim=-1)
        q = q.view(b, t, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(b, t, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(b, t, nkv, hd).transpose(1, 2)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        if nkv != nh:  # grouped-query attention: each K/V head serves nh/nkv query heads
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
        p = self.dropout if self.training else 0.0
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd)) + mask  # (B, nh, T, T)
            att = F.dropout(att.softmax(dim=-1), p, self.training)
            y = att @ v  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(b, t, h)
        return F.dropout(self.proj(y), p, self.training)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.swiglu:
            gate, up = self.up(x).chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(self.up(x))
        return F.dropout(self.down(hidden), self.dropout if self.training else 0.0,
                         self.training)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:
            mask = causal_mask(x.shape[1], x.device, x.dtype)
        x = x + self.attention(self.ln1(x), rope, mask)
        return x + self.mlp(self.ln2(x))


def causal_mask(t: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive (T, T) mask: 0 on and below the diagonal, -inf above (an add saves nothing
    for backward, unlike ``masked_fill``)."""
    return torch.full((t, t), float("-inf"), device=device, dtype=dtype).triu(1)


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, V) and, given targets, the mean cross-entropy.

    ``recompute=True`` checkpoints every block (``torch.utils.checkpoint``, non-reentrant)
    while gradients are enabled: the backward pass reruns each block's forward, the "full
    recomputation" of Korthikanti et al. 2022."""

    def __init__(self, cfg: Transformer, dropout: float = 0.0, flash: bool = False,
                 recompute: bool = False) -> None:
        super().__init__()
        self.cfg, self.recompute = cfg, recompute
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.positions == "learned" else None
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(cfg, dropout, flash) for _ in range(cfg.layers))
        self.ln_f = _norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def rope(self, t: int, device: torch.device, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin tables (T, hd) for rotary positions, or None for learned ones."""
        if self.wpe is not None:
            return None
        hd = self.cfg.head_dim
        inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens > seq_len={self.cfg.seq_len}")
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(t, device=idx.device))
        x = self.drop(x)
        rope = self.rope(t, idx.device, x.dtype)
        mask = causal_mask(t, idx.device, x.dtype)
        for block in self.blocks:
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, mask, use_reentrant=False)
            else:
                x = block(x, rope, mask)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss




class ResidualBlock(nn.Module):
    """Pre-LayerNorm MLP block of a transformer: ``x + W2 gelu(W1 LN(x))``, ffn 4x wide."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (tokens, width)
        return x + self.down(self.act(self.up(self.norm(x))))


def residual_mlp(layers: int, width: int, seed: int = 0) -> nn.ModuleList:
    """``layers`` ``ResidualBlock``s of ``width``, initialised from ``seed``."""
    if layers < 1 or width < 1:
        raise ValueError("layers and width must be >= 1")
    torch.manual_seed(seed)
    return nn.ModuleList(ResidualBlock(width) for _ in range(layers))


class TrainStep:
    """One SGD step of an MLP on a batch of images: the stand-in for the GPU's work.

    ``width`` and ``depth`` set its cost (about 6 x batch x params FLOP per step).  Call it
    with a batch ``(images, labels)``; it returns the loss as a float.  On CUDA the step is
    asynchronous: time it with ``labsim.lab.synchronize``.
    """

    def __init__(self, in_features: int = 3 * 32 * 32, width: int = 512, depth: int = 2,
                 classes: int = 10, device: torch.device | str = "cpu", seed: int = 0) -> None:
        torch.manual_seed(seed)
        layers: list[torch.nn.Module] = [torch.nn.Flatten()]
        for i in range(depth):
            layers += [torch.nn.Linear(in_features if i == 0 else width, width),
                       torch.nn.ReLU()]
        layers.append(torch.nn.Linear(width if depth else in_features, classes))
        self.device = torch.device(device)
        self.model = torch.nn.Sequential(*layers).to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def __call__(self, batch: tuple | list) -> torch.Tensor:
        images, labels = batch[0], batch[1]  # a timed dataset adds decode seconds: ignored
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(self.model(images), labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def __repr__(self) -> str:
        return f"TrainStep(MLP, {self.params:,} params, on {self.device})"


def mlp(dim: int, hidden: int, classes: int, depth: int = 2, seed: int = 0) -> nn.Sequential:
    """``depth`` hidden Linear+ReLU layers of width ``hidden``, then a Linear to ``classes``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = dim
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def train_classifier(
    model: nn.Module,
    data: Split,
    *,
    steps: int = 400,
    batch: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
    threads: int | None = 1,
) -> list[float]:
    """Adam with cosine decay on cross-entropy; returns the loss of every step.

    ``threads`` caps PyTorch's intra-op threads while training (restored afterwards): the
    matmuls of a small MLP are too short to split, and on a busy machine spinning threads
    waiting for each other cost more than they give.  ``None`` leaves the setting alone.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(model, data, steps, batch, lr, seed)
    finally:
        torch.set_num_threads(previous)


def _train(
    model: nn.Module, data: Split, steps: int, batch: int, lr: float, seed: int
) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    model.train()
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(data.y), (batch,), generator=gen)
        loss = nn.functional.cross_entropy(model(data.x[idx]), data.y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


@torch.no_grad()
def accuracy(model: nn.Module, data: Split, batch: int = 4096) -> float:
    """Fraction of ``data`` the model classifies correctly."""
    model.eval()
    correct = 0
    for i in range(0, len(data.y), batch):
        correct += int((model(data.x[i : i + batch]).argmax(dim=1) == data.y[i : i + batch]).sum())
    return correct / len(data.y)


