"""Memory checks pass a correct solution and fail wrong or missing ones."""

from __future__ import annotations

import pytest

from labsim.checks import CheckFailed
from labsim.checks import memory as check


def _stub(*args, **kwargs):
    raise NotImplementedError


def _states(n, precision, optimizer):
    w, g = (4, 4) if precision == "fp32" else (2, 2)
    master = 4 if precision == "mixed" else 0
    per_state = 4
    states = {"adam": 2, "sgd": 0, "sgd-momentum": 1}[optimizer]
    return (w * n, g * n, (master + states * per_state) * n)


def _zero(n, stage, dp):
    if stage not in (0, 1, 2, 3):
        raise ValueError("stage must be 0..3")
    return (2 * n / (dp if stage >= 3 else 1) + 2 * n / (dp if stage >= 2 else 1)
            + 12 * n / (dp if stage >= 1 else 1))


GOOD = {
    "gpt_params": lambda n, h, v, s: 12 * n * h * h + 13 * n * h + (v + s) * h + 2 * h,
    "model_state_bytes": _states,
    "layer_activation_bytes": lambda s, b, h, a, d=2, m=1: (
        s * b * h * (16 * d + 2 * m) + a * s * s * b * (2 * d + m) if m
        else s * b * h * 16 * d + a * s * s * b * d),
    "zero_model_state_bytes": _zero,
}
BAD = {
    "gpt_params": lambda n, h, v, s: 12 * n * h * h,  # the rule of thumb, not the count
    "model_state_bytes": lambda n, p, o: (2 * n, 2 * n, 8 * n),  # forgot the master copy
    "layer_activation_bytes": lambda s, b, h, a, d=2, m=1: s * b * h * 34,  # no attention
    "zero_model_state_bytes": lambda n, s, dp: 16 * n / dp,  # everything sharded always
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_passes_bad_and_stub_fail(name: str, capsys: pytest.CaptureFixture) -> None:
    getattr(check, name)(GOOD[name])
    assert capsys.readouterr().out.startswith(f"PASS {name}: ")
    with pytest.raises(CheckFailed, match=f"FAIL {name}"):
        getattr(check, name)(BAD[name])
    with pytest.raises(CheckFailed, match="not implemented"):
        getattr(check, name)(_stub)
