"""Roofline checks pass a correct solution and fail wrong or missing ones."""

from __future__ import annotations

import pytest

from labsim.checks import CheckFailed
from labsim.checks import roofline as check


def _stub(*args, **kwargs):
    raise NotImplementedError


def _mfu(flops, t, peak):
    if t <= 0 or peak <= 0:
        raise ValueError("time and peak must be > 0")
    return flops / t / peak


GOOD = {
    "matmul_flops": lambda m, n, k: 2 * m * n * k,
    "matmul_bytes": lambda m, n, k, d: (m * k + k * n + m * n) * d,
    "roofline_time": lambda f, b, p, bw: max(f / p, b / bw),
    "attainable_flops": lambda i, p, bw: min(p, i * bw),
    "mfu": _mfu,
    "mlp_step_flops": lambda s, b: 6 * b * sum(i * o for i, o in zip(s, s[1:])),
}
BAD = {
    "matmul_flops": lambda m, n, k: m * n * k,  # forgot that a multiply-add is 2 FLOPs
    "matmul_bytes": lambda m, n, k, d: (m * k + k * n) * d,  # forgot writing C
    "roofline_time": lambda f, b, p, bw: f / p + b / bw,  # no overlap assumed
    "attainable_flops": lambda i, p, bw: i * bw,  # no compute roof
    "mfu": lambda f, t, p: f / t / p,  # no validation
    "mlp_step_flops": lambda s, b: 2 * b * sum(i * o for i, o in zip(s, s[1:])),  # forward only
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_passes_bad_and_stub_fail(name: str, capsys: pytest.CaptureFixture) -> None:
    getattr(check, name)(GOOD[name])
    assert capsys.readouterr().out.startswith(f"PASS {name}: ")
    with pytest.raises(CheckFailed, match=f"FAIL {name}"):
        getattr(check, name)(BAD[name])
    with pytest.raises(CheckFailed, match="not implemented"):
        getattr(check, name)(_stub)
