"""The teacher-student task: seeded, disjoint, margin respected; the student learns it."""

from __future__ import annotations

import pytest
import torch

from labsim.lab import classify


def test_task_is_deterministic_and_sized() -> None:
    a = classify.teacher_task(n_train=100, n_test=50, n_calibration=20, dim=8, seed=3)
    b = classify.teacher_task(n_train=100, n_test=50, n_calibration=20, dim=8, seed=3)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    assert (len(a.train.y), len(a.test.y), len(a.calibration.y)) == (100, 50, 20)
    assert a.train.x.shape == (100, 8) and int(a.train.y.max()) < a.classes
    everything = torch.cat([a.train.x, a.test.x, a.calibration.x])
    assert torch.unique(everything, dim=0).shape[0] == 170  # disjoint splits
    c = classify.teacher_task(n_train=100, n_test=50, n_calibration=20, dim=8, seed=4)
    assert not torch.equal(a.train.x, c.train.x)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="classes"):
        classify.teacher_task(classes=1)
    with pytest.raises(ValueError, match="margin"):
        classify.teacher_task(margin=-1)


def test_student_learns_and_threads_are_restored() -> None:
    task = classify.teacher_task(n_train=2048, n_test=512, n_calibration=8, dim=16, seed=0)
    model = classify.mlp(16, 64, task.classes, seed=0)
    threads = torch.get_num_threads()
    chance = classify.accuracy(model, task.test)
    losses = classify.train_classifier(model, task.train, steps=150, seed=0)
    assert torch.get_num_threads() == threads
    assert losses[-1] < losses[0] / 2
    assert classify.accuracy(model, task.test) > max(0.7, chance + 0.3)
