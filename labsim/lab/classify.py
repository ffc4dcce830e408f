"""A small classification task generated on the spot, and an MLP that learns it in seconds.

Labels come from a random "teacher" network (teacher-student setting, Gardner & Derrida
1989): inputs are standard normal vectors and the label is the class the teacher scores
highest.  Points the teacher scores almost equally for two classes are dropped (``margin``),
so a small student MLP reaches a high test accuracy that is worth protecting when the student
is later quantized.  Everything is seeded; nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Split:
    """Inputs (N, dim) float32 and labels (N,) int64."""

    x: torch.Tensor
    y: torch.Tensor

    def __repr__(self) -> str:
        return f"Split(n={len(self.y)}, dim={self.x.shape[1]})"


@dataclass(frozen=True)
class TeacherTask:
    """Train, test and calibration splits of one teacher-labelled task."""

    train: Split
    test: Split
    calibration: Split
    classes: int

    def __repr__(self) -> str:
        return (
            f"TeacherTask(classes={self.classes}, train={len(self.train.y)}, "
            f"test={len(self.test.y)}, calibration={len(self.calibration.y)}, "
            f"dim={self.train.x.shape[1]})"
        )


def teacher_task(
    n_train: int = 8192,
    n_test: int = 4096,
    n_calibration: int = 512,
    dim: int = 32,
    classes: int = 10,
    margin: float = 0.5,
    seed: int = 0,
) -> TeacherTask:
    """Three disjoint splits labelled by a seeded random teacher (one tanh layer of 64)."""
    if min(n_train, n_test, n_calibration) < 1 or dim < 1 or classes < 2:
        raise ValueError("need n_train, n_test, n_calibration >= 1, dim >= 1, classes >= 2")
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(dim, 64, generator=gen) / dim**0.5
    w2 = torch.randn(64, classes, generator=gen) * 2.0 / 64**0.5
    need = n_train + n_test + n_calibration
    xs, ys, have = [], [], 0
    while have < need:
        x = torch.randn(4 * need, dim, generator=gen)
        scores = torch.tanh(x @ w1) @ w2
        top2 = scores.topk(2, dim=1).values
        keep = (top2[:, 0] - top2[:, 1]) >= margin
        xs.append(x[keep])
        ys.append(scores[keep].argmax(dim=1))
        have += int(keep.sum())
    x, y = torch.cat(xs)[:need], torch.cat(ys)[:need]
    a, b = n_train, n_train + n_test
    return TeacherTask(Split(x[:a], y[:a]), Split(x[a:b], y[a:b]), Split(x[b:], y[b:]), classes)


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
