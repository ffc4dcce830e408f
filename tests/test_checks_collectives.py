"""Lab 07's checks pass on correct answers and fail, explaining, on wrong ones.

The solution's ring all-reduce passes on awkward sizes (one launch); ``dist.all_reduce`` in
its place gives the right numbers and fails the ring rule, seen at the dispatcher.
"""

from __future__ import annotations

import pytest
import torch

from labsim import collective_time, link
from labsim.checks import CheckFailed, Outcome
from labsim.checks import collectives as check
from labsim.checks.collectives import check_worker
from labsim.course.notebook import as_shown
from labsim.experiments.collectives import rank_tensor
from labsim.lab.launcher import launch

from .solution_cells import exercises

pytestmark = pytest.mark.multiprocess
S = exercises("07_collectives")


def test_pure_checks_pass_on_the_solutions(capsys):
    check.ring_time(S["ring_allreduce_time"])
    check.bus_bandwidth(S["bus_bandwidth"])
    check.fit_alpha_beta(S["fit_alpha_beta"])
    assert as_shown(capsys.readouterr().out).count("PASS") == 3
    # the textbook form is labsim's closed form (line rate) when the size divides
    assert S["ring_allreduce_time"](8e9, 8, 300e9, 3.4e-6) == pytest.approx(
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


def test_the_solution_passes_and_all_reduce_breaks_the_ring_rule(capsys):
    check.ring_allreduce(S["ring_allreduce"])
    assert "PASS ring_allreduce: 8/8" in as_shown(capsys.readouterr().out)

    def library(tensor):
        import torch.distributed as dist

        dist.all_reduce(tensor)
        return tensor

    with pytest.raises(CheckFailed, match="point to point only") as info:
        check.ring_allreduce(library)
    assert "0/8 cases passed" in str(info.value)


def direct_exchange(tensor):
    """Each chunk sent straight to the rank that owns it, then each sum straight to everyone:
    2(p-1) sends of one chunk per rank, like a ring, but to every rank."""
    import torch.distributed as dist

    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(tensor.view(-1), p))
    reqs = [dist.isend(chunks[peer].contiguous(), peer) for peer in range(p)
            if peer != rank and chunks[peer].numel()]
    for peer in range(p):
        if peer != rank and chunks[rank].numel():
            buf = torch.empty_like(chunks[rank])
            dist.recv(buf, peer)
            chunks[rank] += buf
    for r in reqs:
        r.wait()
    reqs = [dist.isend(chunks[rank].contiguous(), peer) for peer in range(p)
            if peer != rank and chunks[rank].numel()]
    for peer in range(p):
        if peer != rank and chunks[peer].numel():
            dist.recv(chunks[peer], peer)
    for r in reqs:
        r.wait()
    return tensor


def test_a_direct_exchange_moves_a_ring_s_bytes_and_fails_the_ring_rule():
    with pytest.raises(CheckFailed, match="sends only to its successor") as info:
        check.ring_allreduce(direct_exchange)
    assert "rank 0 sent to ranks [1, 2]" in str(info.value)


def both(rank, world):
    sizes = [1, 3, 4, 5, 97, 10_000]
    dtypes = ["float64"] * 5 + ["int64"]
    return check_worker(rank, world, S["ring_allreduce"], sizes, dtypes)


def test_the_worker_reports_each_rank_plain_results_and_messages():
    result = launch(both, 3)
    for per_rank in result:
        for case in per_rank:
            assert isinstance(case.outcome, Outcome) and not case.outcome.error
            expected = sum(rank_tensor(r, case.numel, getattr(torch, case.dtype)).double()
                           for r in range(3))
            assert torch.allclose(case.outcome.value.double(), expected), case
            assert case.in_place
            sends = [m for m in case.outcome.observed["messages"] if m[0] == "c10d::send"]
            assert len(sends) == (4 if case.numel >= 3 else len(sends))


def test_rank_tensors_differ_and_are_deterministic():
    assert torch.equal(rank_tensor(0, 5), rank_tensor(0, 5))
    assert not torch.equal(rank_tensor(0, 5), rank_tensor(1, 5))
    assert rank_tensor(2, 3, torch.int64).dtype == torch.int64


def _fit_absolute(rows):  # type: ignore[no-untyped-def]
    """Least squares on absolute seconds: the large sizes decide, alpha is lost in noise."""
    import numpy as np

    a = np.array([[2 * (p - 1), 2 * (p - 1) / p * s] for s, p, _ in rows])
    (alpha, beta), *_ = np.linalg.lstsq(a, np.array([t for *_, t in rows]), rcond=None)
    return alpha, 1 / beta


def _fit_two_points(rows):  # type: ignore[no-untyped-def]
    """alpha and B from the smallest and largest rows alone."""
    import numpy as np

    (s0, p0, t0), (s1, p1, t1) = rows[0], rows[-1]
    a = np.array([[2 * (p0 - 1), 2 * (p0 - 1) / p0 * s0], [2 * (p1 - 1), 2 * (p1 - 1) / p1 * s1]])
    alpha, beta = np.linalg.solve(a, [t0, t1])
    return alpha, 1 / beta


@pytest.mark.parametrize("fit", [_fit_absolute, _fit_two_points], ids=["absolute", "two-points"])
def test_alpha_beta_fits_that_are_not_the_relative_least_squares_fail(fit):
    with pytest.raises(CheckFailed, match="FAIL fit_alpha_beta: 3/6"):
        check.fit_alpha_beta(fit)


def test_the_reference_fit_recovers_alpha_and_bandwidth():
    from labsim.checks.collectives import _fit_rows
    from labsim.checks.collectives.reference import fit_alpha_beta

    alpha, bw = fit_alpha_beta(_fit_rows(12e-6, 3e9, (2, 3), [2.0**k for k in range(8, 24)]))
    assert alpha == pytest.approx(12e-6, rel=1e-9) and bw == pytest.approx(3e9, rel=1e-9)
