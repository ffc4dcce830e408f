"""Synthetic data the labs make on the spot (nothing is downloaded).

* ``SyntheticImages``: a few JPEG files made at construction from generated pixels and, like
  an ImageNet pipeline, decoded on every ``__getitem__``, resized and turned into a normalised
  float tensor.  The decode cost grows with the stored image's pixel count (``side_px**2``):
  that is the knob for the per-item load time.  Optional "heavy" blocks of items hold larger
  images (stragglers).  The class lives in an importable module so ``DataLoader`` workers can
  rebuild it under both start methods: ``fork`` copies the parent, ``spawn`` pickles the
  dataset and re-imports this module in every worker (the JPEG bytes travel with the pickle).
* ``teacher_task``: a classification task whose labels come from a random "teacher" network
  (teacher-student setting, Gardner & Derrida 1989): inputs are standard normal vectors and
  the label is the class the teacher scores highest.  Points the teacher scores almost equally
  for two classes are dropped (``margin``), so a small student reaches a high test accuracy
  that is worth protecting when it is later quantized.
* ``SleepyBatches``: batches that take a scripted time to make (a sleep, so no core is busy):
  every ``every``-th is a straggler, for ``DataLoader(in_order=...)``.
* ``random_batch``: seeded token ids and next-token targets for a ``labsim.lab.models.GPT``.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from labsim.workload import Transformer


def _make_jpeg(side_px: int, seed: int, quality: int = 90) -> bytes:
    """A photo-like picture (smooth gradients plus sensor noise) encoded as JPEG."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side_px, 0:side_px].astype(np.float32)
    fx, fy, phase = rng.uniform(5, 40, 3), rng.uniform(5, 40, 3), rng.uniform(0, 6, 3)
    channels = [np.sin(x / fx[c] + phase[c]) * 60 + np.cos(y / fy[c]) * 60 + 128
                for c in range(3)]
    pixels = np.stack(channels, -1) + rng.normal(0, 20, (side_px, side_px, 3))
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


class SyntheticImages(torch.utils.data.Dataset):
    """``n_items`` (image, label) pairs; each item decodes a ``side_px`` x ``side_px`` JPEG.

    Returns a float32 tensor (3, out_px, out_px) in [0, 1] and an int label in
    [0, ``classes``).  ``heavy_every`` > 0 makes every ``heavy_every``-th block of
    ``heavy_block`` consecutive items decode ``heavy_side_px`` images instead (with
    ``shuffle=False`` and ``heavy_block`` = batch size: every k-th batch is a straggler).
    With ``timed=True`` an item is ``(image, label, timing)``, ``timing`` a float64 tensor
    ``[decode seconds, time.perf_counter() when done]`` measured where it ran (a worker), so
    the training loop learns what each batch cost to make and when it was ready (the
    monotonic clock is shared by the processes of one machine).
    """

    def __init__(self, n_items: int = 4096, side_px: int = 256, out_px: int = 32,
                 classes: int = 10, distinct: int = 8, heavy_every: int = 0,
                 heavy_block: int = 16, heavy_side_px: int = 512, timed: bool = False,
                 seed: int = 0) -> None:
        if n_items < 1 or side_px < 8 or out_px < 1 or distinct < 1:
            raise ValueError("need n_items >= 1, side_px >= 8, out_px >= 1, distinct >= 1")
        if heavy_every < 0 or heavy_block < 1:
            raise ValueError("heavy_every must be >= 0 (0 = none) and heavy_block >= 1")
        self.n_items, self.side_px, self.out_px = n_items, side_px, out_px
        self.classes, self.heavy_every, self.heavy_block = classes, heavy_every, heavy_block
        self.heavy_side_px, self.timed = heavy_side_px, timed
        self.files = [_make_jpeg(side_px, seed * 1000 + i) for i in range(distinct)]
        self.heavy_files = ([_make_jpeg(heavy_side_px, seed * 1000 + 500 + i)
                             for i in range(distinct)] if heavy_every else [])

    def __len__(self) -> int:
        return self.n_items

    def is_heavy(self, index: int) -> bool:
        return bool(self.heavy_every) and (index // self.heavy_block) % self.heavy_every == 0

    def __getitem__(self, index: int) -> tuple:
        if not 0 <= index < self.n_items:
            raise IndexError(index)
        start = time.perf_counter()
        files = self.heavy_files if self.is_heavy(index) else self.files
        image = Image.open(io.BytesIO(files[index % len(files)])).convert("RGB")  # decode
        image = image.resize((self.out_px, self.out_px), Image.BILINEAR)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)
        pixels = pixels / 255.0  # (3, out_px, out_px)
        if self.timed:
            done = time.perf_counter()
            timing = torch.tensor([done - start, done], dtype=torch.float64)
            return pixels, index % self.classes, timing
        return pixels, index % self.classes

    def __repr__(self) -> str:
        heavy = (f", every {self.heavy_every}th block of {self.heavy_block} at "
                 f"{self.heavy_side_px}px" if self.heavy_every else "")
        return (f"SyntheticImages({self.n_items} items, JPEG {self.side_px}x{self.side_px}"
                f" -> {self.out_px}x{self.out_px}{heavy})")



class SleepyBatches(torch.utils.data.Dataset):
    """Item ``i`` is a whole batch (use ``batch_size=None``): its index as a tensor, made in
    ``fast_s`` seconds, or ``slow_s`` when ``i % every == every - 1`` (a straggler).

    The time is a sleep, so it costs no core: the run shows the loader's ordering rules, not
    this machine's load.
    """

    def __init__(self, n_items: int, every: int, slow_s: float, fast_s: float) -> None:
        if n_items < 1 or every < 1:
            raise ValueError(f"n_items={n_items}, every={every}: both must be >= 1")
        if not 0 <= fast_s <= slow_s:
            raise ValueError(f"need 0 <= fast_s <= slow_s, got {fast_s}, {slow_s}")
        self.n_items, self.every, self.slow_s, self.fast_s = n_items, every, slow_s, fast_s

    def __len__(self) -> int:
        return self.n_items

    def is_slow(self, i: int) -> bool:
        return i % self.every == self.every - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.slow_s if self.is_slow(i) else self.fast_s)
        return torch.tensor(i)

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


def random_batch(cfg: Transformer, batch: int, seq_len: int | None = None, seed: int = 0,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic token ids (inputs, next-token targets), each (batch, seq_len)."""
    t = cfg.seq_len if seq_len is None else seq_len
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch, t + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


