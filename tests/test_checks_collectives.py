"""Lab 07's checks pass on correct answers and fail, explaining, on wrong ones."""

from __future__ import annotations

import pytest

from labsim import busbw, collective_time, link
from labsim.checks import CheckFailed
from labsim.checks import collectives as check


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
