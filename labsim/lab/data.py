"""A synthetic image dataset whose items cost real CPU time to decode, and a tiny model step.

``SyntheticImages`` stores a few JPEG files made at construction from generated pixels (no
download) and, like an ImageNet pipeline, decodes one on every ``__getitem__``, resizes it
and turns it into a normalised float tensor.  The decode cost grows with the stored image's
pixel count (``side_px**2``): that is the knob for the per-item load time.  Optional
"heavy" blocks of items hold larger images (stragglers).

The class lives in an importable module so ``DataLoader`` workers can rebuild it under both
start methods: ``fork`` (Linux) copies the parent, ``spawn`` (macOS, Windows) pickles the
dataset and re-imports this module in every worker.  The JPEG bytes travel with the pickle.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image


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


@dataclass(frozen=True)
class Calibration:
    """Median seconds to make one batch in this process and to run one step on it."""

    load_time_s: float
    step_time_s: float
    batch_size: int

    def __repr__(self) -> str:
        return (f"Calibration(load={self.load_time_s * 1e3:.1f} ms/batch, "
                f"step={self.step_time_s * 1e3:.1f} ms, batch_size={self.batch_size})")


def calibrate(dataset: torch.utils.data.Dataset, step: TrainStep, batch_size: int,
              repeats: int = 5, start: int = 0) -> Calibration:
    """Time making a batch (items ``start`` ...) and one step, in this process, median.

    Run it with the thread count the workers use (``torch.set_num_threads(1)``) so the
    numbers mean "one core".
    """
    from torch.utils.data import default_collate

    from labsim.lab.device import synchronize

    loads, steps = [], []
    batch = None
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        first = start + r * batch_size
        batch = default_collate([dataset[(first + i) % len(dataset)]
                                 for i in range(batch_size)])
        t1 = time.perf_counter()
        step(batch)
        synchronize(step.device)
        t2 = time.perf_counter()
        if r:  # the first round warms caches and allocators
            loads.append(t1 - t0)
            steps.append(t2 - t1)
    return Calibration(float(np.median(loads)), float(np.median(steps)), batch_size)
