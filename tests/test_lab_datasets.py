"""The synthetic image dataset and training step (labsim.lab.datasets).

The teacher-student task: seeded, disjoint, margin respected; the student learns it.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from labsim.experiments.loading import calibrate
from labsim.lab.datasets import SyntheticImages, teacher_task
from labsim.lab.models import TrainStep, accuracy, mlp, train_classifier


def test_items_are_images_and_labels():
    ds = SyntheticImages(n_items=20, side_px=64, out_px=16, classes=5)
    image, label = ds[7]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    assert 0.0 <= image.min() and image.max() <= 1.0
    assert label == 2
    assert len(ds) == 20
    with pytest.raises(IndexError):
        ds[20]


def test_items_are_deterministic_and_survive_pickling():
    a = SyntheticImages(n_items=8, side_px=64, seed=3)
    b = pickle.loads(pickle.dumps(a))  # what spawn does to reach a worker
    assert torch.equal(a[5][0], b[5][0])
    assert torch.equal(a[5][0], SyntheticImages(n_items=8, side_px=64, seed=3)[5][0])
    assert not torch.equal(a[5][0], SyntheticImages(n_items=8, side_px=64, seed=4)[5][0])


def test_timed_items_and_heavy_blocks():
    ds = SyntheticImages(n_items=64, side_px=64, timed=True, heavy_every=4, heavy_block=8,
                         heavy_side_px=128)
    image, label, timing = ds[0]
    assert timing.dtype == torch.float64 and timing.shape == (2,)
    assert timing[0] > 0 and timing[1] >= timing[0]
    assert ds.is_heavy(0) and ds.is_heavy(7) and not ds.is_heavy(8) and ds.is_heavy(32)
    assert "every 4th block" in repr(ds)


def test_train_step_learns_and_calibrates():
    torch.manual_seed(0)
    step = TrainStep(in_features=3 * 8 * 8, width=32, depth=1, classes=3)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 3, (16,))
    first = float(step((x, y)))
    for _ in range(30):
        last = float(step((x, y)))
    assert last < first
    assert step.params == 3 * 64 * 32 + 32 + 32 * 3 + 3
    cal = calibrate(SyntheticImages(n_items=32, side_px=32, out_px=8, classes=3), step, 4,
                    repeats=2)
    assert cal.load_time_s > 0 and cal.step_time_s > 0 and cal.batch_size == 4


def test_task_is_deterministic_and_sized() -> None:
    a = teacher_task(n_train=100, n_test=50, n_calibration=20, dim=8, seed=3)
    b = teacher_task(n_train=100, n_test=50, n_calibration=20, dim=8, seed=3)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    assert (len(a.train.y), len(a.test.y), len(a.calibration.y)) == (100, 50, 20)
    assert a.train.x.shape == (100, 8) and int(a.train.y.max()) < a.classes
    everything = torch.cat([a.train.x, a.test.x, a.calibration.x])
    assert torch.unique(everything, dim=0).shape[0] == 170  # disjoint splits
    c = teacher_task(n_train=100, n_test=50, n_calibration=20, dim=8, seed=4)
    assert not torch.equal(a.train.x, c.train.x)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="classes"):
        teacher_task(classes=1)
    with pytest.raises(ValueError, match="margin"):
        teacher_task(margin=-1)


def test_student_learns_and_threads_are_restored() -> None:
    task = teacher_task(n_train=2048, n_test=512, n_calibration=8, dim=16, seed=0)
    model = mlp(16, 64, task.classes, seed=0)
    threads = torch.get_num_threads()
    chance = accuracy(model, task.test)
    losses = train_classifier(model, task.train, steps=150, seed=0)
    assert torch.get_num_threads() == threads
    assert losses[-1] < losses[0] / 2
    assert accuracy(model, task.test) > max(0.7, chance + 0.3)
