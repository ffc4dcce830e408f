"""Lab 08 checks on real processes: the solutions pass; a stub, a wrong reduction, a
reduction per parameter, a bucketed DDP that only reduces at the end or ignores no_sync,
accumulation that communicates on every micro-batch and the reference itself fail, naming what
is wrong."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from labsim.checks import CheckFailed
from labsim.checks import data_parallel as c
from labsim.course.notebook import as_shown
from labsim.parallel.data_parallel import (
    DataParallelBucket,
    average_gradients,
    broadcast_parameters,
    lm_loss,
)

from .solution_cells import exercises

pytestmark = pytest.mark.multiprocess
S = exercises("08_data_parallel")


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


class PerParameter(torch.nn.Module):
    """One blocking all-reduce per parameter in its hook: right numbers, no buckets."""

    def __init__(self, module, bucket_cap_bytes):  # type: ignore[no-untyped-def]
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, 0)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):  # type: ignore[no-untyped-def]
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()

    def forward(self, *args):  # type: ignore[no-untyped-def]
        return self.module(*args)

    def finish_gradient_synchronization(self):  # type: ignore[no-untyped-def]
        pass


class AtTheEnd(torch.nn.Module):
    """Buckets of the right sizes, all reduced after backward (no overlap)."""

    def __init__(self, module, bucket_cap_bytes):  # type: ignore[no-untyped-def]
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, 0)
        self.buckets, current, size = [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_cap_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)

    def forward(self, *args):  # type: ignore[no-untyped-def]
        return self.module(*args)

    def finish_gradient_synchronization(self):  # type: ignore[no-untyped-def]
        for bucket in self.buckets:
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else
                              p.new_zeros(p.numel()) for p in bucket]) / dist.get_world_size()
            dist.all_reduce(flat)
            offset = 0
            for p in bucket:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()


class IgnoresNoSync(S["BucketDDP"]):  # type: ignore[misc,valid-type]
    """The solution with a no_sync() that does nothing: right numbers, twice the traffic."""

    @contextlib.contextmanager
    def no_sync(self):  # type: ignore[no-untyped-def]
        yield


def stub(*args):  # type: ignore[no-untyped-def]
    raise NotImplementedError


def test_the_solutions_pass(capsys: pytest.CaptureFixture[str]) -> None:
    c.naive_ddp(S["sync_parameters"], S["average_gradients"])
    c.bucketed_ddp(S["BucketDDP"])
    c.accumulation(S["accumulation_step"])
    out = as_shown(capsys.readouterr().out)
    assert "PASS naive_ddp: 6/6" in out and "PASS bucketed_ddp: 10/10" in out
    assert "PASS accumulation: 6/6" in out


def test_stubs_fail_without_processes() -> None:
    for call in (lambda: c.naive_ddp(stub, stub), lambda: c.bucketed_ddp(stub),
                 lambda: c.accumulation(stub)):
        with pytest.raises(CheckFailed, match="not implemented"):
            call()


def test_wrong_code_fails() -> None:
    with pytest.raises(CheckFailed, match="FAIL naive_ddp"):
        c.naive_ddp(S["sync_parameters"], summed_not_averaged)
    with pytest.raises(CheckFailed, match="all-reduces per step"):
        c.accumulation(accumulate_without_no_sync)


@pytest.mark.parametrize(("cls", "rule"), [
    (PerParameter, "one all-reduce per bucket"),
    (AtTheEnd, "launched during backward"),
    (IgnoresNoSync, "inside no_sync"),
    (DataParallelBucket, "calls labsim's own reference"),
], ids=["per-parameter", "at-the-end", "ignores-no-sync", "reference"])
def test_shortcuts_of_bucketed_ddp_score_zero(cls, rule: str) -> None:
    with pytest.raises(CheckFailed, match=rule) as info:
        c.bucketed_ddp(cls)
    assert "0/10 cases passed" in str(info.value)


def test_the_reference_naive_ddp_is_not_the_learners() -> None:
    with pytest.raises(CheckFailed, match="calls labsim's own reference"):
        c.naive_ddp(broadcast_parameters, average_gradients)


def test_expected_buckets_follow_the_contract() -> None:
    per_param = c.expected_buckets(1.0)
    assert len(per_param) == 11 and sum(n for n, _ in per_param) == 8 * 861
    assert c.expected_buckets(1e9) == [(8 * 861, False)]  # holds the unused layer
    assert [done for _, done in c.expected_buckets(600.0)][0] is False
