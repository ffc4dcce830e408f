"""Lab 11's checks: schedules written as data and an executor on real processes; references
pass, stubs fail without processes, and each shortcut fails naming its rule."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labsim import pipeline as lp
from labsim.checks import CheckFailed
from labsim.checks import pipeline as c
from labsim.course.notebook import as_shown
from labsim.pipeline import Op


def my_gpipe(p, m):  # type: ignore[no-untyped-def]
    stage = tuple(Op("F", i) for i in range(m)) + tuple(Op("B", i) for i in range(m))
    return tuple(stage for _ in range(p))


def my_1f1b(p, m):  # type: ignore[no-untyped-def]
    out = []
    for s in range(p):
        warm = min(p - s - 1, m)
        ops = [Op("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [Op("F", warm + i), Op("B", i)]
        ops += [Op("B", i) for i in range(m - warm, m)]
        out.append(tuple(ops))
    return tuple(out)


def my_interleaved(p, m, v):  # type: ignore[no-untyped-def]
    total = m * v

    def f(k):  # type: ignore[no-untyped-def]
        return Op("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def b(k):  # type: ignore[no-untyped-def]
        return Op("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    out = []
    for s in range(p):
        warm = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
        ops = [f(k) for k in range(warm)]
        for k in range(total - warm):
            ops += [f(warm + k), b(k)]
        ops += [b(k) for k in range(total - warm, total)]
        out.append(tuple(ops))
    return tuple(out)


def one_at_a_time(p, m):  # type: ignore[no-untyped-def]
    """Valid but no 1F1B: each micro-batch's forward and backward before the next."""
    return tuple(tuple(op for i in range(m) for op in (Op("F", i), Op("B", i)))
                 for _ in range(p))


def stub(*args):  # type: ignore[no-untyped-def]
    raise NotImplementedError


def test_reference_schedules_pass(capsys: pytest.CaptureFixture[str]) -> None:
    c.gpipe(my_gpipe)
    c.one_f_one_b(my_1f1b)
    c.interleaved(my_interleaved)
    assert as_shown(capsys.readouterr().out).splitlines() == [
        "PASS gpipe: 8/8 cases passed", "PASS one_f_one_b: 8/8 cases passed",
        "PASS interleaved: 7/7 cases passed"]


@pytest.mark.parametrize("check, fn, rule", [
    (c.one_f_one_b, my_gpipe, "breaks a rule of this exercise: 1F1B keeps at most p - s "),
    (c.one_f_one_b, one_at_a_time, "breaks a rule of this exercise: 1F1B keeps at most p - s"),
    (c.gpipe, my_1f1b, "breaks a rule of this exercise: GPipe runs every forward"),
    (c.one_f_one_b, lambda p, m: lp.one_f_one_b(p, m),
     "calls labsim's own reference `labsim.pipeline.one_f_one_b`"),
    (c.interleaved, lambda p, m, v: lp.make_schedule("interleaved", p, m, v),
     "calls labsim's own reference `labsim.pipeline.make_schedule`"),
    (c.interleaved, lambda p, m, v: my_1f1b(p, m), "not a valid schedule"),
    (c.gpipe, lambda p, m: tuple(ops[::-1] for ops in my_gpipe(p, m)),
     "backward before its forward"),
    (c.one_f_one_b, stub, "not implemented yet"),
])
def test_shortcuts_fail_naming_the_rule(check, fn, rule) -> None:  # type: ignore
    with pytest.raises(CheckFailed, match=rule) as info:
        check(fn)
    assert " 0/" in str(info.value)


def interleaved_by_groups(p, m, v):  # type: ignore[no-untyped-def]
    """Honest, other code: Megatron-LM's forward and backward sequences built group by group,
    then dealt out as warm-up, one forward one backward, cool-down."""
    fwd = [Op("F", g * p + i, c) for g in range(m // p) for c in range(v) for i in range(p)]
    bwd = [Op("B", g * p + i, v - 1 - c) for g in range(m // p) for c in range(v)
           for i in range(p)]
    out = []
    for s in range(p):
        warm = len(fwd) if m == p else min(2 * (p - s - 1) + (v - 1) * p, len(fwd))
        ops, left = list(fwd[:warm]), list(bwd)
        for f in fwd[warm:]:
            ops += [f, left.pop(0)]
        out.append(tuple(ops + left))
    return tuple(out)


def torchs_interleaved_order(p, m, v):  # type: ignore[no-untyped-def]
    """The shortcut: PyTorch's ScheduleInterleaved1F1B computes the order (no process group
    needed to call its per-rank method on a stand-in)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import (
        ScheduleInterleaved1F1B,
        _ComputationType,
    )

    fake = SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m,
                           microbatches_per_round=m // max(1, m // p))
    return tuple(tuple(Op("F" if a.computation_type == _ComputationType.FORWARD else "B",
                          a.microbatch_index, a.stage_index // p)
                       for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(
                           fake, r) if a is not None) for r in range(p))


def torchs_helper_order(p, m, v):  # type: ignore[no-untyped-def]
    """The same shortcut through the private helper every torch interleaved schedule uses."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    return my_interleaved_with_warmups(p, m, v, [
        _get_warmup_ops(s, v, p, p, m, multiply_factor=2) for s in range(p)])


def my_interleaved_with_warmups(p, m, v, warmups):  # type: ignore[no-untyped-def]
    total = m * v
    f = lambda k: Op("F", (k // (p * v)) * p + k % p, (k // p) % v)  # noqa: E731
    b = lambda k: Op("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)  # noqa: E731
    out = []
    for warm in warmups:
        ops = [f(k) for k in range(warm)]
        for k in range(total - warm):
            ops += [f(warm + k), b(k)]
        out.append(tuple(ops + [b(k) for k in range(total - warm, total)]))
    return tuple(out)


def torchs_order_transcribed(p, m, v):  # type: ignore[no-untyped-def]
    """PyTorch's order written out by hand: valid, as fast, but not Megatron-LM's when m = p
    (its later stages start 1F1B before every forward has run)."""
    return my_interleaved_with_warmups(p, m, v, [min(2 * (p - s - 1) + (v - 1) * p, m * v)
                                                 for s in range(p)])


def test_an_honest_interleaved_order_written_otherwise_passes(
        capsys: pytest.CaptureFixture[str]) -> None:
    c.interleaved(interleaved_by_groups)
    assert as_shown(capsys.readouterr().out) == "PASS interleaved: 7/7 cases passed\n"


@pytest.mark.parametrize("fn, reference", [
    (torchs_interleaved_order, "torch.distributed.pipelining.schedules.ScheduleInterleaved1F1B"),
    (torchs_helper_order, "torch.distributed.pipelining.schedules._get_warmup_ops"),
])
def test_copying_torchs_interleaved_schedule_fails(fn, reference) -> None:  # type: ignore
    assert torchs_interleaved_order(4, 8, 2) == my_interleaved(4, 8, 2)  # same order if m > p
    with pytest.raises(CheckFailed, match=f"(?s) 0/7.*`{reference}`"):
        c.interleaved(fn)


def test_torchs_order_is_not_megatrons_when_m_equals_p() -> None:
    with pytest.raises(CheckFailed, match=r"(?s)5/7.*p=2, m=2, v=2.*Megatron-LM's order runs "
                       r"Op\('F', 1, 1\).*all of them since m = p"):
        c.interleaved(torchs_order_transcribed)


def pipeline_step(stage, ops, inputs, targets, loss_fn, shape):  # type: ignore
    rank, world = dist.get_rank(), dist.get_world_size()
    m = sum(op.kind == "F" for op in ops)
    saved, sends, total = {}, [], 0.0
    for kind, i, _ in ops:
        if kind == "F":
            if rank == 0:
                x = inputs[i]
            else:
                x = torch.empty(shape, dtype=torch.float64)
                dist.recv(x, rank - 1)
                x.requires_grad_(True)
            y = stage(x)
            if rank == world - 1:
                y = loss_fn(y, targets[i]) / m
                total += float(y)
            else:
                sends.append(dist.isend(y.detach(), rank + 1))
            saved[i] = (x, y)
        else:
            x, y = saved.pop(i)
            if rank == world - 1:
                y.backward()
            else:
                grad = torch.empty_like(y)
                dist.recv(grad, rank + 1)
                y.backward(grad)
            if rank > 0:
                sends.append(dist.isend(x.grad, rank - 1))
    for s in sends:
        s.wait()
    return total


def loss_for_every_rank(stage, ops, inputs, targets, loss_fn, shape):  # type: ignore
    """The shortcut: right numbers, plus an all-reduce so that every rank knows the loss."""
    total = torch.tensor([pipeline_step(stage, ops, inputs, targets, loss_fn, shape)],
                         dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) if dist.get_rank() == dist.get_world_size() - 1 else 0.0


def with_the_reference(stage, ops, inputs, targets, loss_fn, shape):  # type: ignore
    from labsim.parallel.pipeline import run_stage

    return run_stage(stage, ops, rank=dist.get_rank(), world=dist.get_world_size(),
                     inputs=inputs, targets=targets, loss_fn=loss_fn,
                     activation_shape=shape, dtype=torch.float64)


@pytest.mark.multiprocess
def test_the_executor_passes_and_its_shortcuts_fail(capsys: pytest.CaptureFixture[str]) -> None:
    c.pipeline_step(pipeline_step)
    assert as_shown(capsys.readouterr().out) == "PASS pipeline_step: 9/9 cases passed\n"
    with pytest.raises(CheckFailed, match="(?s)0/9.*breaks a rule of this exercise: a "
                       "pipeline talks point to point only"):
        c.pipeline_step(loss_for_every_rank)
    with pytest.raises(CheckFailed, match="(?s)0/9.*calls labsim's own reference "
                       "`labsim.parallel.pipeline.run_stage`"):
        c.pipeline_step(with_the_reference)
    with pytest.raises(CheckFailed, match="(?s)0/9.*NotImplementedError"):
        c.pipeline_step(stub)
