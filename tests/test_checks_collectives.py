"""Lab 07's checks pass on correct answers and fail, explaining, on wrong ones.

The reference ring all-reduce equals dist.all_reduce on awkward sizes (one launch).
"""

from __future__ import annotations

import pytest
import torch

from labsim import busbw, collective_time, link
from labsim.checks import CheckFailed
from labsim.checks import collectives as check
from labsim.checks.collectives import check_worker
from labsim.checks.collectives.reference import ring_allreduce
from labsim.experiments.collectives import rank_tensor
from labsim.lab.launcher import launch

pytestmark = pytest.mark.multiprocess


def ring_time(nbytes, n, bandwidth_Bps, latency_s):
    return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * nbytes / bandwidth_Bps


def test_pure_checks_pass_on_reference_answers(capsys):
    check.ring_time(ring_time)
    check.bus_bandwidth(busbw)
    assert capsys.readouterr().out.count("PASS") == 2
    # the textbook form is labsim's closed form (line rate) when the size divides
    assert ring_time(8e9, 8, 300e9, 3.4e-6) == pytest.approx(
        collective_time("allreduce", 8e9, 8, link("nvlink3"), achieved=False), rel=1e-12)


def test_checks_fail_on_wrong_answers():
    with pytest.raises(CheckFailed, match="FAIL ring_time"):
        check.ring_time(lambda s, n, b, a: 2 * (n - 1) * (a + s / b))  # forgot the 1/n
    with pytest.raises(CheckFailed, match="FAIL bus_bandwidth"):
        check.bus_bandwidth(lambda op, s, n, t: s / t)  # algbw, not busbw


def test_ring_allreduce_check_fails_fast_on_a_stub():
    def stub(tensor):
        raise NotImplementedError
    with pytest.raises(CheckFailed, match="not implemented"):
        check.ring_allreduce(stub)


def both(rank, world):
    sizes = [1, 3, 4, 5, 97, 10_000]
    dtypes = [torch.float64] * 5 + [torch.int64]
    return check_worker(rank, world, ring_allreduce, sizes, dtypes)


def test_ring_equals_all_reduce_on_sizes_the_world_does_not_divide():
    result = launch(both, 3)
    for per_rank in result:
        for case in per_rank:
            assert torch.allclose(case.got, case.expected, rtol=1e-12, atol=1e-12), case


def test_rank_tensors_differ_and_are_deterministic():
    assert torch.equal(rank_tensor(0, 5), rank_tensor(0, 5))
    assert not torch.equal(rank_tensor(0, 5), rank_tensor(1, 5))
    assert rank_tensor(2, 3, torch.int64).dtype == torch.int64
