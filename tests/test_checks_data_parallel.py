"""Lab 08 checks: the reference DDP passes, a stub and a wrong reduction fail (real
processes)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from labsim.checks import CheckFailed
from labsim.checks import data_parallel as c
from labsim.parallel.data_parallel import (
    DataParallelBucket,
    average_gradients,
    broadcast_parameters,
    lm_loss,
)

pytestmark = pytest.mark.multiprocess


def accumulate(ddp, optimizer, micro_batches):  # type: ignore[no-untyped-def]
    k, total = len(micro_batches), 0.0
    for i, mb in enumerate(micro_batches):
        if i < k - 1:
            with ddp.no_sync():
                loss = lm_loss(ddp, mb) / k
                loss.backward()
        else:
            loss = lm_loss(ddp, mb) / k
            loss.backward()
        total += float(loss.detach())
    ddp.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad()
    return total


def accumulate_without_no_sync(ddp, optimizer, micro_batches):  # type: ignore[no-untyped-def]
    total = 0.0
    for mb in micro_batches:
        loss = lm_loss(ddp, mb) / len(micro_batches)
        loss.backward()
        total += float(loss.detach())
    ddp.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad()
    return total


def summed_not_averaged(model):  # type: ignore[no-untyped-def]
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def stub(*args):  # type: ignore[no-untyped-def]
    raise NotImplementedError


def test_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    c.naive_ddp(broadcast_parameters, average_gradients)
    c.bucketed_ddp(DataParallelBucket)
    c.accumulation(accumulate)
    out = capsys.readouterr().out
    assert "PASS naive_ddp: 6/6" in out and "PASS bucketed_ddp: 7/7" in out
    assert "PASS accumulation: 6/6" in out


def test_stubs_fail_without_processes() -> None:
    for call in (lambda: c.naive_ddp(stub, stub), lambda: c.bucketed_ddp(stub),
                 lambda: c.accumulation(stub)):
        with pytest.raises(CheckFailed, match="NotImplementedError"):
            call()


def test_wrong_code_fails() -> None:
    with pytest.raises(CheckFailed, match="FAIL naive_ddp"):
        c.naive_ddp(broadcast_parameters, summed_not_averaged)
    with pytest.raises(CheckFailed, match="all-reduces per step"):
        c.accumulation(accumulate_without_no_sync)
