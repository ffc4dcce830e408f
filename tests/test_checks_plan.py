"""Planning checks (lab 15) pass a correct solution and fail the cheapest wrong ones and the
stub."""

from __future__ import annotations

import math

import pytest

from labsim.checks import CheckFailed
from labsim.checks import plan as check


def _stub(*args, **kwargs):
    raise NotImplementedError


def _days(params, tokens, gpus, peak, mfu):
    if not 0 < mfu <= 1:
        raise ValueError("mfu must be in (0, 1]")
    return 6 * params * tokens / (gpus * peak * mfu) / 86400


def _diagnose(shares, threshold=0.15):
    stalls = {"data": "data-starved", "communication": "communication-bound",
              "memory": "memory-bound"}
    worst = max(stalls, key=lambda k: shares[k])
    return stalls[worst] if shares[worst] > threshold else "compute-bound"


def _break_even(purchase, years, power_W, usd_per_kwh, pue, cloud):
    energy = power_W / 1000 * pue * usd_per_kwh
    if cloud <= energy:
        return math.inf
    return purchase / (years * 365.25 * 24) / (cloud - energy)


GOOD = {"training_days": _days, "diagnose": _diagnose, "break_even_utilisation": _break_even}
BAD = {
    # 2 N D: the forward pass only
    "training_days": lambda p, d, g, pk, m: 2 * p * d / (g * pk * m) / 86400,
    # the largest share, compute included
    "diagnose": lambda s: max(s, key=s.get).replace("compute", "compute-bound").replace(
        "data", "data-starved").replace("communication", "communication-bound").replace(
        "memory", "memory-bound"),
    # the purchase alone, electricity forgotten
    "break_even_utilisation": lambda pu, y, w, kwh, pue, c: pu / (y * 365.25 * 24) / c,
}
NO_VALIDATION = {"training_days": lambda p, d, g, pk, m: 6 * p * d / (g * pk * m) / 86400}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_passes_bad_and_stub_fail(name: str, capsys: pytest.CaptureFixture) -> None:
    getattr(check, name)(GOOD[name])
    assert capsys.readouterr().out.startswith(f"PASS {name}: ")
    with pytest.raises(CheckFailed, match=f"FAIL {name}"):
        getattr(check, name)(BAD[name])
    with pytest.raises(CheckFailed, match="not implemented"):
        getattr(check, name)(_stub)


def test_days_without_validation_fail() -> None:
    with pytest.raises(CheckFailed, match="FAIL training_days"):
        check.training_days(NO_VALIDATION["training_days"])


def test_calling_the_cost_model_is_refused() -> None:
    from labsim.cost import run_cost

    def via_library(params, tokens, gpus, peak, mfu):
        from labsim.hardware import GPU
        chip = GPU("x", {"bf16": peak}, 1e9, 1e9, "x", tdp_W=1)
        return run_cost(params, tokens, chip, gpus, mfu).days

    with pytest.raises(CheckFailed):
        check.training_days(via_library)


def test_the_threshold_matters() -> None:
    """A diagnosis without the 15 % threshold (any stall is the bottleneck) fails."""
    def no_threshold(shares):
        return _diagnose(shares, threshold=0.0)
    with pytest.raises(CheckFailed, match="FAIL diagnose"):
        check.diagnose(no_threshold)
